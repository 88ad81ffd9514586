"""install()/uninstall(): idempotent, fully reversible, and refusing unknown DeepSpeed versions."""

from __future__ import annotations

import logging
import os

import deepspeed
import pytest
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

import megatron_ucp
from megatron_ucp.config import UcpConfig
from megatron_ucp.errors import UcpError, UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.integration.install import PatchSet
from megatron_ucp.plan.save_record import partition_record


@pytest.fixture(autouse=True)
def clean():
    megatron_ucp.uninstall()
    yield
    megatron_ucp.uninstall()


def test_install_is_idempotent_and_uninstall_restores_originals():
    originals = (BF16_Optimizer.state_dict, DeepSpeedZeroOptimizer.state_dict)
    cfg = megatron_ucp.install()
    assert megatron_ucp.active_config() == cfg
    patched = (BF16_Optimizer.state_dict, DeepSpeedZeroOptimizer.state_dict)
    assert patched != originals
    assert megatron_ucp.install() == cfg  # same config: nothing changes
    assert (BF16_Optimizer.state_dict, DeepSpeedZeroOptimizer.state_dict) == patched
    megatron_ucp.install(strict=False)  # new config: reinstalled, not stacked
    assert megatron_ucp.active_config().strict is False
    assert BF16_Optimizer.state_dict.__megatron_ucp_original__ is originals[0]
    megatron_ucp.uninstall()
    assert (BF16_Optimizer.state_dict, DeepSpeedZeroOptimizer.state_dict) == originals
    assert megatron_ucp.active_config() is None
    megatron_ucp.uninstall()  # harmless when nothing is installed


def test_unknown_deepspeed_version_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(deepspeed, "__version__", "0.15.0")
    with pytest.raises(UnsupportedError, match="0.15.0"):
        megatron_ucp.install()
    assert megatron_ucp.active_config() is None
    with caplog.at_level(logging.WARNING):
        megatron_ucp.install(allow_untested_deepspeed=True)
    assert "UNTESTED DEEPSPEED" in caplog.text


def test_install_reads_megatron_ucp_environment(monkeypatch):
    monkeypatch.setenv("MEGATRON_UCP_STRICT", "0")
    monkeypatch.setenv("MEGATRON_UCP_KEEP_LAST", "3")
    cfg = megatron_ucp.install()
    assert cfg.strict is False and cfg.keep_last == 3
    assert megatron_ucp.install(strict=True).strict is True  # keyword arguments win
    monkeypatch.setenv("MEGATRON_UCP_KEEP_LAST", "many")
    megatron_ucp.uninstall()
    with pytest.raises(UcpError, match="MEGATRON_UCP_KEEP_LAST"):
        megatron_ucp.install()


def test_config_validation():
    with pytest.raises(UcpError):
        UcpConfig(keep_last=0)
    with pytest.raises(UcpError):
        UcpConfig(converter_workers=0)


def test_patchset_refuses_double_patching():
    class Target:
        def f(self):
            return 1

    patches = PatchSet()
    patches.replace(Target, "f", lambda orig: lambda self: orig(self) + 1)
    assert Target().f() == 2
    with pytest.raises(RuntimeError):
        patches.replace(Target, "f", lambda orig: orig)
    patches.undo()
    assert Target().f() == 1


def test_partition_record_for_the_design_example():
    rec = [partition_record([100, 9], [100, 9], [104, 16], [4, 4], [r, r]) for r in range(4)]
    assert [r[F.GROUP_TRUE_LENGTHS][1] for r in rec] == [4, 4, 1, 0]
    assert [r[F.GROUP_PADDINGS][1] for r in rec] == [0, 0, 3, 4]
    assert rec[3][F.ZERO_PARTITION_INFO] == {
        "version": 1,
        "dp_size": 4,
        "dp_rank": 3,
        "alignment": 8,
        "group_numels": [100, 9],
        "padded_group_numels": [100, 9],
        "partition_sizes": [26, 4],
    }
    with pytest.raises(UnsupportedError, match="flat buffer"):
        partition_record([100], [100], [200], [4], [0])


def test_no_module_imports_ipex():
    """IPEX belongs to the optional `xpu` extra: importing any module of the package never loads it."""
    import pkgutil
    import subprocess
    import sys

    names = [
        m.name for m in pkgutil.walk_packages(megatron_ucp.__path__, "megatron_ucp.") if not m.name.endswith("__main__")
    ]  # running a command is not importing it
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n    importlib.import_module(name)\n"
        "megatron_ucp = sys.modules['megatron_ucp']\nmegatron_ucp.install()\n"
        "bad = [m for m in sys.modules if m.startswith(('intel_extension_for_pytorch', 'oneccl'))]\n"
        "assert not bad, bad\nprint(len(sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != IMPORT_IPEX}  # not the torch 2.8 runs' own preload
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(names) > 20


IMPORT_IPEX = "MEGATRON_UCP_TEST_IMPORT_IPEX"


def test_decision_lines_survive_a_library_configuring_the_root_logger():
    """intel-extension-for-pytorch calls ``logging.basicConfig`` at import: a root handler, the root
    level left at WARNING. The decision lines must still reach the log (through that handler), the
    other ranks stay quiet, and uninstall leaves the logger as it found it."""
    import subprocess
    import sys

    code = (
        "import logging, os\n"
        "logging.basicConfig(format='ROOT %(message)s')\n"
        "import megatron_ucp\n"
        "megatron_ucp.install()\n"
        "logging.getLogger('megatron_ucp.integration.resume.elastic_load').info('decided')\n"
        "megatron_ucp.uninstall()\n"
        "print('level', logging.getLogger('megatron_ucp').level, len(logging.getLogger('megatron_ucp').handlers))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != IMPORT_IPEX}
    first = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**env, "RANK": "0"}
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**env, "RANK": "5"}
    )
    assert first.returncode == 0 and other.returncode == 0, first.stderr[-2000:] + other.stderr[-2000:]
    assert "ROOT decided" in first.stderr and "decided" not in other.stderr, first.stderr[-2000:]
    assert "level 0 0" in first.stdout and "level 0 0" in other.stdout


@pytest.mark.skipif(os.environ.get(IMPORT_IPEX) != "1", reason="only in make test's torch 2.8 + IPEX runs")
def test_the_torch_2_8_runs_have_ipex_loaded_in_every_process():
    """What those runs claim: torch 2.8 with IPEX 2.8 imported before our code, here and in the processes
    the tests launch, the real Megatron-DeepSpeed's ranks included (tests/support/site)."""
    import subprocess
    import sys

    import torch

    assert torch.__version__.startswith("2.8."), torch.__version__
    assert "intel_extension_for_pytorch" in sys.modules
    code = "import sys, torch; print(torch.__version__, sys.modules['intel_extension_for_pytorch'].__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-2:][1].startswith("2.8."), proc.stderr[-2000:]
    # the real Megatron-DeepSpeed's ranks too, whose environment adds the tests' site (once shadowed: Python imports
    # one sitecustomize, and theirs did not import IPEX)
    from tests.integration.mds import rank_env

    ranked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=rank_env())
    assert ranked.returncode == 0 and ranked.stdout.split()[-2:][1].startswith("2.8."), ranked.stderr[-2000:]
