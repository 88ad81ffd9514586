"""The live job as a load or a save sees it: where this rank sits in TP, PP, DP and EP, how TP divides each live
parameter, and this rank's share of the live optimizer as flat partitions and the parameter fragments in them.

TP and PP come from the ``mpu`` DeepSpeed was given (Megatron's ``parallel_state``, or the pipeline engine's grid)
through DeepSpeed's own version-tolerant helpers (:mod:`megatron_ucp.deepspeed.surface`), and from Megatron's
per-parameter ``tensor_model_parallel`` / ``partition_dim`` attributes, which describe the model being loaded into
(the checkpoint's layout is the reader's business). The save hook records the same attributes
(:func:`tp_layout_record`).

A load fills flat fp32 partitions (and the optimizer states kept under them) one fragment of one parameter at a
time; where those sit depends on the optimizer's layout: ZeRO-1/2 keep one flat partition per param group and
DeepSpeed's own fragment map (:func:`megatron_ucp.deepspeed.surface.fragment_address`), ZeRO-3 one per sub-group,
each parameter partitioned on its own (:class:`~megatron_ucp.plan.param_geometry.Stage3Groups`). :func:`live_groups`
gives both as the same values, so that one loader serves every stage.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import stage3_runtime, surface
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.collectives import comm
from megatron_ucp.plan.parallel_layout import ParallelLayout
from megatron_ucp.plan.param_geometry import Stage3Groups
from megatron_ucp.plan.tensor_parallel import TpLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpPlace:
    """This rank's place in tensor parallelism at load time."""

    size: int = 1
    rank: int = 0


def tensor_parallel_of(optimizer: Any) -> TpPlace:
    """TP size and rank from the optimizer's ``mpu`` (Megatron's, or DeepSpeed's pipeline grid)."""
    return TpPlace(*surface.tp_size_and_rank(surface.optimizer_mpu(optimizer)))


def live_tp_layout(
    lp: Any, entry: Any, tp: int, file_shape: tuple[int, ...], shape: Optional[tuple[int, ...]] = None
) -> TpLayout:
    """How TP divides the live parameter: Megatron's ``tensor_model_parallel`` / ``partition_dim``
    attributes (set at every TP size), the sub-parameter count and vocabulary flag from the file.
    ``shape``: the live parameter's (TP slice's) shape, when ``lp.shape`` is not it (ZeRO-3)."""
    info = entry if isinstance(entry, dict) else {}
    sub = int(info.get(F.PARAM_N_SUB_PARAMS, 1) or 1)
    vocab = bool(info.get(F.VOCAB_TENSOR, False))
    if tp == 1:
        return TpLayout(sub_params=sub, vocab=vocab)
    if hasattr(lp, "tensor_model_parallel"):
        if not lp.tensor_model_parallel:
            return TpLayout(replicated=True, vocab=vocab)
        dim = int(getattr(lp, "partition_dim", info.get(F.CAT_DIM, 0)))
        return TpLayout(dim=0 if sub > 1 else dim, sub_params=sub, vocab=vocab)
    if tuple(shape if shape is not None else lp.shape) == tuple(file_shape):  # no attributes: replicated
        return TpLayout(replicated=True, vocab=vocab)
    return TpLayout(dim=0 if sub > 1 else int(info.get(F.CAT_DIM, 0)), sub_params=sub, vocab=vocab)


def tp_layout_record(named_parameters: Any) -> Optional[dict[str, dict]]:
    """Each parameter's TP layout as the save hook records it
    (:data:`~megatron_ucp.plan.tensor_parallel.TP_LAYOUT_KEY`).

    From Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes, which it sets at every
    TP size, TP=1 included: what Megatron's ``universal_checkpoint_info`` only says at TP > 1. None
    when no parameter carries them (not a Megatron model: nothing to record).
    """
    params = list(named_parameters)
    if not any(hasattr(p, "tensor_model_parallel") for _, p in params):
        return None
    record = {}
    for name, p in params:
        split = bool(getattr(p, "tensor_model_parallel", False))
        dim = int(getattr(p, "partition_dim", 0)) if split else 0
        record[name] = TpLayout(replicated=not split, dim=max(dim, 0)).to_record()
    return record


