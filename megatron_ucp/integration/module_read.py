"""The module of a restart, each byte read once across the job (``module_read = distributed``).

A DeepSpeed restart reads the whole model-states file on every rank: 13.5 GB of bf16 weights at
AuroraGPT-7B, 768 times at DP 768. Yet after a ZeRO-1/2 save every optimized weight is its fp32
master rounded to nearest (DeepSpeed copies the masters into the weights at the end of every step),
and each rank loads 1/DP of the masters. So, for one load (:func:`module_from_masters`):

1. DeepSpeed's model-states loader reads the pickle only, its tensors mapped, not read
   (:func:`megatron_ucp.integration.model_states_load.one_model_states_file_per_rank`, ``lazy``);
2. its module load (``load_module_state_dict``) leaves the optimized parameters as they are; what
   has no master (frozen parameters, persistent buffers) is read as one 1/DP byte slice per rank and
   exchanged in one all-gather (:func:`_read_the_rest`);
3. after the optimizer load, each rank reads its own partition's range of the saved weights
   (:class:`SavedWeights`, 1/DP of them: each weight byte is read once across the job) and
   :func:`rebuild_from_masters` decides, on every rank alike, whether the weights the masters round to
   are exactly those. Exact: the weights are rebuilt with one all-gather on the DP group
   (``update_lp_params``, what DeepSpeed does after every step). Not exact (a save whose weights are
   not its masters rounded to nearest: taken between a step's update and its all-gather, rounded
   otherwise by a fused optimizer, or the file edited since): the module is read in full, as DeepSpeed
   reads it, with one warning naming the file. A checksum the save hook records could not stand in
   for the read: it is taken on each rank's memory, not on the file the model states hold.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_ucp import faults
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.reader import flatten_module_states, load_raw
from megatron_ucp.errors import CheckpointFormatError, UcpError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.exact_read import RangeReader, file_offset
from megatron_ucp.format.rawtensor import RawTensor
from megatron_ucp.integration.collectives import comm, device
from megatron_ucp.integration.rank_files import read_tensor_range

log = logging.getLogger(__name__)


class SavedWeights:
    """The optimized weights a model-states file holds, by their place in each param group's flat
    order (``param_shapes``): a range is read exactly (:class:`RangeReader`), never the whole module."""

    def __init__(self, path: Path, shapes: list[list[tuple[str, tuple[int, ...]]]], raw: Optional[dict] = None) -> None:
        self.path = Path(path)
        raw = raw if raw is not None else load_raw(self.path, random_access=True)
        module = raw.get(F.MODULE) if isinstance(raw, dict) else None
        self.tensors = {n: t for n, t in flatten_module_states(module).items() if isinstance(t, RawTensor)}
        self.places = []
        for group in shapes:
            offset, places = 0, []
            for name, shape in group:
                n = int(torch.Size(shape).numel())
                places.append((offset, n, name))
                offset += n
            self.places.append(places)
        self.reader = RangeReader(self.path)

    def read(self, group: int, start: int, dest: torch.Tensor) -> None:
        """Elements ``[start, start + dest.numel())`` of the group's flat order into ``dest``."""
        stop = start + dest.numel()
        for offset, n, name in self.places[group]:
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo >= hi:
                continue
            saved = self.tensors.get(name)
            if saved is None or saved.numel() != n or not saved.is_contiguous():
                raise CheckpointFormatError(
                    f"{self.path}: holds no contiguous {n}-element weight {name!r} (the module lacks it, or it is "
                    "of another shape)",
                    subject=self.path,
                )
            read_tensor_range(self.reader, saved.reshape(-1), lo - offset, dest.narrow(0, lo - start, hi - lo))

    def close(self) -> None:
        self.reader.close()


# ------------------------------------------------------------------------------------------------
# DeepSpeed's module load, for one load: the optimized parameters left alone, the rest read 1/DP
# ------------------------------------------------------------------------------------------------


