"""Which states the live optimizer will create at its next step (what a load must restore), found untouched."""

from __future__ import annotations

import pytest
import torch

from megatron_ucp.integration.live_job import expected_state_keys


def _flat(n: int = 6) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(n))


def test_a_torch_optimizer_is_probed_for_its_lazily_created_states() -> None:
    flat = _flat()
    nadam = torch.optim.NAdam([flat], lr=1e-3, decoupled_weight_decay=True)
    assert expected_state_keys(nadam, 0) == {"step", "exp_avg", "exp_avg_sq", "mu_product"}
    assert nadam.state == {}  # the live optimizer untouched
    adam = torch.optim.Adam([_flat()], lr=1e-3, amsgrad=True)
    assert expected_state_keys(adam, 0) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def test_ipex_lamb_is_probed_with_its_fused_kernel_off() -> None:
    """``--optimizer ipex.lamb`` / ``ipex.fusedlamb`` (the torch 2.8 + IPEX environment runs this)."""
    lamb = pytest.importorskip("intel_extension_for_pytorch.optim._lamb").Lamb
    fused = lamb([_flat()], lr=1e-3, weight_decay=0.1, fused=True)
    assert expected_state_keys(fused, 0) == {"step", "exp_avg", "exp_avg_sq"}
    assert fused.state == {}


class _Elsewhere(torch.optim.SGD):
    """An optimizer of a package the probe does not build (it could compile kernels or hold global state)."""


_Elsewhere.__module__ = "some_vendor.optim"


def test_an_optimizer_of_another_package_is_not_built_only_its_present_states_count() -> None:
    flat = _flat()
    opt = _Elsewhere([flat], lr=0.1, momentum=0.9)
    assert expected_state_keys(opt, 0) is None
    flat.grad = torch.ones_like(flat)
    opt.step()
    assert expected_state_keys(opt, 0) == {"momentum_buffer"}
