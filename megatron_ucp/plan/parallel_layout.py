"""A job's parallel layout as one value with named axes, and the rank <-> file numbering DeepSpeed uses.

DeepSpeed numbers a checkpoint's files by model-parallel rank ``mp = pp * TP + tp`` (one
``mp_rank_XX_model_states.pt`` each) and, within each, by DP rank (one optimizer file per DP rank);
the reader lists rank files model-parallel rank major, so file ``mp * DP + dp`` is DP rank ``dp``
of model-parallel rank ``mp``. That numbering lives here and nowhere else: the reader, the plan, the
synthetic writer, the resume decision and both loaders ask this value.

``ep`` (expert parallelism) lives inside DP, as DeepSpeed-MoE builds it (E + D, at any TP and PP): the
DP ranks of one model-parallel rank form DP / EP expert-parallel groups of EP consecutive DP ranks, and
the ranks holding the same experts (every EP-th DP rank) form the expert-data-parallel group of size
DP / EP, over which the expert param groups are partitioned. Expert-parallel rank ``r`` holds the global
experts ``r * E/EP .. (r+1) * E/EP - 1``; each expert's weights are saved by its expert-data-parallel
rank 0 as ``layer_<l>_expert_<e>_mp_rank_<m>_model_states.pt``. The expert file numbering lives here too
(what reads and writes expert checkpoints is docs/EXTENDING.md, "An expert-parallel axis"). Pure: no I/O.
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
        if self.dp % self.ep:
            raise PlanError(f"EP={self.ep} does not divide DP={self.dp}: DeepSpeed-MoE builds EP inside DP")

    @property
    def model_parallel(self) -> int:
        """Model-parallel ranks: one model-states file each."""
        return self.tp * self.pp

    @property
    def world(self) -> int:
        """Every rank of the job (EP lives inside DP: it adds none)."""
        return self.model_parallel * self.dp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: how many ranks hold the same experts (the expert groups' partition count)."""
        return self.dp // self.ep

    def expert_parallel_rank(self, dp_rank: int) -> int:
        """Which experts a DP rank holds (DeepSpeed's ``expp_rank``)."""
        self._check(dp_rank, self.dp, "DP rank")
        return dp_rank % self.ep

    def expert_data_parallel_rank(self, dp_rank: int) -> int:
        """A DP rank's place in its expert-data-parallel group: its partition index of the expert groups."""
        self._check(dp_rank, self.dp, "DP rank")
        return dp_rank // self.ep

    def local_experts(self, experts: int) -> int:
        """Experts per expert-parallel rank."""
        if experts < 1 or experts % self.ep:
            raise PlanError(f"EP={self.ep} does not divide the {experts} experts")
        return experts // self.ep

    def experts_of(self, dp_rank: int, experts: int) -> range:
        """The global expert indices a DP rank holds."""
        local = self.local_experts(experts)
        first = self.expert_parallel_rank(dp_rank) * local
        return range(first, first + local)

    def expert_file(self, moe_layer: int, expert: int, mp_rank: int) -> str:
        """The file holding one expert's weights of one MoE layer (DeepSpeed counts MoE layers only)."""
        self._check(mp_rank, self.model_parallel, "model-parallel rank")
        return f"layer_{moe_layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"

    def expert_optimizer_file(self, expert_parallel_rank: int, mp_rank: int) -> str:
        """The per-expert-parallel-rank optimizer file (``{'optimizer': None}`` under ZeRO; not written from 0.19)."""
        self._check(expert_parallel_rank, self.ep, "expert-parallel rank")
        self._check(mp_rank, self.model_parallel, "model-parallel rank")
        return f"expp_rank_{expert_parallel_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"

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
        text = f"TP={self.tp} x PP={self.pp} x DP={self.dp}" if self.model_parallel > 1 else f"DP={self.dp}"
        return f"{text} (EP={self.ep})" if self.ep > 1 else text

    def describe_change(self, to: "ParallelLayout") -> str:
        """``DP changed 768 -> 512`` / ``TP changed 1 -> 2, DP changed 4 -> 2``; or ``layout unchanged (...)``."""
        parts = [
            f"{axis.upper()} changed {getattr(self, axis)} -> {getattr(to, axis)}"
            for axis in (*AXES, "ep")
            if getattr(self, axis) != getattr(to, axis)
        ]
        return ", ".join(parts) if parts else f"layout unchanged (TP={to.tp}, PP={to.pp}, DP={to.dp})"

    @staticmethod
    def _check(index: int, size: int, what: str) -> None:
        if not 0 <= index < size:
            raise PlanError(f"{what} {index} does not exist (0..{size - 1})")
