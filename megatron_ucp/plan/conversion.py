"""The conversion plan: which bytes of which rank file become which slice of which parameter.

Pure (no I/O, no torch). Call order: the reader turns each rank file into a :class:`RankLayout`
and the model-states file into :class:`ParamSpec` groups; :func:`build_plan` derives the
partition geometry, checks every fragment of ``param_slice_mappings`` against it and returns a
frozen :class:`ConversionPlan`; :func:`check_plan` re-verifies the finished plan (every output
element covered exactly once, every source range in bounds, no two items reading the same
source element); :func:`split_by_bytes` divides it between shares and workers deterministically.
Nothing here trusts ``group_paddings``: the mappings are the authority, the formula a cross-check.

Size: the plan's value types and the checks that state their invariants are one vocabulary; the
checks are most of it, and each sits next to the type it guards.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from megatron_ucp.errors import CheckpointFormatError, PlanError
from megatron_ucp.plan.geometry import NCCL_START_ALIGNMENT_FACTOR, GroupGeometry
from megatron_ucp.plan.param_geometry import SubGroupGeometry
from megatron_ucp.plan.tensor_parallel import MegatronPatterns, TpLayout


@dataclass(frozen=True)
class Fragment:
    """One entry of a rank's ``param_slice_mappings``: ``numel`` elements at ``start`` of the partition."""

    name: str
    start: int
    numel: int


@dataclass(frozen=True)
class RankGroupLayout:
    """What one rank file says about one param group (metadata only)."""

    fragments: tuple[Fragment, ...]
    state_lengths: tuple[tuple[str, int], ...]
    """(state name, elements stored) for every sharded state, ``fp32`` included."""
    recorded_padding: Optional[int] = None
    recorded_true_length: Optional[int] = None
    param_alignment_padding: int = 0
    has_step: bool = False
    """Sum of per-parameter alignment padding inside the flat buffer (DeepSpeedZeroOptimizer)."""

    def state_length(self, state: str) -> int:
        for name, length in self.state_lengths:
            if name == state:
                return length
        raise KeyError(state)

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.state_lengths)


@dataclass(frozen=True)
class RankLayout:
    rank: int
    groups: tuple[RankGroupLayout, ...]
    source: str = "<memory>"
    """Where this came from (a rank file path), for error messages."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    group: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class CopyItem:
    """Copy ``length`` elements from ``rank``'s partition at ``src_offset`` to the parameter at ``dst_offset``."""

    rank: int
    src_offset: int
    dst_offset: int
    length: int
    group: Optional[int] = None
    """The rank file's param group to read; None: the parameter's own (a model-parallel plan sets it)."""


@dataclass(frozen=True)
class ParamPlan:
    name: str
    group: int
    shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    flat_offset: int
    """Offset of the parameter's first element in the group's flat buffer."""
    items: tuple[CopyItem, ...]
    """Cover the whole parameter (``numel`` elements), padded vocabulary rows included."""
    cat_dim: int = 0
    vocab_tensor: bool = False
    n_sub_params: int = 1
    replicas: tuple[tuple[CopyItem, ...], ...] = ()
    """Other copies of a replicated parameter (the other TP ranks', a tied parameter's other pipeline
    stage), each covering the whole parameter: compared with ``items``, not written."""
    tp_layout: Optional[str] = None
    """How TP divides it (:meth:`~megatron_ucp.plan.tensor_parallel.TpLayout.describe`), when known."""
    vocab_whole: bool = False
    """A vocabulary parameter written whole, padded rows included (ZeRO-3: :data:`~megatron_ucp.format.dsformat.
    VOCAB_ROWS_WHOLE`), instead of trimmed to ``original_vocab_size``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)

    @property
    def kept_items(self) -> tuple[CopyItem, ...]:
        """The items of the ``param`` tensor DeepSpeed's loader reads (``out_shape``)."""
        return split_items(self.items, self.out_numel)[0]

    @property
    def padded_rows_items(self) -> tuple[CopyItem, ...]:
        """The items of the vocabulary rows trimmed from ``param`` (offsets from the first such row)."""
        return split_items(self.items, self.out_numel)[1]

    @property
    def padded_rows_shape(self) -> Optional[tuple[int, ...]]:
        """Shape of the trimmed vocabulary rows, kept beside ``param`` so that nothing is lost; None if none."""
        if self.out_numel == self.numel:
            return None
        return (self.shape[0] - self.out_shape[0], *self.shape[1:])


