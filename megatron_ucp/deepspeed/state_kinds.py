"""Which optimizer states a change of DP size can carry, told from a rank file's raw values.

A ZeRO rank file keeps, per group, the base optimizer's state of its one flat partition. A state of one number
per element (Adam's ``exp_avg``) is cut and copied like the masters; a state of one value per partition
(``step``, NAdam's ``mu_product``, a flag) is the same in every rank file and is carried as it is; anything else
(8-bit Adam's blockwise ``absmax``, a dict of quantization settings) has no correct copy to another cut and is
refused by name. The reader, the binding and the converter ask this module, and nothing else decides it.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_ucp.deepspeed.quantized_states import BNB_QUANT_STATE, REQUANTIZE_HINT
from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.blockwise8bit import Blockwise8bit
from megatron_ucp.format.rawtensor import RawTensor

STEP, ELEMENT, SCALAR, OTHER = "step", "element", "scalar", "other"


def kind_of(name: Any, value: Any) -> str:
    """What a state is: the ``step``; one number per ``element`` of its partition (a flat tensor; its length is
    the binding's to check); one value per partition (``scalar``: a 0-dim tensor, a number, a flag); or ``other``."""
    if name == F.STEP_STATE:
        return STEP
    if isinstance(value, (RawTensor, Blockwise8bit)):  # the latter: 8-bit state read as values (--ucp-requantize-8bit)
        return ELEMENT if value.dim() > 0 else SCALAR
    return SCALAR if isinstance(value, (bool, int, float)) else OTHER


def tensor_states(per_group: Sequence[dict]) -> list[tuple[str, ...]]:
    """Each group's states of one number per element in a rank file (its step and other scalars left out)."""
    return [tuple(k for k, v in sorted(s.items()) if kind_of(k, v) == ELEMENT) for s in per_group]


def partition_scalars(state: dict) -> list[tuple[str, Any]]:
    """One group's states (its step left out) that are one value per partition, sorted by name."""
    return [(str(k), v) for k, v in sorted(state.items()) if kind_of(k, v) == SCALAR]


def unplaceable_states(per_group: Sequence[dict], masters: Sequence[Any], unit: str) -> tuple[str, ...]:
    """Every optimizer state that is neither one number per element of its partition nor one value per
    partition (8-bit Adam's blockwise quantization state, a dict): no copy places it at another DP size."""
    problems = []
    for g, state in enumerate(per_group):
        size = masters[g].numel() if g < len(masters) and isinstance(masters[g], RawTensor) else None
        for name, value in sorted(state.items()):
            kind = kind_of(name, value)
            if kind == OTHER:
                problems.append(f"{name!r} of {unit} {g} is a {type(value).__name__}")
            elif kind == ELEMENT and size is not None and value.numel() != size:
                problems.append(
                    f"{name!r} of {unit} {g} is {value.numel()} elements beside a partition of {size} "
                    "(blockwise or per-block state)"
                )
    return tuple(problems)


def portable(value: Any) -> tuple:
    """A state of one value per partition as plain data, exact and comparable: ``("tensor", dtype, number)``
    for a 0-dim tensor (its number is exact in a Python float or int), ``("value", v)`` for a number or a flag."""
    if isinstance(value, RawTensor):
        return ("tensor", value.dtype.name, value.item())
    return ("value", value)


def sharded_states(state: dict, path: Any, g: int, unit: str) -> list[str]:
    """``fp32`` and group ``g``'s states of one number per element, the files a universal folder holds per
    parameter; raises :class:`UnsupportedError` naming a state that is neither that nor one value per partition."""
    names = [F.FP32_STATE]
    for key, value in state.items():
        kind = kind_of(key, value)
        if kind == OTHER:
            raise UnsupportedError(
                f"{path}: optimizer state {key!r} of {unit} {g} is not a per-element tensor "
                f"({type(value).__name__}); the universal format has no place for it"
                f"{f' ({REQUANTIZE_HINT})' if key == BNB_QUANT_STATE else ''}",
                subject=path,
            )
        if kind == ELEMENT:
            names.append(str(key))
    return names


def unplaceable_error(path: str, problems: Sequence[str], optimizer_name: str) -> UnsupportedError:
    """The refusal of a save whose optimizer keeps :func:`unplaceable_states`, naming the class, file and states."""
    option = f". {REQUANTIZE_HINT}" if any(BNB_QUANT_STATE in problem for problem in problems) else ""
    return UnsupportedError(
        f"{path}: {optimizer_name} keeps optimizer state that megatron-ucp cannot place at another DP size: "
        f"{'; '.join(problems)}. Only states of one number per element of a partition, or of one value per "
        f"partition, are carried{option}; nothing was loaded",
        subject=path,
    )
