"""Which states the live optimizer will create at its next step: what a load must have restored.

An optimizer creates its state lazily, at its first step; a load that restores fewer states than the optimizer keeps
leaves the rest to be created fresh (zeros), silently (the failure PyTorch DCP #126881 describes). The loads compare
what they restored with :func:`expected_state_keys` and name what is missing.
"""

from __future__ import annotations

import inspect
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

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
