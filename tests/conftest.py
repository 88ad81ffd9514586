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

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.dsharness.checkpoints import CheckpointCache, LegacyFixture, session_cache  # noqa: E402
from tests.dsharness.checkpoints import legacy_fixture as _legacy_fixture  # noqa: E402


@pytest.fixture(scope="session")
def ds_checkpoint() -> CheckpointCache:
    return session_cache()


@pytest.fixture(scope="session")
def legacy_fixture():
    def get(name: str) -> LegacyFixture:
        return _legacy_fixture(name)

    return get