def current_layout(engine: Any) -> ParallelLayout:
    """The running engine's layout: TP and PP from its ``mpu`` (Megatron's, or the pipeline grid), DP
    from the engine (its sequence-data-parallel size: the ranks that share one optimizer partition), EP from
    its expert groups."""
    mpu = getattr(engine, "mpu", None)
    dp = int(engine.seq_dp_world_size)
    return ParallelLayout(tp=surface.tp_size_and_rank(mpu)[0], pp=surface.pp_size(mpu), dp=dp, ep=live_ep(engine))


@dataclass(frozen=True)
class LiveJob:
    """The live job as one load reads it, once, at its start: what every step after it (the decision, the routes,
    the finish) reads instead of asking the engine again. The engine itself is kept for what only it can do: run
    DeepSpeed's own load and take what was read."""

    layout: ParallelLayout
    """TP and PP from the engine's ``mpu``, DP (the ranks that share one optimizer partition), EP."""
    tp: TpPlace
    zero_stage: Optional[int]
    per_parameter: bool
    """ZeRO-3: each parameter partitioned on its own (else one flat partition per param group)."""
    load_universal: bool
    """The engine loads universal folders (``--universal-checkpoint``)."""
    engine: Any = field(compare=False, repr=False)
    optimizer: Any = field(compare=False, repr=False)
    names: dict[Any, str] = field(compare=False, repr=False)
    """Live parameter -> name (the engine's map)."""

    # What a load asks of the live optimizer, each read when first asked (an explicit universal load asks little).

    @functools.cached_property
    def optimizer_layout(self) -> surface.OptimizerLayout:
        return surface.layout_of(self.optimizer)

    @functools.cached_property
    def dp_group(self) -> Any:
        return surface.dp_group(self.optimizer)

    @functools.cached_property
    def dp_rank(self) -> int:
        return comm().get_rank(group=self.dp_group)

    @functools.cached_property
    def dp_size(self) -> int:
        """The optimizer's DP group's size: the partitions each group is cut into (the dense ones)."""
        return comm().get_world_size(group=self.dp_group)

    @functools.cached_property
    def base(self) -> Any:
        """The torch optimizer the ZeRO optimizer wraps (its param groups and states)."""
        return surface.base_optimizer(self.optimizer)

    @functools.cached_property
    def groups(self) -> list[list[Any]]:
        """The live bf16 parameters of each group, where the optimizer's layout keeps them."""
        return self.optimizer_layout.groups(self.optimizer)

    @functools.cached_property
    def group_dp_groups(self) -> list[Any]:
        """One DP process group per param group (an expert group's is its expert-data-parallel group)."""
        return surface.group_dp_groups(self.optimizer)

    @functools.cached_property
    def optimized_params(self) -> dict[str, Any]:
        """The optimized parameters on this rank by name (the first rank is model-parallel rank 0)."""
        return {self.names[lp]: lp for group in self.groups for lp in group}

    @property
    def optimized(self) -> frozenset[str]:
        return frozenset(self.optimized_params)

    def masters(self) -> list[torch.Tensor]:
        """This rank's fp32 partitions (asked anew: a load may replace them)."""
        return self.optimizer_layout.masters(self.optimizer)

    def lp_partitions(self) -> list[list[torch.Tensor]]:
        """Each group's bf16 weights as the DP ranks' partitions of them."""
        return self.optimizer_layout.lp_partitions_of(self.optimizer)

    def weight_partitions(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each group's fp32 master partition on this rank beside this rank's partition of its bf16 weights."""
        return [
            (master, parts[comm().get_rank(group=group)])
            for parts, master, group in zip(self.lp_partitions(), self.masters(), self.group_dp_groups, strict=True)
        ]

    # What a load asks of the engine.

    @functools.cached_property
    def pipeline(self) -> bool:
        """A pipeline model: its weights are in per-layer files."""
        return surface.pipeline_module(self.engine)

    @functools.cached_property
    def slice_parallel(self) -> tuple[int, int]:
        """A pipeline model's model-parallel (slice) rank and size: which of each layer's files it loads."""
        return surface.slice_parallel(self.engine.module)

    @functools.cached_property
    def loads_fp32_masters(self) -> bool:
        return surface.loads_fp32_masters(self.engine)

    @functools.cached_property
    def node_local_storage(self) -> bool:
        return surface.node_local_storage(self.engine)


_COMPARED_AT_ONCE = 1 << 24
"""Elements of a partition rounded (and moved, under offload) at once: what the check costs in memory, bounded."""


def differing_partitions(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """How many (master, weights) pairs differ: the master not rounding exactly to the weights, bit for bit (compared
    where the masters live, a bounded slice at a time). Local."""
    differ = 0
    with torch.no_grad():
        for master, weights in pairs:
            m, w = master.reshape(-1), weights.reshape(-1)
            same = m.numel() == w.numel()
            for at in range(0, m.numel() if same else 0, _COMPARED_AT_ONCE):
                a, b = m[at : at + _COMPARED_AT_ONCE], w[at : at + _COMPARED_AT_ONCE]
                b = b if b.device == a.device else b.to(a.device)
                if not torch.equal(a.to(b.dtype).view(torch.uint8), b.contiguous().view(torch.uint8)):  # bits: -0.0
                    same = False
                    break
            differ += int(not same)
    return differ


def live_job(engine: Any) -> LiveJob:
    """The live job of an engine the hooks handle (:func:`megatron_ucp.integration.handled.unhandled_reason` is
    None for it)."""
    return LiveJob(
        layout=current_layout(engine),
        tp=TpPlace(*surface.tp_size_and_rank(getattr(engine, "mpu", None))),
        zero_stage=surface.zero_stage(engine),
        per_parameter=surface.engine_layout(engine).per_parameter,
        load_universal=bool(engine.load_universal_checkpoint()),
        engine=engine,
        optimizer=engine.optimizer,
        names=surface.param_names(engine),
    )


def live_ep(engine: Any) -> int:
    """The expert-parallel size of a mixture-of-experts job: DP over its expert groups' partition count (1 for
    any other job, and for ZeRO-3, whose experts the hooks leave to stock DeepSpeed)."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(engine, "has_moe_layers", False) or optimizer is None:
        return 1
    layout = surface.engine_layout(engine)
    if layout is None or layout.per_parameter:
        return 1
    sizes = surface.group_dp_sizes(engine.optimizer)
    return max(sizes) // min(sizes)


