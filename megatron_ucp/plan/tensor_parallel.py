"""How one parameter is cut between tensor-parallel ranks, and where each slice's elements sit in the whole.

Pure (no I/O, no torch). Megatron splits a parameter across TP ranks in one of three ways: along
one dimension (column-parallel weights and the vocabulary on dim 0, row-parallel weights on dim 1),
not at all (layer norms and other replicated parameters), or as ``n`` sub-parameters stacked on
dim 0 and each split on dim 0 (SwiGLU's ``dense_h_to_4h``: rank ``k`` holds ``[W1_k; W2_k]``).
A :class:`TpLayout` says which; :func:`slice_runs` maps a slice's flat elements to the whole
parameter's flat elements as contiguous runs. Conversion merges slices with it, the loader cuts
them with it, and both sides of the accounting use the same runs, so "every element exactly once"
is one statement for both directions.

The layout comes from, best first: what megatron-ucp's save hook recorded from the live module's
``tensor_model_parallel`` / ``partition_dim`` attributes (:data:`TP_LAYOUT_KEY`, present at every TP
size), else Megatron's ``universal_checkpoint_info`` patterns (:func:`layout_from_patterns`), which
carry the replicated and row-parallel patterns only when the checkpoint was saved at TP > 1.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from megatron_ucp.errors import PlanError
from megatron_ucp.format import dsformat as F

TP_LAYOUT_KEY = "ucp_tp_layout"
"""Model-states key the save hook writes: parameter name -> :meth:`TpLayout.to_record`."""


def tp_pp_of_states(states: Mapping) -> Optional[tuple[int, int]]:
    """(TP, PP) a model-states dict records: DeepSpeed's ``checkpoint_parallel_dimensions`` (0.19+),
    else Megatron's saved ``args``; None when it records neither."""
    dims = states.get(F.CHECKPOINT_PARALLEL_DIMENSIONS)
    if isinstance(dims, Mapping) and "tp_degree" in dims and "pp_degree" in dims:
        return int(dims["tp_degree"]), int(dims["pp_degree"])
    args = states.get("args")
    tp = getattr(args, "tensor_model_parallel_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    if isinstance(tp, int) and isinstance(pp, int):
        return tp, pp
    return None


@dataclass(frozen=True)
class TpLayout:
    """How a parameter is divided between TP ranks (:mod:`megatron_ucp.plan.tensor_parallel`)."""

    replicated: bool = False
    dim: int = 0
    """Partition dimension when split."""
    sub_params: int = 1
    """Equal sub-parameters stacked on dim 0, each split on dim 0 (``dim`` is then 0)."""
    vocab: bool = False
    """Dim 0 is the (padded) vocabulary."""

    def __post_init__(self) -> None:
        if self.sub_params < 1 or (self.sub_params > 1 and self.dim != 0):
            raise PlanError(f"invalid TP layout {self}: sub-parameters are stacked and split on dim 0")

    def to_record(self) -> dict:
        return {
            "replicated": self.replicated,
            "partition_dim": self.dim,
            "sub_params": self.sub_params,
            "vocab": self.vocab,
        }

    @classmethod
    def from_record(cls, record: Mapping) -> "TpLayout":
        return cls(
            replicated=bool(record.get("replicated", False)),
            dim=int(record.get("partition_dim", 0)),
            sub_params=int(record.get("sub_params", 1)),
            vocab=bool(record.get("vocab", False)),
        )

    def describe(self) -> str:
        if self.replicated:
            return "replicated"
        text = f"split dim {self.dim}"
        if self.sub_params > 1:
            text += f", {self.sub_params} sub-params"
        return text + (", vocabulary" if self.vocab else "")


@dataclass(frozen=True)
class Run:
    """``length`` elements at ``slice_offset`` of a TP slice are at ``full_offset`` of the whole parameter."""

    slice_offset: int
    full_offset: int
    length: int


def _check_divisible(name: str, shape: Sequence[int], dim: int, parts: int) -> None:
    if dim >= len(shape):
        raise PlanError(f"{name}: partition dim {dim} outside its shape {tuple(shape)}")
    if shape[dim] % parts:
        raise PlanError(f"{name}: dimension {dim} of {tuple(shape)} does not divide into {parts} equal TP slices")


def slice_shape(full: Sequence[int], layout: TpLayout, tp: int, name: str = "parameter") -> tuple[int, ...]:
    """Shape of one TP rank's slice of a parameter of shape ``full``."""
    full = tuple(full)
    if layout.replicated or tp == 1:
        return full
    _check_divisible(name, full, layout.dim, tp * layout.sub_params)
    out = list(full)
    out[layout.dim] //= tp
    return tuple(out)


def full_shape(piece: Sequence[int], layout: TpLayout, tp: int) -> tuple[int, ...]:
    """Shape of the whole parameter whose TP slices have shape ``piece``."""
    piece = tuple(piece)
    if layout.replicated or tp == 1:
        return piece
    out = list(piece)
    out[layout.dim] *= tp
    return tuple(out)


def slice_runs(full: Sequence[int], layout: TpLayout, tp: int, rank: int, name: str = "parameter") -> tuple[Run, ...]:
    """TP rank ``rank``'s slice, in its own flat order, as contiguous runs of the whole parameter.

    Split on ``dim`` with the dimensions before it ``outer`` and after it ``inner``: slice row ``o``
    holds ``[rank * w, (rank + 1) * w)`` of that dimension (``w = full[dim] / tp``), one run of
    ``w * inner`` elements per ``o``. Sub-parameters: one run per sub-parameter. Runs are merged
    when they touch, so dim 0 (and any split whose outer dimensions are 1) is a single run.
    """
    if not 0 <= rank < tp:
        raise PlanError(f"{name}: TP rank {rank} outside 0..{tp - 1}")
    full = tuple(full)
    numel = math.prod(full)
    if layout.replicated or tp == 1:
        return (Run(0, 0, numel),) if numel else ()
    shape = slice_shape(full, layout, tp, name)
    if layout.sub_params > 1:
        sub = numel // layout.sub_params
        piece = sub // tp
        runs = [Run(k * piece, k * sub + rank * piece, piece) for k in range(layout.sub_params)]
        return _merged(runs)
    outer = math.prod(full[: layout.dim])
    inner = math.prod(full[layout.dim + 1 :])
    width = shape[layout.dim] * inner
    stride = full[layout.dim] * inner
    return _merged(Run(o * width, o * stride + rank * width, width) for o in range(outer))


def _merged(runs: Iterable[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for run in runs:
        if run.length <= 0:
            continue
        if (
            out
            and out[-1].slice_offset + out[-1].length == run.slice_offset
            and out[-1].full_offset + out[-1].length == run.full_offset
        ):
            last = out.pop()
            run = Run(last.slice_offset, last.full_offset, last.length + run.length)
        out.append(run)
    return tuple(out)


def runs_between(runs: Sequence[Run], start: int, length: int) -> tuple[Run, ...]:
    """The part of ``runs`` covering slice elements ``[start, start + length)``, offsets unchanged."""
    end = start + length
    out = []
    for run in runs:
        lo, hi = max(start, run.slice_offset), min(end, run.slice_offset + run.length)
        if lo < hi:
            out.append(Run(lo, run.full_offset + lo - run.slice_offset, hi - lo))
    return tuple(out)


@dataclass(frozen=True)
class MegatronPatterns:
    """Megatron-DeepSpeed's ``universal_checkpoint_info``, one value: the parameter-name patterns that say
    how TP divides a parameter (when no layout was recorded at save) and which vocabulary rows the
    universal output keeps. Read once from the model states (``deepspeed.reader.ModelStates.patterns``)."""

    vocabulary_patterns: tuple[str, ...] = ()
    original_vocab_size: Optional[int] = None
    replicated_patterns: tuple[str, ...] = ()
    row_parallel_patterns: tuple[str, ...] = ()
    two_sub_param_patterns: tuple[str, ...] = ()
    saved_tp: int = 1
    """The TP size of the checkpoint the patterns come from: below 2 they say nothing of replication."""

    def complete(self) -> bool:
        """Whether the patterns alone describe every TP layout (Megatron writes replicated and
        row-parallel patterns only when saving at TP > 1)."""
        return self.saved_tp > 1

    def is_vocabulary(self, name: str) -> bool:
        return _matches(self.vocabulary_patterns, name)

    def is_replicated(self, name: str) -> bool:
        return _matches(self.replicated_patterns, name)

    def is_row_parallel(self, name: str) -> bool:
        return _matches(self.row_parallel_patterns, name)

    def has_two_sub_params(self, name: str) -> bool:
        return _matches(self.two_sub_param_patterns, name)


def _matches(patterns: Iterable[str], name: str) -> bool:
    return any(re.match(p, name) for p in patterns)


def layout_from_patterns(name: str, rules: MegatronPatterns) -> TpLayout:
    """The layout Megatron's patterns give ``name`` (what stock ``ds_to_universal`` assumes)."""
    vocab = rules.is_vocabulary(name)
    if rules.is_replicated(name):
        return TpLayout(replicated=True, vocab=vocab)
    if rules.has_two_sub_params(name):
        return TpLayout(sub_params=2, vocab=vocab)
    return TpLayout(dim=1 if rules.is_row_parallel(name) else 0, vocab=vocab)


def resolve_layouts(
    names: Iterable[str], recorded: Optional[Mapping[str, Mapping]], rules: MegatronPatterns, source: str
) -> dict[str, TpLayout]:
    """Each parameter's layout: recorded by the save hook when the checkpoint has it, else from the
    patterns. Without a record, a checkpoint saved at TP=1 has no replicated or row-parallel
    patterns: its layouts are only right for TP=1, and :func:`layouts_known` says so."""
    out = {}
    for name in names:
        record = (recorded or {}).get(name)
        if record is not None:
            layout = TpLayout.from_record(record)
            if rules.has_two_sub_params(name) and layout.sub_params == 1 and not layout.replicated:
                layout = TpLayout(sub_params=2, vocab=layout.vocab)  # Megatron's attribute cannot say this
            if rules.is_vocabulary(name) and not layout.vocab:
                layout = TpLayout(layout.replicated, layout.dim, layout.sub_params, vocab=True)
            out[name] = layout
        else:
            out[name] = layout_from_patterns(name, rules)
    if recorded:
        missing = sorted(set(out) - set(recorded))
        if missing:
            raise PlanError(
                f"{source}: records the TP layout of some parameters but not of {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}"
            )
    return out


@dataclass(frozen=True)
class SavedRecord:
    """One model-states file's TP-layout record and the parameters that file's rank holds."""

    source: str
    """The file, and its place in the layout (``.../mp_rank_02_model_states.pt (pipeline stage 1, TP rank 0)``)."""
    record: Optional[Mapping[str, Mapping]]
    """What the save hook wrote under :data:`TP_LAYOUT_KEY`; None when the file has none."""
    params: tuple[str, ...]
    """The parameters this rank optimizes (its ``param_shapes``)."""


def merge_layout_records(saved: Sequence[SavedRecord]) -> Optional[dict[str, Mapping]]:
    """One TP-layout record for the whole checkpoint, from every model-parallel rank's own.

    Each pipeline stage's save hook records the parameters of its own stage, in its own file, so
    the record of a PP > 1 checkpoint is the union of its files'. Every file must record every
    parameter its rank holds, and where two files record one parameter (TP ranks of one stage, the
    stages holding a tied embedding) they must agree. None when no file has a record (saved
    without the hooks: Megatron's patterns decide); a record in some files only is an error, since
    it means files of different saves were mixed.
    """
    with_record = [s for s in saved if s.record is not None]
    if not with_record:
        return None
    if len(with_record) != len(saved):
        bare = [s.source for s in saved if s.record is None]
        raise PlanError(
            f"{bare[0]}: has no TP-layout record ({TP_LAYOUT_KEY!r}) while {with_record[0].source} "
            "has one: model-states files of different saves mixed?"
        )
    merged: dict[str, Mapping] = {}
    first_seen: dict[str, str] = {}
    for s in with_record:
        missing = sorted(set(s.params) - set(s.record))
        if missing:
            raise PlanError(
                f"{s.source}: records the TP layout of some of its parameters but not of "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        for name in s.params:
            layout = TpLayout.from_record(s.record[name])
            if name in merged and TpLayout.from_record(merged[name]) != layout:
                raise PlanError(
                    f"{s.source}: records {name!r} as {layout.describe()}, but {first_seen[name]} "
                    f"records it as {TpLayout.from_record(merged[name]).describe()}"
                )
            merged.setdefault(name, s.record[name])
            first_seen.setdefault(name, s.source)
    return merged


def layouts_known(recorded: Optional[Mapping], rules: MegatronPatterns) -> bool:
    """Whether the layouts can be trusted at another TP size (recorded, or patterns saved at TP > 1)."""
    return bool(recorded) or rules.complete()
