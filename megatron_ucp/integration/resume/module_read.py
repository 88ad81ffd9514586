"""The module of a restart, each byte read once across the job (``module_read = distributed``): after a ZeRO-1/2 save
every optimized weight is its fp32 master rounded, so the weights are rebuilt from the loaded masters (one
all-gather) instead of read whole on every rank, once proven equal to the saved ones where that matters; what has
no master is read as 1/DP slices and exchanged. How each route reads the module is decided in one place:
:func:`how_module_is_read`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from megatron_ucp import faults
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.model_states import with_leaves_replaced
from megatron_ucp.deepspeed.reader import flatten_module_states, load_raw
from megatron_ucp.deepspeed.tensor_reads import read_tensor_range
from megatron_ucp.errors import CheckpointFormatError, UcpError, UnsupportedError, briefly
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.exact_read import RangeReader, file_offset
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.integration import node_memory
from megatron_ucp.integration.collectives import Collective, comm, device
from megatron_ucp.integration.live_job import LiveJob, LoadCall, differing_partitions
from megatron_ucp.plan.resume import Route

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleRead:
    """How one load reads the module: once across the job (``distributed``: the optimized weights from the masters,
    what has no master read as 1/DP slices and exchanged) or whole on every rank, as DeepSpeed reads it
    (``why_full`` says why); ``lazy``: DeepSpeed's model-states loader reads the pickle without the weights' bytes."""

    why_full: Optional[str]
    lazy: bool

    @property
    def distributed(self) -> bool:
        return self.why_full is None


ZERO3_OWN_READ = "ZeRO-3: DeepSpeed's own optimizer load restores the module from the masters"


def how_module_is_read(call: LoadCall, route: Route) -> ModuleRead:
    """The one decision, per route. A universal load restores the module tensors from its folder, so only
    ``module_read`` decides; a native load of ZeRO-3 leaves the module to DeepSpeed's optimizer load (the reshard,
    which replaces that load, reads the model states lazily); a native load of ZeRO-1/2 reads the module once
    across the job unless :func:`full_module_reason` says why not."""
    job, config = call.job, call.config
    if route is not Route.NATIVE and route is not Route.RESHARD:
        why = None if config.module_read == "distributed" else f"module_read={config.module_read}"
        return ModuleRead(why, lazy=why is None or job.per_parameter)
    why = ZERO3_OWN_READ if job.per_parameter else full_module_reason(call)
    if why is not None and node_memory.weights_from_masters():
        raise UnsupportedError(
            f"{call.load_dir}: this memory save left the model's weights to the fp32 masters, and this load would "
            f"read them from its files ({why})",
            subject=call.load_dir,
        )
    return ModuleRead(why, lazy=why is None or (job.per_parameter and route is Route.RESHARD))


def full_module_reason(call: LoadCall) -> Optional[str]:
    """Why a ZeRO-1/2 native load reads the module as DeepSpeed does (every rank, whole); None: once across the
    job."""
    job, kwargs = call.job, call.kwargs
    if call.config.module_read != "distributed":
        return f"module_read={call.config.module_read}"
    if kwargs.get("load_module_only") or not kwargs.get("load_optimizer_states", True):
        return "no optimizer states to rebuild the weights from"
    if kwargs.get("custom_load_fn") is not None:
        return "a custom module load function"
    if getattr(job.engine, "has_moe_layers", False):
        return "mixture of experts: the experts' weights are in their own files, which DeepSpeed's module load reads"
    if not job.loads_fp32_masters:
        return "zero_optimization.load_from_fp32_weights is off: DeepSpeed derives the masters from the weights"
    return None


class SavedWeights:
    """The optimized weights a save holds, by their place in each param group's flat order
    (``param_shapes``): a range is read exactly (:class:`RangeReader`), never the whole module. ``sources``:
    parameter name -> (file, its saved tensor, mapped): the model states' module, or for a pipeline model
    its layer files (:func:`weight_sources`)."""

    def __init__(
        self, shapes: list[list[tuple[str, tuple[int, ...]]]], sources: dict[str, tuple[Path, RawTensor]]
    ) -> None:
        self.sources = sources
        self.places = []
        for group in shapes:
            offset, places = 0, []
            for name, shape in group:
                n = int(torch.Size(shape).numel())
                places.append((offset, n, name))
                offset += n
            self.places.append(places)
        self.readers: dict[Path, RangeReader] = {}

    @property
    def bytes_read(self) -> int:
        return sum(reader.bytes_read for reader in self.readers.values())

    def read(self, group: int, start: int, dest: torch.Tensor) -> None:
        """Elements ``[start, start + dest.numel())`` of the group's flat order into ``dest``."""
        stop = start + dest.numel()
        for offset, n, name in self.places[group]:
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo >= hi:
                continue
            path, saved = self.sources.get(name, (None, None))
            if saved is None or saved.numel() != n or not saved.is_contiguous():
                raise CheckpointFormatError(
                    f"{path or 'the save'}: holds no contiguous {n}-element weight {name!r} (the module lacks it, or "
                    "it is of another shape)",
                    subject=path,
                )
            reader = self.readers.setdefault(path, RangeReader(path))
            read_tensor_range(reader, saved.reshape(-1), lo - offset, dest.narrow(0, lo - start, hi - lo))

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def weight_sources(job: LiveJob, model_states: Path) -> dict[str, tuple[Path, RawTensor]]:
    """Each optimized parameter's saved tensor (mapped, not read) and its file, by the name the optimizer
    files use: from the model states' module, or, for a pipeline model, from its stage's layer files,
    matched to the live parameters by identity (a layer file's keys are the layer's own)."""
    if not job.pipeline:
        raw = load_raw(model_states, random_access=True)
        module = raw.get(F.MODULE) if isinstance(raw, dict) else None
        return {n: (model_states, t) for n, t in flatten_module_states(module).items() if isinstance(t, RawTensor)}
    optimized = _optimized_ids(job)
    out: dict[str, tuple[Path, RawTensor]] = {}
    for path, layer in _layer_files(job, model_states.parent):
        raw = load_raw(path, random_access=True)
        for key, live in layer.state_dict(keep_vars=True).items():
            saved = raw.get(key) if isinstance(raw, dict) else None
            if id(live) in optimized and isinstance(saved, RawTensor):
                out[optimized[id(live)]] = (path, saved)
    return out