@dataclass(frozen=True)
class LiveFragment:
    """The elements ``[start, start + numel)`` of one live parameter this rank holds, at ``offset`` of its
    flat partition (of the whole parameter of ``shape``: a TP slice under tensor parallelism)."""

    lp: Any
    shape: tuple[int, ...]
    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class LiveGroup:
    """One flat partition this rank fills: a ZeRO-1/2 param group's, or a ZeRO-3 sub-group's."""

    param_group: int
    """Index into the wrapped optimizer's ``param_groups`` (its hyperparameters)."""
    flat: Any
    """This rank's fp32 partition; the optimizer keeps its states under it."""
    lps: list
    """Every live parameter of the group (held here or not): the folders the group needs."""
    fragments: list[LiveFragment]
    padding_unset: bool = False
    """ZeRO-3: DeepSpeed allocates a partition's tail padding uninitialized (``torch.empty``), so a load
    zeroes the partition before filling it (DeepSpeed's own universal load writes zeros there too)."""


def live_groups(optimizer: Any, names: dict[Any, str]) -> list[LiveGroup]:
    """This rank's flat partitions and the fragments in them, as the optimizer's layout keeps them:
    ZeRO-1/2 from DeepSpeed's fragment addresses, ZeRO-3 from the per-parameter geometry."""
    layout = surface.layout_of(optimizer)
    if not layout.per_parameter:
        base = surface.base_optimizer(optimizer)
        out = []
        for i, (param_group, lps) in enumerate(zip(base.param_groups, layout.groups(optimizer))):
            fragments = []
            for lp in lps:
                address = surface.fragment_address(lp)
                if address is not None:
                    fragments.append(LiveFragment(lp, tuple(lp.shape), *address))
            out.append(LiveGroup(i, param_group["params"][0], list(lps), fragments))
        return out
    groups = live_stage3_groups(optimizer, names)
    rank = comm().get_rank(group=surface.dp_group(optimizer))
    by_name = {names[lp]: lp for group in layout.groups(optimizer) for lp in group}
    return [
        LiveGroup(
            groups.param_group_of[h],
            flat,
            list(lps),
            [
                LiveFragment(
                    by_name[run.param],
                    stage3_runtime.param_shape(by_name[run.param]),
                    run.start,
                    run.length,
                    run.offset,
                )
                for run in groups.runs(rank, h)
            ],
            padding_unset=True,
        )
        for h, (flat, lps) in enumerate(zip(layout.masters(optimizer), layout.groups(optimizer)))
    ]


