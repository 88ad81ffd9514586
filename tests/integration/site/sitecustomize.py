"""Test-environment edit for the real Megatron-DeepSpeed runs (on PYTHONPATH of the ranks only).

DeepSpeed's CPU backend JIT-compiles its optional shared-memory all-reduce kernel
(``deepspeed_shm_comm``) with g++ in every new interpreter environment (30 s here) and leaves
``/dev/shm/deepspeed_allreduce_buffer_*`` files behind, even after clean exits. The tests are
about checkpoint contents, not CPU collective speed: this marks the op incompatible, so
DeepSpeed takes its plain gloo path. Nothing in Megatron-DeepSpeed or DeepSpeed is edited.
"""

import importlib.abc
import importlib.util
import sys


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


# Per-rank storage reads, exactly (tests/integration/test_megatron_deepspeed.py, the module-read test).
# With UCP_TEST_PRIVATE_LOAD=1 every rank loads its own copy of the checkpoint (``--load X`` becomes
# ``X.rank<RANK>``; the test made and evicted the copies), so what is in the page cache of a copy
# afterwards is what that rank read (tests/support/page_cache.py), not its neighbours'.
import os  # noqa: E402

if os.environ.get("UCP_TEST_PRIVATE_LOAD") == "1" and "RANK" in os.environ and "--load" in sys.argv:  # ranks only
    at = sys.argv.index("--load") + 1
    sys.argv[at] = f"{sys.argv[at]}.rank{os.environ.get('RANK', '0')}"
