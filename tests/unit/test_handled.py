"""A job the hooks cannot handle gets one warning and stock DeepSpeed's behaviour, never an exception
inside its save or load (integration/handled.py and the save hook's fallbacks)."""

from __future__ import annotations

import logging

import pytest

from megatron_ucp.deepspeed import surface
from megatron_ucp.deepspeed.surface import OPTIMIZER_LAYOUTS
from megatron_ucp.integration import handled
from megatron_ucp.integration.save import recording as save_recording


class BF16_Optimizer:  # the class name selects the layout
    """Has every attribute the BF16_Optimizer layout and OPTIMIZER_SHARED name (values unused here)."""

    bf16_groups = bf16_groups_flat = bf16_partitioned_groups = fp32_groups_flat_partition = [[]]
    dp_process_group = real_dp_process_group = nccl_start_alignment_factor = param_names = optimizer = None


class _Engine:
    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def zero_optimization_stage(self) -> int:
        return 1


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handled, "_warned", set())
    monkeypatch.setattr(surface, "_CHECKED", set())


def test_groups_of_other_dp_sizes_are_handled_when_they_are_experts_at_tp_pp_1(monkeypatch) -> None:
    monkeypatch.setattr(surface, "group_dp_sizes", lambda optimizer: [4, 4, 2])
    engine = _Engine(BF16_Optimizer())
    reason = handled.unhandled_reason(engine)  # no MoE layers: groups partitioned otherwise, not understood
    assert reason is not None and "[4, 4, 2]" in reason and "not experts" in reason
    engine.has_moe_layers = True
    assert handled.unhandled_reason(engine) is None  # expert groups over expert-DP: saved, converted, resharded
    engine._config = type("Config", (), {"use_data_before_expert_parallel_": True})()
    reason = handled.unhandled_reason(engine)  # D + E: the experts of a DP rank are not where E + D puts them
    assert reason is not None and "use_data_before_expert_parallelism" in reason
    del engine._config
    monkeypatch.setattr(handled, "expert_model_parallel", lambda engine: 2)
    reason = handled.unhandled_reason(engine)
    assert reason is not None and "mixture-of-experts" in reason and "TP x PP = 2" in reason
    monkeypatch.setattr(surface, "group_dp_sizes", lambda optimizer: [4, 4])
    assert handled.unhandled_reason(_Engine(BF16_Optimizer())) is None


def test_an_optimizer_missing_an_attribute_is_a_reason_not_an_exception() -> None:
    attributes = {k: v for k, v in vars(BF16_Optimizer).items() if not k.startswith("__")}
    del attributes["bf16_partitioned_groups"]  # a release that moved it
    reason = handled.unhandled_reason(_Engine(type("BF16_Optimizer", (), attributes)()))
    assert reason is not None and "bf16_partitioned_groups" in reason
    assert handled.unhandled_reason(_Engine(object())) is not None  # no layout at all: stock


def test_warned_once_per_process_on_the_first_rank(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="megatron_ucp")
    for _ in range(3):
        handled.warn_once("a reason", handled.STOCK)
    assert [r.getMessage() for r in caplog.records] == [f"megatron-ucp: a reason: {handled.STOCK}"]


def test_the_save_hook_returns_the_stock_dict_when_it_cannot_record(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="megatron_ucp")
    layout = next(layout for layout in OPTIMIZER_LAYOUTS if layout.class_name == "BF16_Optimizer")
    wrapped = save_recording._wrap(save_recording._record(layout))(lambda self: {"stock": True})
    assert wrapped(object()) == {"stock": True}  # lacks every attribute the record reads
    assert len(caplog.records) == 1 and "DeepSpeed internals changed" in caplog.text
    assert handled.STOCK in caplog.text
