"""ZeRO-3 partition geometry: every parameter split across DP on its own. Pure: no I/O, no torch.

At stage 3 DeepSpeed partitions each parameter separately (``partition_parameters.py``): a
parameter of ``n`` elements gets ``S = ceil(n / dp)`` elements on every rank, rank ``r`` holding
elements ``[r * S, (r + 1) * S)`` and zeros past ``n`` (its own tail padding, at most ``dp - 1``
elements, all on the last ranks). A rank's optimizer partition of a sub-group (``fp32_flat_groups[i]``
and the optimizer states of sub-group ``i``) is its slices of the sub-group's parameters, one after
the other. Nothing about the flat buffer is aligned beyond that, so the geometry is a list of
per-parameter partitions (:class:`ParamPartition`) per sub-group (:class:`SubGroupGeometry`): the
counterpart of :class:`~megatron_ucp.plan.geometry.GroupGeometry` for stages 1 and 2.

A parameter smaller than the DP size has ranks whose slice is all padding; stock converters before
0.19.3 extract that padding as data (:func:`stock_stage3_problems`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Optional, Sequence

from megatron_ucp.errors import PlanError, UcpError
from megatron_ucp.plan.reshard import Read, cut_run


@dataclass(frozen=True)
class ParamPartition:
    """One parameter's ZeRO-3 partition at one DP size."""

    numel: int
    dp: int

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise UcpError(f"DP size must be >= 1, got {self.dp}")
        if self.numel < 0:
            raise UcpError(f"invalid parameter size {self.numel}")

    @property
    def partition_size(self) -> int:
        """S: elements every rank holds of this parameter (``ceil(n / dp)``)."""
        return -(-self.numel // self.dp)

    @property
    def padding_total(self) -> int:
        """Zeros at the end of the last slices (``dp * S - n``)."""
        return self.dp * self.partition_size - self.numel

    def start(self, rank: int) -> int:
        """Where rank ``rank``'s slice starts in the whole (flattened) parameter."""
        self._check_rank(rank)
        return rank * self.partition_size

    def true_length(self, rank: int) -> int:
        """Real elements in rank ``rank``'s slice; the rest is padding."""
        self._check_rank(rank)
        s = self.partition_size
        return max(0, min(s, self.numel - rank * s))

    def padding(self, rank: int) -> int:
        return self.partition_size - self.true_length(rank)

    def padding_only_ranks(self) -> list[int]:
        """Ranks whose slice of this parameter holds no real element (only when ``n`` is small next to DP)."""
        s = self.partition_size
        if s == 0:  # an empty parameter: nothing to hold, nothing to pad
            return []
        return list(range(-(-self.numel // s), self.dp))

    def stock_extracted_length(self, rank: int) -> int:
        """What stock ``ds_to_universal`` before 0.19.3 takes from rank ``rank``'s slice:
        ``min(S, |n - r * S|)``, i.e. padding taken as data on a padding-only rank."""
        self._check_rank(rank)
        s = self.partition_size
        return min(s, abs(self.numel - rank * s))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise UcpError(f"rank {rank} out of range for DP size {self.dp}")


@dataclass(frozen=True)
class SubGroupGeometry:
    """A ZeRO-3 optimizer sub-group at one DP size: its parameters' slices, one after the other,
    make up every rank's partition (the same size on every rank)."""

    numels: tuple[int, ...]
    dp: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "numels", tuple(int(n) for n in self.numels))
        for n in self.numels:
            ParamPartition(n, self.dp)  # validates

    @cached_property
    def params(self) -> tuple[ParamPartition, ...]:
        return tuple(ParamPartition(n, self.dp) for n in self.numels)

    @property
    def numel(self) -> int:
        """Real elements of the sub-group (every parameter's ``n``)."""
        return sum(self.numels)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter's slice starts inside a rank's partition."""
        out, at = [], 0
        for p in self.params:
            out.append(at)
            at += p.partition_size
        return tuple(out)

    @property
    def partition_size(self) -> int:
        """Elements of every rank's partition (sum of the parameters' ``S``)."""
        return sum(p.partition_size for p in self.params)

    def true_length(self, rank: int) -> int:
        """Real elements of rank ``rank``'s partition (summed over the parameters' slices)."""
        return sum(p.true_length(rank) for p in self.params)

    def fragments(self, rank: int) -> list[tuple[int, int, int]]:
        """``(parameter index, start in the partition, length)`` of every real run on rank ``rank``."""
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            if p.true_length(rank):
                out.append((i, off, p.true_length(rank)))
        return out

    def padding_only(self) -> list[tuple[int, list[int]]]:
        """``(parameter index, ranks)`` for each parameter with padding-only slices."""
        return [(i, p.padding_only_ranks()) for i, p in enumerate(self.params) if p.padding_only_ranks()]

    def at_dp(self, dp: int) -> "SubGroupGeometry":
        """The same sub-group at another DP size (the split into sub-groups is redone by DeepSpeed at
        load; see :func:`sub_groups`)."""
        return SubGroupGeometry(self.numels, dp)


def sub_groups(numels: Sequence[int], dp: int, sub_group_size: int) -> list[list[int]]:
    """How DeepSpeed cuts one param group into sub-groups (``_create_fp16_sub_groups``): parameters in
    order, a sub-group closed once its partition elements reach ``sub_group_size``; the whole group
    when ``sub_group_size`` is at least the group's partition elements. Returns parameter indices."""
    sizes = [ParamPartition(n, dp).partition_size for n in numels]
    if not numels:
        return []
    if sub_group_size >= sum(sizes):
        return [list(range(len(numels)))]
    out: list[list[int]] = []
    current: list[int] = []
    acc = 0
    for i, size in enumerate(sizes):
        current.append(i)
        acc += size
        if acc >= sub_group_size or i == len(sizes) - 1:
            out.append(current)
            current, acc = [], 0
    return out


@dataclass(frozen=True)
class Stage3StockProblem:
    """Where stock ``ds_to_universal`` mishandles a stage-3 checkpoint, and what happens."""

    sub_group: int
    param: int
    """Index inside the sub-group (-1: the whole sub-group)."""
    what: str


def stock_stage3_problems(
    groups: Sequence[SubGroupGeometry], reads_every_sub_group: bool, strips_padding_only_slices: bool
) -> list[Stage3StockProblem]:
    """What a stock converter of the given behaviour does wrong with these sub-groups.

    ``reads_every_sub_group``: False before 0.18 (only sub-group 0 is read; every parameter of the
    others is missing from its output). ``strips_padding_only_slices``: False before 0.19.3 (a
    padding-only slice is extracted as ``min(S, |n - r S|)`` elements of data, so the parameter
    comes out longer than it is).
    """
    problems = []
    for g, geo in enumerate(groups):
        if g > 0 and not reads_every_sub_group:
            problems.append(Stage3StockProblem(g, -1, f"sub-group {g} ({len(geo.numels)} parameters) is not read"))
            continue
        if strips_padding_only_slices:
            continue
        for i, ranks in geo.padding_only():
            p = geo.params[i]
            extra = sum(p.stock_extracted_length(r) for r in ranks)
            if not extra:  # |n - r S| is 0 on the first padding-only rank: nothing wrong when it is the only one
                continue
            problems.append(
                Stage3StockProblem(
                    g, i, f"{extra} padding elements of ranks {ranks[0]}..{ranks[-1]} taken as data ({p.numel} real)"
                )
            )
    return problems


@dataclass(frozen=True)
class ParamPlace:
    """Where one parameter lives in a ZeRO-3 layout at one DP size."""

    name: str
    numel: int
    sub_group: int
    offset: int
    """Where its slice starts inside every rank's partition of the sub-group."""
    param_group: int
    position: int
    """Where its first element sits in its param group's parameters laid end to end, unpadded: the same
    at every DP size and every sub-group cut, so the checksums of a save and of a load meet there."""


@dataclass(frozen=True)
class Run:
    """Real elements of one parameter in one rank's partition of a sub-group."""

    param: str
    offset: int
    """In the rank's partition of the sub-group."""
    start: int
    """In the parameter (flattened)."""
    length: int
    position: int
    """In the param group (:attr:`ParamPlace.position` + ``start``)."""


@dataclass(frozen=True)
class Stage3Groups:
    """One model-parallel coordinate's optimized parameters as ZeRO-3 cuts them at one DP size: per optimizer
    sub-group, its parameters (name, numel) in order, and the param group each sub-group belongs to.

    Both sides of a stage-3 resume are one of these: the save's (``param_shapes`` per sub-group, and the
    sub-groups each param group lists in the rank files) and the live optimizer's (``fp16_groups``,
    ``sub_group_to_group_id``). The sub-groups depend on the DP size (``sub_group_size`` counts partition
    elements), the param groups and their parameters' order do not: that is what a reshard keeps.
    """

    sub_groups: tuple[tuple[tuple[str, int], ...], ...]
    param_group_of: tuple[int, ...]
    dp: int
    unit: ClassVar[str] = "sub-group"
    """What a group of this layout is called in messages (:class:`~megatron_ucp.plan.partitioned.Partitioned`)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "sub_groups", tuple(tuple((str(n), int(k)) for n, k in group) for group in self.sub_groups)
        )
        object.__setattr__(self, "param_group_of", tuple(int(g) for g in self.param_group_of))
        if len(self.param_group_of) != len(self.sub_groups):
            raise UcpError(
                f"{len(self.sub_groups)} sub-groups but {len(self.param_group_of)} param-group indices for them"
            )
        if list(self.param_group_of) != sorted(self.param_group_of):
            raise UcpError(f"sub-groups must follow their param groups in order, got {list(self.param_group_of)}")
        names = [n for group in self.sub_groups for n, _ in group]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise UcpError(f"parameters listed twice in the sub-groups: {twice[:3]}")
        for h in range(len(self.sub_groups)):
            self.geometry(h)  # validates numels and DP

    def geometry(self, sub_group: int) -> SubGroupGeometry:
        return SubGroupGeometry(tuple(n for _, n in self.sub_groups[sub_group]), self.dp)

    @cached_property
    def param_groups(self) -> tuple[tuple[tuple[str, int], ...], ...]:
        """Each param group's parameters, end to end (the sub-groups of a group concatenated)."""
        count = (max(self.param_group_of) + 1) if self.param_group_of else 0
        out: list[list[tuple[str, int]]] = [[] for _ in range(count)]
        for group, g in zip(self.sub_groups, self.param_group_of):
            out[g].extend(group)
        return tuple(tuple(g) for g in out)

    @cached_property
    def places(self) -> dict[str, ParamPlace]:
        out: dict[str, ParamPlace] = {}
        position: dict[int, int] = {}
        for h, (group, g) in enumerate(zip(self.sub_groups, self.param_group_of)):
            geo = self.geometry(h)
            for (name, numel), offset in zip(group, geo.offsets):
                at = position.get(g, 0)
                out[name] = ParamPlace(name, numel, h, offset, g, at)
                position[g] = at + numel
        return out

    def partition_of(self, name: str) -> ParamPartition:
        return ParamPartition(self.places[name].numel, self.dp)

    def runs(self, rank: int, sub_group: int) -> list[Run]:
        """The real runs of ``rank``'s partition of a sub-group, in partition order."""
        out = []
        for name, _ in self.sub_groups[sub_group]:
            place, part = self.places[name], self.partition_of(name)
            length = part.true_length(rank)
            if length:
                start = part.start(rank)
                out.append(Run(name, place.offset, start, length, place.position + start))
        return out

    def true_lengths(self, rank: int) -> list[int]:
        return [self.geometry(h).true_length(rank) for h in range(len(self.sub_groups))]

    def param_true_lengths(self, rank: int) -> list[list[int]]:
        return [[p.true_length(rank) for p in self.geometry(h).params] for h in range(len(self.sub_groups))]

    def partition_sizes(self) -> list[int]:
        return [self.geometry(h).partition_size for h in range(len(self.sub_groups))]

    def reads_to(self, new: "Stage3Groups", rank: int) -> list[list[Read]]:
        """What new rank ``rank`` of ``new`` copies out of this layout's rank files (per parameter)."""
        return per_parameter_reads(self, new, rank)

    def needs(self, position: int, reads: Sequence[Sequence[Read]]) -> list[int]:
        """Every partition whole: a rank file records no fragment map, any slice of it may be read."""
        return self.partition_sizes()

    def fragments(self, position: int) -> None:
        """None: a ZeRO-3 rank file records no fragment map to check."""
        return None

    def partition_counts(self) -> None:
        """None: every sub-group is cut over the whole DP group."""
        return None

    def names(self, sub_group: int) -> list[str]:
        return [name for name, _ in self.sub_groups[sub_group]]

    def param_group(self, sub_group: int) -> int:
        return self.param_group_of[sub_group]

    def drawn_from(self, old: "Stage3Groups", sub_group: int) -> tuple[int, ...]:
        """The saved sub-groups the parameters of ``sub_group`` come from (another DP size cuts them anew)."""
        return tuple(sorted({old.places[name].sub_group for name in self.names(sub_group)}))

    def padding_only_ranks(self) -> list[int]:
        """Ranks whose every sub-group partition is padding (no real element at all)."""
        return [r for r in range(self.dp) if not any(self.true_lengths(r))]

    def at_dp(self, dp: int, sub_group_size: Optional[int] = None) -> "Stage3Groups":
        """The same parameters at another DP size, cut into sub-groups as DeepSpeed would with
        ``sub_group_size`` (None: one sub-group per param group)."""
        cut = sys.maxsize if sub_group_size is None else sub_group_size
        groups, owners = [], []
        for g, params in enumerate(self.param_groups):
            for members in sub_groups([n for _, n in params], dp, cut) or [[]]:
                groups.append(tuple(params[i] for i in members))
                owners.append(g)
        return Stage3Groups(tuple(groups), tuple(owners), dp)


def first_difference(saved: Sequence, live: Sequence) -> int:
    """Where a saved list of parameters and the live one first differ (the shorter's length when one only
    extends the other): the place a "differs from the model at position" message names."""
    return next((i for i, (a, b) in enumerate(zip(saved, live)) if a != b), min(len(saved), len(live)))


def group_count_difference(saved: int, live: int) -> str:
    """What a load says when the save and the live optimizer have different numbers of param groups, and the usual
    cause: Megatron-DeepSpeed builds one group at ``--zero-stage 3`` (its "1-D: no decay" rule sees ZeRO-3's
    placeholders) and two below it, so a stage change 1/2 <-> 3 of the fork's model does this."""
    return (
        f"the checkpoint has {saved} param groups, the optimizer {live} (the parameters are grouped otherwise than at "
        "the save: Megatron-DeepSpeed builds one group at --zero-stage 3 and two below it, so a ZeRO stage change "
        "between 1/2 and 3 does this; docs/limitations.md)"
    )


def same_parameters(old: Stage3Groups, new: Stage3Groups) -> None:
    """The two per-parameter layouts hold the same parameters in the same param groups and order; raises
    naming the first difference (another model, or the param groups built otherwise)."""
    if len(old.param_groups) != len(new.param_groups):
        raise PlanError(group_count_difference(len(old.param_groups), len(new.param_groups)))
    for g, (saved, live) in enumerate(zip(old.param_groups, new.param_groups, strict=True)):
        if saved == live:
            continue
        at = first_difference(saved, live)
        theirs = f"{saved[at][0]} ({saved[at][1]} elements)" if at < len(saved) else "nothing"
        ours = f"{live[at][0]} ({live[at][1]} elements)" if at < len(live) else "nothing"
        raise PlanError(
            f"param group {g} differs from the model at position {at}: the checkpoint has {theirs}, the model "
            f"{ours} ({len(saved)} vs {len(live)} parameters)"
        )


def per_parameter_reads(old: Stage3Groups, new: Stage3Groups, rank: int) -> list[list[Read]]:
    """Per sub-group of ``new``, the pieces new rank ``rank`` copies out of the old rank files, in partition
    order: each parameter's run cut at its old partitions. The parameters must be the same
    (:func:`same_parameters`)."""
    if not 0 <= rank < new.dp:
        raise PlanError(f"rank {rank} out of range for DP size {new.dp}")
    same_parameters(old, new)
    out: list[list[Read]] = []
    for h in range(len(new.sub_groups)):
        reads: list[Read] = []
        for run in new.runs(rank, h):
            source = old.places[run.param]
            size = old.partition_of(run.param).partition_size
            for r, offset, element, length in cut_run(run.start, run.start + run.length, size):
                reads.append(
                    Read(
                        r,
                        source.offset + offset,
                        run.offset + element - run.start,
                        length,
                        source.position + element,
                        source.sub_group,
                        run.param,
                    )
                )
        out.append(reads)
    return out
