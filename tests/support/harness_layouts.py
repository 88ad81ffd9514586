"""The ZeRO layouts the fork trains, as harness settings (``TrainSpec`` fields), shared by the tests that hold an
option to every layout (the asynchronous save, memory saves)."""

from __future__ import annotations

HARNESS_LAYOUTS = {
    "zero1-bf16": {"optimizer": "bf16"},
    "zero1-zero": {"optimizer": "zero", "zero_stage": 1},
    "zero2": {"optimizer": "zero", "zero_stage": 2},
    "zero3": {"optimizer": "zero", "zero_stage": 3},
    "offload": {
        "optimizer": "zero",
        "zero_stage": 2,
        "extra_config": {
            "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
            "zero_force_ds_cpu_optimizer": False,
        },
    },
    "nadam": {"optimizer": "bf16", "base_optimizer": "nadam"},
}