def _leaves(nested: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in nested.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _replaced(nested: dict, values: dict[str, Any], prefix: str = "") -> dict:
    """A copy of the nested module dict (same dict types) with the leaves named in ``values`` replaced."""
    out = type(nested)()
    for key, value in nested.items():
        name = f"{prefix}{key}"
        out[key] = _replaced(value, values, name + ".") if isinstance(value, dict) else values.get(name, value)
    return out


def _read_the_rest(path: Path, names: list[str], group: Any) -> dict[str, torch.Tensor]:
    """The module tensors without a master, each byte read by one rank of ``group``: their bytes laid end
    to end, one slice per rank (read exactly), one all-gather. Every rank of the group holds the same
    file (one model-parallel coordinate), so every rank computes the same layout."""
    dist = comm()
    raw = flatten_module_states(load_raw(path, random_access=True).get(F.MODULE))
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
        dist.all_gather(boxes, mine.to(device()), group=group)
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
    names = sorted(n for n, _ in _leaves(saved) if n not in optimized)
    rest = _read_the_rest(model_states, names, group) if names else {}
    return {**states, F.MODULE: _replaced(saved, rest)} if rest else states


@contextlib.contextmanager
def module_from_masters(engine: Any, model_states: Path) -> Iterator[None]:
    """For one load: DeepSpeed's ``load_module_state_dict`` leaves the optimized parameters as they are
    (:func:`rebuild_from_masters` rebuilds them after the optimizer load) and gives the module the rest
    (frozen parameters, persistent buffers) read once across the DP group. Megatron's own
    ``load_state_dict`` still sees every key of the saved module, so strictness is DeepSpeed's."""
    optimizer = engine.optimizer
    names = surface.param_names(optimizer)
    layout = surface.layout_of(optimizer)
    optimized = {names[lp]: lp for group in layout.groups(optimizer) for lp in group}
    group = surface.dp_group(optimizer)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def load_module_state_dict(self: Any, checkpoint: Any, strict: bool = True, *args: Any, **kwargs: Any) -> Any:
            saved = checkpoint.get(F.MODULE) if isinstance(checkpoint, dict) else None
            if self is not engine or not isinstance(saved, dict) or kwargs.get("custom_load_fn"):
                return original(self, checkpoint, strict, *args, **kwargs)
            leaves = dict(_leaves(saved))
            own = {name: optimized[name].detach() for name in leaves if name in optimized}
            names = sorted(n for n in leaves if n not in own)  # the same on every rank: one file per group
            rest = _read_the_rest(model_states, names, group) if names else {}
            module = _replaced(saved, {**own, **rest})
            return original(self, {**checkpoint, F.MODULE: module}, strict, *args, **kwargs)

        return load_module_state_dict

    with surface.scoped_replace(surface.ENGINE, "load_module_state_dict", make):
        yield


# ------------------------------------------------------------------------------------------------
# after the optimizer load: rebuilt from the masters, exactly the saved weights, or read in full
# ------------------------------------------------------------------------------------------------


def rebuild_from_masters(optimizer: Any, real_lengths: list[int], saved: Callable[[int], torch.Tensor]) -> bool:
    """Collective over the DP group: whether the weights this rank's masters round to are exactly the
    saved ones (``saved(g)``: this rank's real range of them, read) on every rank; if so they are rebuilt
    (one all-gather) and True is returned. The caller reads the module in full when False."""
    layout = surface.layout_of(optimizer)
    masters = layout.masters(optimizer)
    differ = 0
    with torch.no_grad():
        for g, (master, real) in enumerate(zip(masters, real_lengths)):
            weights = saved(g)
            differ += int(not torch.equal(master[:real].to(weights.dtype), weights))
    total = torch.tensor([differ], dtype=torch.int64, device=device())
    with exchanging("comparing the masters with the saved weights (all-reduce)"):
        comm().all_reduce(total, group=surface.dp_group(optimizer))
    exact = int(total.item()) == 0
    if exact:
        rebuild(optimizer)
    return exact


def rebuild(optimizer: Any) -> None:
    """The weights the masters round to, on every rank: DeepSpeed's own ``update_lp_params`` (each rank
    rounds its masters, one all-gather on the DP group), with a failure said once on every rank."""
    with exchanging("rebuilding the module weights from the masters (all-gather)"):
        optimizer.update_lp_params()


@contextlib.contextmanager
def exchanging(what: str) -> Iterator[None]:
    """A collective of the load: a rank that died, or a collective that failed, is one clear error on
    every surviving rank, which must not train on the half-loaded engine."""
    faults.die_point("module exchange")
    try:
        yield
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UcpError(
            f"megatron-ucp: {what} failed ({type(exc).__name__}: {first[:200]}): a rank of the data-parallel "
            "group died or its collective failed; the engine is half-loaded: do not train on it, restart the job",
            subject=what,
        ) from exc