def live_stage3_groups(optimizer: Any, names: dict[Any, str]) -> Stage3Groups:
    """The live ZeRO-3 optimizer's sub-groups as a pure layout value (at its DP size)."""
    sub_groups, owners = stage3_runtime.stage3_sub_groups(optimizer, names)
    dp = comm().get_world_size(group=surface.dp_group(optimizer))
    return Stage3Groups(tuple(tuple(g) for g in sub_groups), tuple(owners), dp)


# ================================================================================================
# Writing into the live optimizer: what every route installs, and what the optimizer will create.
#
# Which states the live optimizer will create at its next step: what a load must have restored.
#
# An optimizer creates its state lazily, at its first step; a load that restores fewer states than the optimizer keeps
# leaves the rest to be created fresh (zeros), silently (the failure PyTorch DCP #126881 describes). The loads compare
# what they restored with :func:`expected_state_keys` and name what is missing.
# ================================================================================================

PROBED_MODULES = ("torch.optim", "megatron.optimizer", "intel_extension_for_pytorch.optim")
"""Optimizer classes safe to build and step once on a throwaway CPU tensor: plain PyTorch code, and IPEX's (its
``Lamb`` steps on the CPU with its fused kernel switched off). Not bitsandbytes' (a global manager keeps per-parameter
settings) nor DeepSpeed's (building one compiles its kernels)."""

_KNOWN_STATES = {
    "FusedAdam": ("step", "exp_avg", "exp_avg_sq"),
    "DeepSpeedCPUAdam": ("step", "exp_avg", "exp_avg_sq"),
    "FusedLamb": ("step", "exp_avg", "exp_avg_sq"),
    "DeepSpeedCPULamb": ("step", "exp_avg", "exp_avg_sq"),
}


