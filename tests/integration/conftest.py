"""Fixtures for the tests against the real Megatron-DeepSpeed (``tests/integration/mds.py``).

The checkout comes from ``MEGATRON_DEEPSPEED_DIR`` (CI: ``../shared/third_party/megatron-deepspeed``).
Unset, these tests skip with that reason; with ``MEGATRON_UCP_REQUIRE_INTEGRATION=1`` (set by the
Makefile's matrix whenever the snapshot is there) a skip is a failure instead, so CI cannot pass
without having run them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.integration.mds import (
    SNAPSHOT_ENV,
    Checkout,
    deepspeed_version,
    prepare_checkout,
    script_imports_unedited,
    snapshot_dir,
)

REQUIRE_ENV = "MEGATRON_UCP_REQUIRE_INTEGRATION"
CACHE_ENV = "MEGATRON_UCP_MDS_CACHE"
"""A folder for the prepared checkout, reused by later sessions (each DeepSpeed of the matrix)."""


def _cannot_run(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: these tests must run here)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def mds_checkout(tmp_path_factory: pytest.TempPathFactory) -> Checkout:
    snapshot = snapshot_dir()
    if snapshot is None:
        _cannot_run(f"{SNAPSHOT_ENV} is not set: no Megatron-DeepSpeed checkout to test against")
    if not (snapshot / "pretrain_gpt_alcf.py").is_file():
        _cannot_run(f"{SNAPSHOT_ENV}={snapshot} holds no pretrain_gpt_alcf.py")
    version = deepspeed_version()
    if not script_imports_unedited(version):
        _cannot_run(
            f"DeepSpeed {version} no longer ships deepspeed.compression.compress, which "
            "Megatron-DeepSpeed's megatron/training.py imports: the script cannot start unedited"
        )
    cache = os.environ.get(CACHE_ENV, "").strip()
    if not cache:
        return prepare_checkout(tmp_path_factory.mktemp("mds"), snapshot)
    # The prepared copy depends on neither DeepSpeed nor torch (its one extension is built for the Python, 3.11
    # in every environment): the Makefile builds it once for all of them.
    folder = Path(cache)
    ready = folder / "ready"
    if ready.is_file() and ready.read_text() == str(snapshot):
        return Checkout(root=folder / "Megatron-DeepSpeed", data_prefix=folder / "data" / "corpus_text_document")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    checkout = prepare_checkout(folder, snapshot)
    ready.write_text(str(snapshot))
    return checkout


@pytest.fixture(scope="module")
def mds_runs(tmp_path_factory: pytest.TempPathFactory) -> "RunCache":
    return RunCache(tmp_path_factory.mktemp("mds-runs"))


class RunCache:
    """Runs shared by the tests of one module (training once, resuming from it several ways); ``shared``: by every
    module of the session (a training several modules compare with, under the name they all give it)."""

    _session: dict[str, tuple[Path, object]] = {}

    def __init__(self, base: Path) -> None:
        self.base = base
        self._done: dict[str, tuple[Path, object]] = {}

    def get(self, name: str, make, shared: bool = False):
        done = RunCache._session if shared else self._done
        if name not in done:
            folder = self.base / name
            folder.mkdir(parents=True, exist_ok=True)
            done[name] = (folder, make(folder))
        return done[name][1]

    def folder(self, name: str, shared: bool = False) -> Path:
        """Where the run ``name`` lives (made by :meth:`get`)."""
        return (RunCache._session if shared else self._done)[name][0]
