"""A job's parallel layout as one value with named axes, and the rank <-> file numbering DeepSpeed uses.

DeepSpeed numbers a checkpoint's files by model-parallel rank ``mp = pp * TP + tp`` (one
``mp_rank_XX_model_states.pt`` each) and, within each, by DP rank (one optimizer file per DP rank);
the reader lists rank files model-parallel rank major, so file ``mp * DP + dp`` is DP rank ``dp``
of model-parallel rank ``mp``. That numbering lives here and nowhere else: the reader, the plan, the
synthetic writer, the resume decision and both loaders ask this value. ``ep`` (expert parallelism)
is the axis a mixture-of-experts checkpoint would add; nothing reads or writes one yet, so any value
but 1 is refused rather than misnumbered (docs/EXTENDING.md). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_ucp.errors import PlanError

AXES = ("tp", "pp", "dp")
"""The axes a change of layout is described by, in the order logs name them."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            if int(getattr(self, axis)) < 1:
                raise PlanError(f"{axis.upper()} size must be >= 1, got {getattr(self, axis)}")
        if self.ep != 1:
            raise PlanError(f"EP={self.ep}: expert-parallel checkpoints are not supported (docs/EXTENDING.md)")

    @property
    def model_parallel(self) -> int:
        """Model-parallel ranks: one model-states file each."""
        return self.tp * self.pp

    @property
    def world(self) -> int:
        return self.model_parallel * self.dp * self.ep

    def mp_rank(self, pp_rank: int, tp_rank: int) -> int:
        self._check(pp_rank, self.pp, "pipeline stage")
        self._check(tp_rank, self.tp, "TP rank")
        return pp_rank * self.tp + tp_rank

    def coordinates_of(self, mp_rank: int) -> tuple[int, int]:
        """(pipeline stage, TP rank) of a model-parallel rank."""
        self._check(mp_rank, self.model_parallel, "model-parallel rank")
        return divmod(mp_rank, self.tp)

    def rank_file_index(self, mp_rank: int, dp_rank: int) -> int:
        """Index of DP rank ``dp_rank`` of ``mp_rank`` among all optimizer files, model-parallel rank major."""
        self._check(mp_rank, self.model_parallel, "model-parallel rank")
        self._check(dp_rank, self.dp, "DP rank")
        return mp_rank * self.dp + dp_rank

    def with_dp(self, dp: int) -> "ParallelLayout":
        return replace(self, dp=int(dp))

    def model_axes(self) -> tuple[int, int]:
        """(TP, PP): what a native load cannot change."""
        return self.tp, self.pp

    def describe(self) -> str:
        """``DP=4`` or ``TP=2 x PP=2 x DP=1``, for logs."""
        return f"TP={self.tp} x PP={self.pp} x DP={self.dp}" if self.model_parallel > 1 else f"DP={self.dp}"

    def describe_change(self, to: "ParallelLayout") -> str:
        """``DP changed 768 -> 512`` / ``TP changed 1 -> 2, DP changed 4 -> 2``; or ``layout unchanged (...)``."""
        parts = [
            f"{axis.upper()} changed {getattr(self, axis)} -> {getattr(to, axis)}"
            for axis in AXES
            if getattr(self, axis) != getattr(to, axis)
        ]
        return ", ".join(parts) if parts else f"layout unchanged (TP={to.tp}, PP={to.pp}, DP={to.dp})"

    @staticmethod
    def _check(index: int, size: int, what: str) -> None:
        if not 0 <= index < size:
            raise PlanError(f"{what} {index} does not exist (0..{size - 1})")
