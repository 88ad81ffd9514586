"""bitsandbytes' 8-bit optimizer state in a rank file, read as one number per element (``--ucp-requantize-8bit``).

Under ZeRO each flat partition is one parameter to bitsandbytes: its state is ``step`` and one dict
(``__bnb_optimizer_quant_state__``) holding ``state1``/``state2``, either fp32 values (a partition under
``min_8bit_size``) or uint8 codes with ``absmax1``/``absmax2`` (one scale per block of B consecutive elements from the
partition's first) and ``qmap1``/``qmap2`` (the code books). :func:`expand` turns the dict into the two states, the
quantized ones as :class:`~megatron_ucp.format.blockwise8bit.Blockwise8bit` (decoded exactly on read). Quantizing
again at a new cut is not exact and is the option's to say (:mod:`megatron_ucp.integration.resume.native.requantize`).
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.blockwise8bit import QMAP_SIZE, Blockwise8bit
from megatron_ucp.format.rawtensor import RawTensor

BNB_QUANT_STATE = "__bnb_optimizer_quant_state__"
"""The key bitsandbytes' ``state_dict`` packs a parameter's quantization state under."""
STATES = (("state1", "absmax1", "qmap1"), ("state2", "absmax2", "qmap2"))
"""Each state bitsandbytes keeps per element, with its scales and code book when quantized."""
REQUANTIZE_HINT = (
    "bitsandbytes' 8-bit state moves to another DP size only by dequantizing and quantizing it again, which is not "
    "exact: --ucp-requantize-8bit (MEGATRON_UCP_REQUANTIZE_8BIT=1) does that, on the native route at ZeRO-1/2"
)
"""What a refusal of bitsandbytes' state says the user can do."""
BLOCKSIZES = (256, 2048)
"""The block sizes bitsandbytes' optimizers quantize with: 256 (the 0.50 series) and 2048 (earlier releases)."""


def blocksize_of(elements: int, blocks: int, where: str) -> int:
    """The block size that cuts ``elements`` into ``blocks`` blocks (one of :data:`BLOCKSIZES`); raises naming
    ``where`` when none or more than one does."""
    fits = [b for b in BLOCKSIZES if -(-elements // b) == blocks]
    if len(fits) != 1:
        raise UnsupportedError(
            f"{where}: {elements} codes with {blocks} block scales fit {'no' if not fits else 'more than one'} "
            f"block size bitsandbytes uses ({', '.join(map(str, BLOCKSIZES))})",
            subject=where,
        )
    return fits[0]


def expand(state: dict, where: str) -> dict:
    """One partition's optimizer state with bitsandbytes' packed dict replaced by ``state1`` and ``state2``, one number
    per element each (a plain fp32 tensor, or :class:`Blockwise8bit`); a state without the dict is returned as it is.
    Raises naming ``where`` on a dict this reading does not know."""
    packed = state.get(BNB_QUANT_STATE)
    if not isinstance(packed, dict):
        return state
    known = {key for triple in STATES for key in triple}
    unknown = sorted(str(k) for k in packed if k not in known)
    if unknown:
        raise UnsupportedError(f"{where}: bitsandbytes' state holds {unknown}, which this reading does not know")
    out = {k: v for k, v in state.items() if k != BNB_QUANT_STATE}
    for name, scale, book in STATES:
        values = packed.get(name)
        if not isinstance(values, RawTensor) or values.dim() != 1:
            raise UnsupportedError(f"{where}: bitsandbytes' {name!r} is {type(values).__name__}, not a flat tensor")
        if values.dtype.name == "float32" and scale not in packed:
            out[name] = values
            continue
        absmax, qmap = packed.get(scale), packed.get(book)
        if values.dtype.name != "uint8" or not isinstance(absmax, RawTensor) or not isinstance(qmap, RawTensor):
            raise UnsupportedError(
                f"{where}: bitsandbytes' {name!r} is {values.dtype.name} with scales {type(absmax).__name__} and code "
                f"book {type(qmap).__name__}: neither fp32 values nor uint8 codes with their scales and code book"
            )
        if absmax.dtype.name != "float32" or qmap.dtype.name != "float32" or qmap.numel() != QMAP_SIZE:
            raise UnsupportedError(
                f"{where}: bitsandbytes' {scale!r}/{book!r} are {absmax.dtype.name}/{qmap.dtype.name} of "
                f"{qmap.numel()} codes, not fp32 scales and a {QMAP_SIZE}-entry fp32 code book"
            )
        blocksize = blocksize_of(values.numel(), absmax.numel(), f"{where}: {name!r}")
        out[name] = Blockwise8bit(values, absmax, qmap, blocksize)
    return out


def expanded(optim: dict, path: Any) -> dict:
    """A rank file's optimizer dict (tensors located) with every partition's bitsandbytes dict expanded by
    :func:`expand`: the per-element states a DP change copies."""
    base = optim[F.BASE_OPTIMIZER_STATE]
    states = base.get("state", {})
    out = {g: expand(s, f"{path}: param group {g}") if isinstance(s, dict) else s for g, s in states.items()}
    return {**optim, F.BASE_OPTIMIZER_STATE: {**base, "state": out}}


def dequantized_view(view: Callable[[Any], dict]) -> Callable[[Any], dict]:
    """``view`` (how a rank file is read) followed by :func:`expanded`."""
    return lambda path: expanded(view(path), path)


def packed_states(per_group: Any) -> tuple[str, ...]:
    """The states a bitsandbytes dict packs in any of these groups' states (none: no such dict)."""
    return tuple(name for name, _, _ in STATES) if any(BNB_QUANT_STATE in s for s in per_group) else ()
