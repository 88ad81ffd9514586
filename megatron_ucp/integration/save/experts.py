"""The fork's mixture-of-experts save on DeepSpeed 0.19: written as the releases before 0.19 write it.

Two things in 0.19 break every MoE save of the ALCF fork's ``GPTModel``, with or without megatron-ucp:

- ``DeepSpeedEngine._save_moe_checkpoint`` copies the module's ``universal_checkpoint_info`` with
  ``dict()`` and refuses that key in the client state. The fork defines ``universal_checkpoint_info``
  as a method and Megatron's ``save_checkpoint`` passes the info (vocabulary sizes, the model's name
  patterns) as client state: the first save dies (``TypeError: 'method' object is not iterable``, then
  the reserved-key ``KeyError``). For the call, the client state's info moves onto the module as an
  instance attribute, which 0.19 copies where Megatron meant it to go (the model states'
  ``universal_checkpoint_info``, same key and content as every other save of the fork); the method is
  back when the call ends.
- ``_get_non_moe_state_dict`` keeps only keys under a ``MoE`` module's own prefix out of the model
  states. The fork lifts its expert weights to the top of the dict under names that lack a dot
  (``encoderlayers.1.mlp.deepspeed_moe...``), so 0.19 keeps them there, and the next load dies in
  Megatron's ``load_state_dict`` (``IndexError`` looking for the ``encoder`` segment). For these saves
  the top-level expert keys are dropped as before 0.19 (every key naming an expert but the gate): the
  expert weights are in their ``layer_<l>_expert_<e>`` files, which is where every release loads them from.

Both apply to the fork's model only (its ``universal_checkpoint_info`` is a method); nothing else of the
save changes, and releases that save the fork's MoE model (``versions.Internals.saves_fork_moe``) are not
touched.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from megatron_ucp.config import UcpConfig
from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.versions import internals
from megatron_ucp.format.dsformat import UNIVERSAL_CHECKPOINT_INFO

_FORK_MOE_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_ucp_fork_moe_save", default=False)
"""A save of the fork's MoE model in progress: its non-MoE dict loses the lifted expert keys."""


def wanted(config: UcpConfig) -> bool:
    return not internals().saves_fork_moe


def is_fork_model(module: Any) -> bool:
    """The ALCF fork's GPTModel: ``universal_checkpoint_info`` is a method there (an attribute elsewhere)."""
    return callable(getattr(module, UNIVERSAL_CHECKPOINT_INFO, None))


def lifted_expert_keys(state: dict) -> list[str]:
    """Top-level keys naming an expert weight (not the gate), as the releases before 0.19 dropped them."""
    return [key for key in state if "expert" in key and "moe.gate.wg.weight" not in key]


def _hand_over_the_info(original: Any) -> Any:
    @functools.wraps(original)
    def _save_moe_checkpoint(self: Any, save_dir: Any, tag: Any, client_state: Any = None, *args: Any, **kw: Any):
        module = self.module
        if not is_fork_model(module):
            return original(self, save_dir, tag, client_state if client_state is not None else {}, *args, **kw)
        state = dict(client_state or {})
        info = state.pop(UNIVERSAL_CHECKPOINT_INFO, None)
        token = _FORK_MOE_SAVE.set(True)
        if info is not None:
            object.__setattr__(module, UNIVERSAL_CHECKPOINT_INFO, info)
        try:
            return original(self, save_dir, tag, state, *args, **kw)
        finally:
            if info is not None:
                object.__delattr__(module, UNIVERSAL_CHECKPOINT_INFO)
            _FORK_MOE_SAVE.reset(token)

    return _save_moe_checkpoint


def _drop_lifted_expert_keys(original: Any) -> Any:
    @functools.wraps(original)
    def _get_non_moe_state_dict(self: Any, full_state_dict: Any, *args: Any, **kw: Any) -> Any:
        kept = original(self, full_state_dict, *args, **kw)
        if _FORK_MOE_SAVE.get() and isinstance(kept, dict):
            for key in lifted_expert_keys(kept):
                kept.pop(key)
        return kept

    return _get_non_moe_state_dict


def install(patches: Any, config: UcpConfig) -> None:
    """DeepSpeed's MoE save of the fork's model gets Megatron's info from the module for the call, and its
    model states leave the lifted expert keys out (0.19 and later)."""
    # around the save hook's own wrapper (installed before this one): the info leaves the client state first
    surface.replace(patches, surface.ENGINE, "_save_moe_checkpoint", _hand_over_the_info, stack=True)
    surface.replace(patches, surface.ENGINE, "_get_non_moe_state_dict", _drop_lifted_expert_keys)