def _optimized_ids(job: LiveJob) -> dict[int, str]:
    """A layer's tensors are the live parameters themselves: the optimized ones by identity, to their names."""
    return {id(lp): name for name, lp in job.optimized_params.items()}


def _layer_files(job: LiveJob, folder: Path) -> list[tuple[Path, Any]]:
    """This rank's stage's layers with state, and the layer file of this model-parallel rank each loads."""
    module = job.engine.module
    out = []
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        files = sorted(module.ckpt_layer_path_list(str(folder), idx))
        if not files:
            continue
        rank, world = job.slice_parallel
        out.append((Path(files[min(rank * len(files) // max(1, world), len(files) - 1)]), layer))
    return out


# ------------------------------------------------------------------------------------------------
# DeepSpeed's module load, for one load: the optimized parameters left alone, the rest read 1/DP
# ------------------------------------------------------------------------------------------------


def _read_the_rest(path: Path, names: list[str], group: Any, key: Optional[str] = F.MODULE) -> dict[str, torch.Tensor]:
    """The module tensors without a master, each byte read by one rank of ``group``: their bytes laid end
    to end, one slice per rank (read exactly), one all-gather. Every rank of the group holds the same
    file (one model-parallel coordinate), so every rank computes the same layout."""
    dist = comm()
    raw = load_raw(path, random_access=True)
    raw = flatten_module_states(raw.get(key) if key is not None else raw)
    pieces = []
    for name in names:
        tensor = raw.get(name)
        if not isinstance(tensor, RawTensor) or not tensor.is_contiguous() or file_offset(tensor) is None:
            return {}  # not a plain mapped tensor: DeepSpeed's own read of it (every rank), nothing shared
        pieces.append((name, tensor))
    total = sum(t.numel() * t.element_size() for _, t in pieces)
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    chunk = -(-total // world) if total else 0
    mine = torch.zeros(chunk, dtype=torch.uint8)
    lo, hi, at = rank * chunk, min(total, (rank + 1) * chunk), 0
    with RangeReader(path) as reader:
        for _, tensor in pieces:
            size = tensor.numel() * tensor.element_size()
            a, b = max(lo, at), min(hi, at + size)
            if a < b:
                view = memoryview(mine.numpy()[a - lo : b - lo]).cast("B")
                reader.read(file_offset(tensor) + (a - at), view)
            at += size
    boxes = [torch.empty(chunk, dtype=torch.uint8, device=device()) for _ in range(world)]
    with exchanging("the exchange of the module tensors without a master"):
        Collective(group).gather(boxes, mine.to(device()))
    flat, out, at = torch.cat([box.cpu() for box in boxes]), {}, 0
    for name, tensor in pieces:
        size = tensor.numel() * tensor.element_size()
        dtype = getattr(torch, tensor.dtype.name)
        out[name] = flat[at : at + size].view(dtype).reshape(tuple(tensor.shape)).clone()
        at += size
    return out


def with_the_rest_exchanged(states: dict, optimized: set[str], model_states: Path, group: Any) -> dict:
    """The model-states dict with the module tensors that have no master (buffers, frozen parameters)
    replaced by copies read once across the DP group (:func:`_read_the_rest`): what a universal load
    restores from it then costs each rank 1/DP of those bytes. Collective over ``group``."""
    saved = states.get(F.MODULE) if isinstance(states, dict) else None
    if not isinstance(saved, dict):
        return states
    names = sorted(n for n in flatten_module_states(saved) if n not in optimized)
    rest = _read_the_rest(model_states, names, group) if names else {}
    return {**states, F.MODULE: with_leaves_replaced(saved, rest)} if rest else states


def layer_hook(job: LiveJob, folder: Path) -> Callable[[Path, dict], dict]:
    """For a pipeline model's layer files (read lazily by the per-load state-dict loader): the layer gets
    its optimized weights as they are (identity with the live tensors) and the rest read once across the
    DP group. Collective when the rest is not empty (every rank of the group loads the same files)."""
    optimized = _optimized_ids(job)
    layers = {path.name: layer for path, layer in _layer_files(job, folder)}

    def give(path: Path, states: dict) -> dict:
        layer = layers.get(path.name)
        if layer is None:
            return states
        own = {k: t.detach() for k, t in layer.state_dict(keep_vars=True).items() if id(t) in optimized}
        names = sorted(k for k in states if k not in own)
        rest = _read_the_rest(path, names, job.dp_group, key=None) if names else {}
        return {**states, **{k: v for k, v in own.items() if k in states}, **rest}

    return give


@contextlib.contextmanager
def module_from_masters(job: LiveJob, model_states: Path) -> Iterator[None]:
    """For one load: DeepSpeed's ``load_module_state_dict`` leaves the optimized parameters as they are
    (:func:`rebuild_from_masters` rebuilds them after the optimizer load) and gives the module the rest
    (frozen parameters, persistent buffers) read once across the DP group. Megatron's own
    ``load_state_dict`` still sees every key of the saved module, so strictness is DeepSpeed's."""
    optimized = job.optimized_params

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def load_module_state_dict(self: Any, checkpoint: Any, strict: bool = True, *args: Any, **kwargs: Any) -> Any:
            saved = checkpoint.get(F.MODULE) if isinstance(checkpoint, dict) else None
            if self is not job.engine or not isinstance(saved, dict) or kwargs.get("custom_load_fn"):
                return original(self, checkpoint, strict, *args, **kwargs)
            leaves = flatten_module_states(saved)
            own = {name: optimized[name].detach() for name in leaves if name in optimized}
            names = sorted(n for n in leaves if n not in own)  # the same on every rank: one file per group
            rest = _read_the_rest(model_states, names, job.dp_group) if names else {}
            module = with_leaves_replaced(saved, {**own, **rest})
            return original(self, {**checkpoint, F.MODULE: module}, strict, *args, **kwargs)

        return load_module_state_dict

    with surface.scoped_replace(surface.ENGINE, "load_module_state_dict", make):
        yield


# ------------------------------------------------------------------------------------------------
# after the optimizer load: rebuilt from the masters, exactly the saved weights, or read in full
# ------------------------------------------------------------------------------------------------


def rebuild_from_masters(job: LiveJob, real_lengths: list[int], saved: Callable[[int], torch.Tensor]) -> bool:
    """Collective over the DP group: whether the weights this rank's masters round to are exactly the
    saved ones (``saved(g)``: this rank's real range of them, read) on every rank; if so they are rebuilt
    (one all-gather) and True is returned. The caller reads the module in full when False."""
    pairs = ((master[:real], saved(g)) for g, (master, real) in enumerate(zip(job.masters(), real_lengths)))
    exact = _masters_round_to(job, pairs, "comparing the masters with the saved weights (all-reduce)")
    if exact:
        rebuild(job)
    return exact


def refresh_lp_params(job: LiveJob) -> bool:
    """The bf16 weights made the rounded fp32 masters, as ``update_lp_params`` does after a universal
    load, but its all-gather only when some rank's weights differ: DeepSpeed saved the module after
    copying the masters into it, so the weights it just loaded already are (1.1 s of a 1.6 s reshard
    of 100M parameters on 4 CPU ranks, for nothing). Collective over the DP group. Returns whether
    the weights had to be refreshed."""
    fresh = _masters_round_to(job, job.weight_partitions(), "comparing the weights with the masters (all-reduce)")
    if not fresh:
        rebuild(job)
    return not fresh


def _masters_round_to(job: LiveJob, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], what: str) -> bool:
    """Collective over the DP group: whether, on every rank, each master of ``pairs`` rounds exactly to its weights
    (compared where the masters live)."""
    total = torch.tensor([differing_partitions(pairs)], dtype=torch.int64, device=device())
    with exchanging(what):
        Collective(job.dp_group).sum(total)
    return int(total.item()) == 0


def rebuild(job: LiveJob) -> None:
    """The weights the masters round to, on every rank: DeepSpeed's own ``update_lp_params`` (each rank
    rounds its masters, one all-gather on the DP group), with a failure said once on every rank."""
    with exchanging("rebuilding the module weights from the masters (all-gather)"):
        job.optimizer.update_lp_params()


@contextlib.contextmanager
def exchanging(what: str) -> Iterator[None]:
    """A collective of the load: a rank that died, or a collective that failed, is one clear error on
    every surviving rank, which must not train on the half-loaded engine."""
    faults.die_point("module exchange")
    try:
        yield
    except Exception as exc:
        raise UcpError(
            f"megatron-ucp: {what} failed ({briefly(exc)}): a rank of the data-parallel "
            "group died or its collective failed; the engine is half-loaded: do not train on it, restart the job",
            subject=what,
        ) from exc