def expected_state_keys(optimizer: torch.optim.Optimizer, group_index: int) -> Optional[frozenset[str]]:
    """The per-parameter states ``optimizer`` keeps for one group, discovered without touching it.

    For torch.optim classes, the fork's own (``megatron.optimizer``: Muon, Sophia, ADOPT, plain PyTorch) and IPEX's:
    build a throwaway instance with the group's hyperparameters on a 2-element CPU tensor (flat, as a ZeRO
    partition is) and take one step; for a few DeepSpeed optimizers: a table (building them would compile
    their kernels). None when unknown (then only the checkpoint's own consistency is checked). States already
    present in the live optimizer count too.
    """
    cls = type(optimizer)
    group = optimizer.param_groups[group_index]
    present: set[str] = set()
    for p in group["params"]:
        present.update(optimizer.state.get(p, {}).keys())
    keys: Optional[set[str]] = None
    if cls.__module__.startswith(PROBED_MODULES):
        try:
            accepted = inspect.signature(cls.__init__).parameters
            kwargs = {k: v for k, v in group.items() if k in accepted and k not in ("params", "self")}
            for flag in ("fused", "capturable", "differentiable", "foreach"):
                if flag in kwargs:
                    kwargs[flag] = False if flag != "foreach" else None
            probe_param = torch.zeros(2, requires_grad=True)
            probe_param.grad = torch.ones(2)
            probe = cls([probe_param], **kwargs)
            probe.step()
            keys = set(probe.state[probe_param].keys())
        except Exception as exc:
            log.debug("could not probe %s for its state names: %s", cls.__name__, exc)
    if keys is None and cls.__name__ in _KNOWN_STATES:
        keys = set(_KNOWN_STATES[cls.__name__])
        if group.get("amsgrad"):
            keys.add("max_exp_avg_sq")
    if keys is None:
        return frozenset(present) if present else None
    return frozenset(keys | present)


def live_value(portable: Any) -> Any:
    """A state of one value per partition as the optimizer keeps it, from its portable form
    (:func:`megatron_ucp.deepspeed.state_kinds.portable`): a 0-dim tensor of its dtype, or the value itself."""
    kind, *rest = portable
    return torch.tensor(rest[1], dtype=getattr(torch, rest[0])) if kind == "tensor" else rest[0]


def install_group_state(
    optimizer: Any,
    flat: torch.Tensor,
    lps: Iterable[Any],
    buffers: dict[str, torch.Tensor],
    step: Any,
    scalars: Optional[dict[str, Any]] = None,
) -> None:
    """Make ``buffers`` (flat, partition-sized), ``step`` and ``scalars`` (states of one value per partition)
    the base optimizer's state of one live group, and point each of ``lps`` at its optimizer fragments in them
    (what DeepSpeed's ``_link_hp_params`` does at ZeRO-1/2; a ZeRO-3 sub-group has no links: pass none). A
    scalar tensor goes where the partition is, as torch's own ``load_state_dict`` puts a non-step state."""
    state_dict = surface.base_optimizer(optimizer).state[flat]
    for state, buffer in buffers.items():
        state_dict[state] = buffer
    if step is not None:
        state_dict[F.STEP_STATE] = step.clone() if torch.is_tensor(step) else step
    for name, value in (scalars or {}).items():
        state_dict[name] = value.to(device=flat.device, copy=True) if torch.is_tensor(value) else value
    for lp in lps:
        surface.link_optimizer_fragments(lp, buffers)


def restore_global_state(optimizer: Any, state: dict) -> None:
    """The optimizer's state outside its partitions (loss scaler, clipping, ...), where its stage keeps it."""
    if surface.layout_of(optimizer).per_parameter:
        stage3_runtime.load_stage3_global_state(optimizer, state)
    else:
        surface.load_global_state(optimizer, state)


@dataclass(frozen=True)
class LoadCall:
    """One ``engine.load_checkpoint`` call as the resume carries it, from the decision to the finish: the live job,
    DeepSpeed's own load, the call's folder and arguments, and the plugin's configuration."""

    job: LiveJob
    original: Callable[..., Any]
    load_dir: str
    kwargs: dict
    config: UcpConfig

    @property
    def loads_states(self) -> bool:
        """The call loads the optimizer states (not only the module)."""
        return bool(self.kwargs["load_optimizer_states"]) and not self.kwargs["load_module_only"]

    def deepspeed(self, tag: Optional[str], **overrides: Any) -> Any:
        """DeepSpeed's own load of ``tag`` with the call's arguments (``overrides`` replacing some)."""
        return self.original(self.job.engine, self.load_dir, tag, **{**self.kwargs, **overrides})