def split_items(items: Sequence[CopyItem], at: int) -> tuple[tuple[CopyItem, ...], tuple[CopyItem, ...]]:
    """Items (in output order) cut at output element ``at``: those before, and those after it
    with their output offsets counted from ``at``."""
    head: list[CopyItem] = []
    tail: list[CopyItem] = []
    for item in sorted(items, key=lambda i: i.dst_offset):
        end = item.dst_offset + item.length
        if end <= at:
            head.append(item)
        elif item.dst_offset >= at:
            tail.append(CopyItem(item.rank, item.src_offset, item.dst_offset - at, item.length, item.group))
        else:
            cut = at - item.dst_offset
            head.append(CopyItem(item.rank, item.src_offset, item.dst_offset, cut, item.group))
            tail.append(CopyItem(item.rank, item.src_offset + cut, 0, item.length - cut, item.group))
    return tuple(head), tuple(tail)


@dataclass(frozen=True)
class GroupPlan:
    index: int
    geometry: GroupGeometry | SubGroupGeometry
    """A ZeRO-1/2 param group's flat geometry, or a ZeRO-3 sub-group's per-parameter one."""
    states: tuple[str, ...]
    """Sharded states to write for every parameter of the group (``fp32`` first), discovered from the files."""
    has_step: bool
    param_names: tuple[str, ...]


