"""Loads intel-extension-for-pytorch at interpreter start, as a job on Aurora has it loaded before
megatron-ucp's code runs (Megatron-DeepSpeed's ``megatron/model/__init__.py`` imports it on XPU).

`make test` puts this folder on ``PYTHONPATH`` for the torch 2.8 + IPEX 2.8 runs and sets
``MEGATRON_UCP_TEST_IMPORT_IPEX=1``; every process of those runs (pytest, the harness ranks, the real
Megatron-DeepSpeed's ranks, the background converters) then imports IPEX first. Without the variable
it does nothing, so a test can check that megatron-ucp itself never imports IPEX.
"""

import os

if os.environ.get("MEGATRON_UCP_TEST_IMPORT_IPEX") == "1":
    import intel_extension_for_pytorch  # noqa: F401
