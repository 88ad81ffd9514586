"""bitsandbytes' 8-bit optimizer state quantized again at a new cut (``--ucp-requantize-8bit``): explicit, never the
default, not exact. Its blocks start at each partition's first element, so a new DP size mixes scales; the reshard
reads each old code as its value and this module quantizes the new partitions with bitsandbytes' own
``quantize_blockwise``, the error measured and reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from megatron_ucp.errors import UnsupportedError
from megatron_ucp.integration.collectives import Collective, comm, device

log = logging.getLogger(__name__)

KNOWN_BITSANDBYTES = {"0.50": 256}
"""bitsandbytes releases read (``optim/optimizer.py``'s ``Optimizer2State``, ``backends/cpu/ops.py``): the block size
its optimizers quantize with."""
MAPS = (("state1", "absmax1", "qmap1", "dynamic"), ("state2", "absmax2", "qmap2", "udynamic"))
"""Each state, its scales, its code book and the book's name in the optimizer's ``name2qmap``."""


def blocksize_of_live(base: Any) -> int:
    """The block size the live optimizer quantizes with; raises before anything is loaded when it is not one of
    bitsandbytes' two-state 8-bit optimizers of a release this module has read."""
    cls = type(base)
    if not cls.__module__.startswith("bitsandbytes.") or not all(
        hasattr(base, attr) for attr in ("get_config", "name2qmap", "fill_qmap")
    ):
        raise UnsupportedError(
            f"--ucp-requantize-8bit: the save holds bitsandbytes' 8-bit state but the live optimizer is "
            f"{cls.__module__}.{cls.__name__}, not one of bitsandbytes' 8-bit optimizers; nothing was loaded"
        )
    import bitsandbytes

    series = ".".join(bitsandbytes.__version__.split(".")[:2])
    if series not in KNOWN_BITSANDBYTES:
        raise UnsupportedError(
            f"--ucp-requantize-8bit was written for bitsandbytes {', '.join(KNOWN_BITSANDBYTES)}.x, this is "
            f"{bitsandbytes.__version__}: its block size and state layout are unchecked; nothing was loaded"
        )
    return KNOWN_BITSANDBYTES[series]


@dataclass(frozen=True)
class Requantized:
    """What :func:`requantize_partition` did to one partition."""

    elements: int
    """Elements quantized to 8 bits (0: the partition keeps fp32 values, as bitsandbytes would for its size)."""
    max_error: float
    """Largest |value after - value before| over both states, relative to its block's scale."""
    kept: int = 0
    """Elements of a partition under ``min_8bit_size``, whose states stay fp32 values."""


def requantize_partition(base: Any, flat: torch.Tensor, blocksize: int) -> Requantized:
    """Partition ``flat``'s ``state1``/``state2`` (fp32 values, as the reshard installed them) in the form the live
    optimizer keeps for a partition of its size: 8-bit blocks with their scales and code books, or fp32 unchanged."""
    import bitsandbytes.functional as bnbf

    state = base.state[flat]
    gindex, pindex = next(
        (g, i) for g, group in enumerate(base.param_groups) for i, p in enumerate(group["params"]) if p is flat
    )
    config = base.get_config(gindex, pindex, base.param_groups[gindex])
    if config["optim_bits"] != 8 or flat.numel() < config["min_8bit_size"]:
        return Requantized(0, 0.0, flat.numel())
    if "dynamic" not in base.name2qmap:
        base.fill_qmap()
    worst = 0.0
    for name, scale, book, map_name in MAPS:
        values = state[name]
        qmap = base.name2qmap[map_name].to(values.device)
        codes, quant = bnbf.quantize_blockwise(values, code=qmap, blocksize=blocksize)
        back = bnbf.dequantize_blockwise(codes, quant)
        scales = quant.absmax.repeat_interleave(blocksize)[: values.numel()].clamp_min(torch.finfo(torch.float32).tiny)
        worst = max(worst, float(((back - values).abs() / scales).max()))
        state[name], state[scale], state[book] = codes, quant.absmax, qmap
    return Requantized(flat.numel(), worst)


def requantize_partitions(base: Any, masters: Sequence[torch.Tensor], group: Any) -> str:
    """Every live partition's 8-bit states quantized again (collective over ``group``: the count and the worst error
    are the job's); returns the summary's words for it."""
    blocksize = blocksize_of_live(base)
    done = [requantize_partition(base, master, blocksize) for master in masters]
    totals = torch.tensor(
        [float(sum(d.elements for d in done)), float(sum(d.kept for d in done))], dtype=torch.float64, device=device()
    )
    worst = torch.tensor([max((d.max_error for d in done), default=0.0)], dtype=torch.float64, device=device())
    calls = Collective(group)
    calls.sum(totals)
    calls.sum(worst, op=comm().ReduceOp.MAX)
    quantized, kept = (int(x) for x in totals.tolist())
    return (
        f"bitsandbytes' 8-bit states read as values and quantized again (--ucp-requantize-8bit, not exact): partitions "
        f"of {quantized} elements in 8-bit blocks of {blocksize}, largest change {worst.item():.3g} of a block's "
        f"scale; partitions of {kept} elements kept in fp32 (each under bitsandbytes' min_8bit_size, as bitsandbytes "
        "keeps them); the codes read checked against the save's checksums"
    )