@dataclass(frozen=True)
class ConversionPlan:
    dp: int
    groups: tuple[GroupPlan, ...]
    params: tuple[ParamPlan, ...]
    """Group-major, then flat order: each parameter reads a contiguous run of ranks."""
    _fingerprint: str = field(default="", compare=False)
    partitions: tuple[tuple[int, ...], ...] = ()
    """Model-parallel plans: per rank file (``CopyItem.rank``), each param group's partition size.
    Empty: every rank file has the geometry of :attr:`groups`."""
    tp: int = 1
    pp: int = 1

    @property
    def files(self) -> int:
        """Rank files the items index."""
        return len(self.partitions) if self.partitions else self.dp

    def partition_size(self, group: int, rank: int) -> int:
        if self.partitions:
            return self.partitions[rank][group]
        return self.groups[group].geometry.partition_size

    def fingerprint(self) -> str:
        """Stable identity of the plan, so cooperating converters can tell they do the same job."""
        if not self._fingerprint:
            key = (
                (self.dp, self.groups, self.params)
                if not self.partitions
                else (self.dp, self.groups, self.params, self.partitions, self.tp, self.pp)
            )
            h = hashlib.sha256(repr(key).encode())
            object.__setattr__(self, "_fingerprint", h.hexdigest()[:16])
        return self._fingerprint

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def _fail(source: str, message: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{source}: {message}", subject=source)


def build_plan(
    param_groups: Sequence[Sequence[ParamSpec]],
    ranks: Sequence[RankLayout],
    rules: MegatronPatterns = MegatronPatterns(),
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR,
    tp_layouts: Optional[Mapping[str, TpLayout]] = None,
    per_parameter: bool = False,
) -> ConversionPlan:
    """Derive geometry from the model's parameter shapes and the rank files, check, and plan.

    ``param_groups`` lists, per group, the parameters DeepSpeed partitioned (``param_shapes`` of the
    model-states file): ZeRO-1/2's param groups, one flat buffer each, whose fragments the files' fragment maps
    must agree with; or (``per_parameter``) ZeRO-3's optimizer sub-groups, each parameter cut on its own, where
    the files record no fragment map and each parameter's place follows from the shapes alone. ``ranks`` must
    hold every DP rank exactly once. Raises :class:`CheckpointFormatError` naming the rank file when the files
    contradict the geometry.
    """
    unit = ("optimizer sub-groups", ": files of another run, or another sub_group_size?") if per_parameter else ()
    ranks = checked_ranks(param_groups, ranks, *unit)
    group_plans = []
    param_plans: list[ParamPlan] = []
    for g, specs in enumerate(param_groups):
        group, params = plan_group(g, specs, ranks, rules, alignment_factor, tp_layouts, per_parameter)
        group_plans.append(group)
        param_plans.extend(params)

    plan = ConversionPlan(dp=len(ranks), groups=tuple(group_plans), params=tuple(param_plans))
    check_plan(plan)
    return plan


def checked_ranks(
    groups: Sequence[Sequence[ParamSpec]], ranks: Sequence[RankLayout], unit: str = "param groups", hint: str = ""
) -> list[RankLayout]:
    """The rank layouts in DP order, each DP rank exactly once, each with the model's ``groups`` (param groups,
    or ZeRO-3's optimizer sub-groups: ``unit``; ``hint`` follows the message of a file with another count)."""
    dp = len(ranks)
    if dp == 0:
        raise PlanError("no rank files to plan from")
    ranks = sorted(ranks, key=lambda r: r.rank)
    if [r.rank for r in ranks] != list(range(dp)):
        raise PlanError(f"rank files must cover DP ranks 0..{dp - 1} exactly once, got {[r.rank for r in ranks]}")
    for layout in ranks:
        if len(layout.groups) != len(groups):
            raise _fail(layout.source, f"has {len(layout.groups)} {unit}, the model states list {len(groups)}{hint}")
    return ranks


def plan_group(
    g: int,
    specs: Sequence[ParamSpec],
    ranks: Sequence[RankLayout],
    rules: MegatronPatterns = MegatronPatterns(),
    alignment_factor: int = NCCL_START_ALIGNMENT_FACTOR,
    tp_layouts: Optional[Mapping[str, TpLayout]] = None,
    per_parameter: bool = False,
) -> tuple[GroupPlan, list[ParamPlan]]:
    """One group partitioned over ``ranks`` (``RankLayout.rank`` 0..n-1, each holding group ``g``): its
    geometry, checked against every rank's file, and its parameters' plans (``per_parameter``: a ZeRO-3
    sub-group)."""
    layouts = [r.groups[g] for r in ranks]
    if len({s.name for s in specs}) != len(specs):
        raise PlanError(f"{_unit(per_parameter)} {g} lists a parameter name twice")
    if per_parameter:
        geo: GroupGeometry | SubGroupGeometry = SubGroupGeometry(tuple(s.numel for s in specs), len(ranks))
    else:
        internal_padding = {lay.param_alignment_padding for lay in layouts}
        if len(internal_padding) != 1:
            raise PlanError(
                f"param group {g}: rank files disagree on per-parameter alignment padding ({sorted(internal_padding)})"
            )
        numel = sum(s.numel for s in specs)
        geo = GroupGeometry(
            numel=numel, dp=len(ranks), padded_numel=numel + internal_padding.pop(), alignment_factor=alignment_factor
        )
    states = _check_states(g, ranks, geo, per_parameter)
    has_step = {lay.has_step for lay in layouts}
    if len(has_step) != 1:
        raise PlanError(f"{_unit(per_parameter)} {g}: some rank files store an optimizer step and some do not")
    group = GroupPlan(
        index=g, geometry=geo, states=states, has_step=has_step.pop(), param_names=tuple(s.name for s in specs)
    )
    if isinstance(geo, SubGroupGeometry):
        return group, _per_parameter_plans(specs, geo, rules, tp_layouts)
    return group, _plan_group(g, specs, ranks, geo, states, rules, tp_layouts)


def _unit(per_parameter: bool) -> str:
    return "sub-group" if per_parameter else "param group"


def _check_states(
    g: int, ranks: Sequence[RankLayout], geo: GroupGeometry | SubGroupGeometry, exact: bool
) -> tuple[str, ...]:
    """All ranks must store the same sharded states; none may be longer than a partition (``exact``, ZeRO-3:
    each exactly one partition long, since no fragment map says how much of it is real)."""
    unit = _unit(exact)
    size = geo.partition_size
    first = ranks[0].groups[g].state_names
    for layout in ranks:
        lay = layout.groups[g]
        if set(lay.state_names) != set(first):
            raise _fail(
                layout.source,
                f"{unit} {g} stores states {sorted(lay.state_names)}, rank 0 stores {sorted(first)}: files from "
                "different runs?",
            )
        for name, length in lay.state_lengths:
            if length > size or (exact and length < size):
                cause = "truncated file?" if length < size else "files of a different DP size or model?"
                raise _fail(
                    layout.source,
                    f"state {name!r} of {unit} {g} has {length} elements, "
                    f"{'fewer' if length < size else 'more'} than the partition size {size} implied by the "
                    f"model's parameter shapes at DP={geo.dp}: {cause}",
                )
        if lay.recorded_true_length is not None and lay.recorded_true_length != geo.true_length(layout.rank):
            raise _fail(
                layout.source,
                f"records true length {lay.recorded_true_length} for {unit} {g}, "
                f"geometry gives {geo.true_length(layout.rank)} (N={geo.numel}, DP={geo.dp})",
            )
    ordered = ["fp32"] if "fp32" in first else []
    ordered += sorted(s for s in first if s != "fp32")
    return tuple(ordered)


def _per_parameter_plans(
    specs: Sequence[ParamSpec],
    geo: SubGroupGeometry,
    rules: MegatronPatterns,
    tp_layouts: Optional[Mapping[str, TpLayout]],
) -> list[ParamPlan]:
    """Each parameter of a ZeRO-3 sub-group from its slice on every rank, at the place the shapes give it;
    vocabulary parameters stay whole (:attr:`ParamPlan.vocab_whole`)."""
    plans = []
    for spec, part, offset in zip(specs, geo.params, geo.offsets):
        items = tuple(
            CopyItem(rank=r, src_offset=offset, dst_offset=part.start(r), length=part.true_length(r))
            for r in range(geo.dp)
            if part.true_length(r)
        )
        layout = tp_layouts.get(spec.name) if tp_layouts else None
        plans.append(shape_output(spec, offset, items, rules, layout, trim_vocabulary=False))
    return plans


def _plan_group(
    g: int,
    specs: Sequence[ParamSpec],
    ranks: Sequence[RankLayout],
    geo: GroupGeometry,
    states: Sequence[str],
    rules: MegatronPatterns,
    tp_layouts: Optional[Mapping[str, TpLayout]] = None,
) -> list[ParamPlan]:
    s = geo.partition_size
    by_name = {spec.name: spec for spec in specs}
    pieces: dict[str, list[tuple[int, int, int]]] = {name: [] for name in by_name}  # (rank, start, numel)
    for layout in ranks:
        lay = layout.groups[g]
        spans = []
        for frag in lay.fragments:
            if frag.name not in by_name:
                raise _fail(
                    layout.source,
                    f"param_slice_mappings of group {g} names {frag.name!r}, which is not a "
                    "parameter of that group in the model states",
                )
            if frag.numel <= 0 or frag.start < 0 or frag.start + frag.numel > s:
                raise _fail(
                    layout.source,
                    f"fragment of {frag.name!r} at [{frag.start}, {frag.start + frag.numel}) "
                    f"lies outside the partition [0, {s}) of group {g}",
                )
            for state in states:
                have = lay.state_length(state)
                if frag.start + frag.numel > have:
                    raise _fail(
                        layout.source,
                        f"state {state!r} of group {g} holds {have} elements but the "
                        f"fragment of {frag.name!r} needs [{frag.start}, {frag.start + frag.numel}): "
                        "truncated file?",
                    )
            spans.append((frag.start, frag.start + frag.numel, frag.name))
            pieces[frag.name].append((layout.rank, frag.start, frag.numel))
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise _fail(layout.source, f"fragments of {an!r} and {bn!r} overlap in group {g}")
        end = spans[-1][1] if spans else 0
        true_len = geo.true_length(layout.rank)
        if end > true_len:
            raise _fail(layout.source, f"group {g} has real elements up to {end}, past the true length {true_len}")
        if geo.padded_numel == geo.numel:
            covered = sum(b - a for a, b, _ in spans)
            if covered != true_len:
                raise _fail(
                    layout.source,
                    f"fragments of group {g} cover {covered} of the {true_len} real elements "
                    "of this partition: param_slice_mappings incomplete?",
                )

    plans = []
    for spec in specs:
        frags = sorted(pieces[spec.name])
        total = sum(n for _, _, n in frags)
        if total != spec.numel:
            raise PlanError(
                f"parameter {spec.name!r} (group {g}, shape {tuple(spec.shape)}) has {total} of its "
                f"{spec.numel} elements in the rank files' param_slice_mappings"
            )
        items = []
        flat_offset = frags[0][0] * s + frags[0][1] if frags else 0
        dst = 0
        for rank, start, n in frags:
            if rank * s + start != flat_offset + dst:
                raise PlanError(
                    f"parameter {spec.name!r} is not contiguous in the flat buffer of group {g}: "
                    f"fragment on rank {rank} starts at {rank * s + start}, expected {flat_offset + dst}"
                )
            items.append(CopyItem(rank=rank, src_offset=start, dst_offset=dst, length=n))
            dst += n
        plans.append(
            shape_output(spec, flat_offset, tuple(items), rules, tp_layouts.get(spec.name) if tp_layouts else None)
        )
    plans.sort(key=lambda p: p.flat_offset)
    return plans


def shape_output(
    spec: ParamSpec,
    flat_offset: int,
    items: tuple[CopyItem, ...],
    rules: MegatronPatterns,
    layout: Optional[TpLayout] = None,
    replicas: tuple[tuple[CopyItem, ...], ...] = (),
    trim_vocabulary: bool = True,
) -> ParamPlan:
    """Apply vocabulary trimming and record the cat_dim / sub-parameter keys DeepSpeed's loader reads:
    from the parameter's TP layout when known (recorded at save, or a model-parallel checkpoint's
    patterns), else from Megatron's patterns as DeepSpeed reads them. ``trim_vocabulary=False`` (ZeRO-3):
    a vocabulary parameter stays whole and is marked so (:attr:`ParamPlan.vocab_whole`)."""
    out_shape = tuple(spec.shape)
    vocab = False
    vocab_rows = rules.original_vocab_size is not None and rules.is_vocabulary(spec.name)
    if vocab_rows and trim_vocabulary:
        if not out_shape or rules.original_vocab_size > out_shape[0]:
            raise PlanError(
                f"original_vocab_size {rules.original_vocab_size} exceeds the first dimension of "
                f"vocabulary parameter {spec.name!r} {out_shape}"
            )
        out_shape = (rules.original_vocab_size, *out_shape[1:])
        vocab = True
    if layout is not None:
        cat_dim, n_sub = (0, 1) if layout.replicated else (layout.dim, layout.sub_params)
    else:
        cat_dim = 1 if rules.is_row_parallel(spec.name) else 0
        n_sub = 2 if rules.has_two_sub_params(spec.name) else 1
    return ParamPlan(
        name=spec.name,
        group=spec.group,
        shape=tuple(spec.shape),
        out_shape=out_shape,
        flat_offset=flat_offset,
        items=items,
        cat_dim=cat_dim if n_sub == 1 else 0,
        vocab_tensor=vocab,
        n_sub_params=n_sub,
        replicas=replicas,
        tp_layout=layout.describe() if layout is not None else None,
        vocab_whole=vocab_rows and not trim_vocabulary,
    )


def check_plan(plan: ConversionPlan) -> None:
    """Re-verify a plan before any byte moves.

    Every output element covered exactly once, every item inside its rank's partition, and no
    source element read by two items (two parameters claiming the same bytes).
    """
    seen_names = set()
    reads: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for p in plan.params:
        if p.name in seen_names:
            raise PlanError(f"parameter {p.name!r} planned twice")
        seen_names.add(p.name)
        if not 0 <= p.group < len(plan.groups):
            raise PlanError(f"parameter {p.name!r} refers to param group {p.group}, plan has {len(plan.groups)}")
        for copy, items in enumerate((p.items, *p.replicas)):
            label = p.name if copy == 0 else f"{p.name} (copy {copy})"
            cursor = 0
            for item in sorted(items, key=lambda i: i.dst_offset):
                group = p.group if item.group is None else item.group
                if item.length <= 0:
                    raise PlanError(f"{label!r}: empty copy item {item}")
                if item.dst_offset != cursor:
                    kind = "gap" if item.dst_offset > cursor else "overlap"
                    raise PlanError(
                        f"{label!r}: {kind} in output coverage at element {cursor} (next item at {item.dst_offset})"
                    )
                if not 0 <= item.rank < plan.files:
                    raise PlanError(
                        f"{label!r}: copy item {item} outside the rank files (file {item.rank} of {plan.files})"
                    )
                s = plan.partition_size(group, item.rank)
                if item.src_offset < 0 or item.src_offset + item.length > s:
                    raise PlanError(f"{label!r}: copy item {item} outside rank partitions of size {s} at DP={plan.dp}")
                cursor += item.length
                reads.setdefault((group, item.rank), []).append((item.src_offset, item.src_offset + item.length, label))
            if cursor != p.numel:
                raise PlanError(f"{label!r}: items cover {cursor} of its {p.numel} elements")
        if p.out_numel > p.numel:
            raise PlanError(f"{p.name!r}: output shape {p.out_shape} larger than the parameter {p.shape}")
    for (g, rank), spans in reads.items():
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise PlanError(f"group {g} rank {rank}: {an!r} and {bn!r} read overlapping source elements")
    for group in plan.groups:
        missing = set(group.param_names) - seen_names
        if missing:
            raise PlanError(f"param group {group.index}: parameters not planned: {sorted(missing)}")


def split_by_bytes(
    params: Sequence[ParamPlan], parts: int, states_per_group: Mapping[int, int]
) -> list[list[ParamPlan]]:
    """Cut the (flat-ordered) parameters into ``parts`` contiguous runs of near-equal output bytes.

    Contiguous runs keep each worker on a contiguous range of rank files. Deterministic: every
    converter computing it from the same plan gets the same assignment without talking.
    """
    if parts < 1:
        raise PlanError(f"cannot split into {parts} parts")
    weights = [max(1, p.numel * states_per_group.get(p.group, 1)) for p in params]
    total = sum(weights)
    out: list[list[ParamPlan]] = [[] for _ in range(parts)]
    acc = 0
    for p, w in zip(params, weights):
        # the part whose byte range contains this parameter's midpoint
        k = min(parts - 1, int((acc + w / 2) * parts // total)) if total else 0
        out[k].append(p)
        acc += w
    return out


def share_of(plan: ConversionPlan, share_index: int, share_count: int) -> list[ParamPlan]:
    """The parameters converter ``share_index`` of ``share_count`` writes (e.g. one per node)."""
    if not 0 <= share_index < share_count:
        raise PlanError(f"share index {share_index} out of range for {share_count} shares")
    per_group = {g.index: len(g.states) for g in plan.groups}
    return split_by_bytes(plan.params, share_count, per_group)[share_index]
