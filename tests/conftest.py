"""Session fixtures shared by every test file: real DeepSpeed checkpoints, built once per session.

* ``ds_checkpoint(optimizer="bf16"|"zero", dp=4, **spec_fields) -> DsCheckpoint``: trains the tiny
  model with real DeepSpeed processes (CPU, gloo), ``steps=4, save_at=(2, 4)`` and full-state dumps
  by default; identical requests return the same cached run. Read-only: ``ck.copy_to(tmp_path)``
  before writing next to it.
* ``legacy_fixture(name) -> LegacyFixture``: the committed DeepSpeed 0.16.2 checkpoints
  (``"bf16_optimizer"``, ``"zero_optimizer"``) with their reference dumps. Read-only as well.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# No test reaches a hub: Hugging Face's libraries read this once, at their import, so it is set before any test
# module can import them (the export tests check that it took effect).
os.environ["HF_HUB_OFFLINE"] = "1"

from tests.support.dsharness.checkpoints import CheckpointCache, LegacyFixture, session_cache  # noqa: E402
from tests.support.dsharness.checkpoints import legacy_fixture as _legacy_fixture  # noqa: E402


@pytest.fixture(scope="session")
def ds_checkpoint() -> CheckpointCache:
    return session_cache()


@pytest.fixture(scope="session")
def legacy_fixture():
    def get(name: str) -> LegacyFixture:
        return _legacy_fixture(name)

    return get


# Shared-memory files that DeepSpeed's CPU all-reduce kernel (deepspeed_allreduce_buffer_*) and
# MPICH (mpich_shm_*, from mpi4py's singleton init in Megatron-DeepSpeed's ranks and from mpiexec)
# leave in /dev/shm even after clean exits; piled up, they exhausted memory on a shared machine.
_SHM = Path("/dev/shm")
_SHM_PREFIXES = ("deepspeed_allreduce_buffer", "mpich_shm_")


def _shm_files() -> set[str]:
    try:
        return {n for n in os.listdir(_SHM) if n.startswith(_SHM_PREFIXES)}
    except OSError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Remove the shared-memory files this test session's processes created (only those)."""
    before = _shm_files()
    yield
    for name in _shm_files() - before:
        try:
            (_SHM / name).unlink()
        except OSError:
            pass
