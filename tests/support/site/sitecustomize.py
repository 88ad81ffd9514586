"""Test-environment edits for the processes the tests launch (on their ``PYTHONPATH`` only).

One folder, because Python imports the first ``sitecustomize`` on ``sys.path`` and no other: two folders each
with its own would silently drop one of them (the real Megatron-DeepSpeed's ranks on torch 2.8 ran without IPEX
that way). Who puts it there: the real Megatron-DeepSpeed's ranks (``tests/integration/mds.py``), the stand-in's
ranks (``tests/system/test_runner.py``) and, in `make test`'s torch 2.8 + IPEX runs, every process.

1. IPEX first, as a job on Aurora has it loaded before megatron-ucp's code runs (Megatron-DeepSpeed's
   ``megatron/model/__init__.py`` imports it on XPU): with ``MEGATRON_UCP_TEST_IMPORT_IPEX=1`` (the torch 2.8
   runs). Without the variable nothing is imported, so a test can check that megatron-ucp never imports IPEX.
2. No shared-memory all-reduce kernel: DeepSpeed's CPU backend JIT-compiles its optional ``deepspeed_shm_comm``
   with g++ in every new interpreter environment (30 s idle, minutes on a loaded machine; its cache is shared by
   every torch and DeepSpeed, so each switch rebuilds it) and leaves ``/dev/shm/deepspeed_allreduce_buffer_*``
   behind. The tests are about checkpoint contents, not CPU collective speed: the op is marked incompatible and
   DeepSpeed takes its plain gloo path. Nothing in Megatron-DeepSpeed or DeepSpeed is edited.
3. Per-rank storage reads, exactly (the module-read tests under the real Megatron-DeepSpeed): with
   ``UCP_TEST_PRIVATE_LOAD=1`` every rank loads its own copy of the checkpoint (``--load X`` becomes
   ``X.rank<RANK>``; the test made and evicted the copies), so what is in the page cache of a copy afterwards is
   what that rank read (tests/support/page_cache.py), not its neighbours'.
"""

import importlib.abc
import importlib.util
import os
import sys

if os.environ.get("MEGATRON_UCP_TEST_IMPORT_IPEX") == "1":
    import intel_extension_for_pytorch  # noqa: F401


class _DisableShmComm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed.ops":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.__compatible_ops__["deepspeed_shm_comm"] = False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _DisableShmComm())


def edit_rank_process() -> None:
    """What is per process (3. above): run at a fresh interpreter's start, and by a rank forked from a preload server
    (tests/support/preload/rank.py) once its environment and arguments are its own."""
    if os.environ.get("UCP_TEST_PRIVATE_LOAD") == "1" and "RANK" in os.environ and "--load" in sys.argv:  # ranks only
        at = sys.argv.index("--load") + 1
        sys.argv[at] = f"{sys.argv[at]}.rank{os.environ.get('RANK', '0')}"


edit_rank_process()
