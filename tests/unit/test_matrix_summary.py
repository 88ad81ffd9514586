"""`make test`'s closing summary: counts over every run, and a loud note when the real Megatron-DeepSpeed did not
run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "matrix_summary.py"


def _junit(path: Path, tests: int, failures: int = 0, skipped: int = 0) -> None:
    path.write_text(
        f'<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" skipped="{skipped}"/></testsuites>'
    )


def _summary(folder: Path) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder)],
        capture_output=True,
        text=True,
        env={"MEGATRON_DEEPSPEED_DIR": "/nowhere/Megatron-DeepSpeed"},
    )
    return done.returncode, done.stdout.strip().splitlines()


def test_without_the_real_megatron_deepspeed_the_last_lines_say_so_and_how(tmp_path: Path) -> None:
    _junit(tmp_path / "deepspeed-0.19.8.xml", 5, skipped=1)
    rc, lines = _summary(tmp_path)
    assert rc == 0 and lines[-1] == "4 passed, 0 failed, 1 skipped"
    assert "did NOT run" in lines[-4] and "/nowhere/Megatron-DeepSpeed" in lines[-4]
    assert "MEGATRON_DEEPSPEED_DIR=" in lines[-3] and "make test" in lines[-3]


def test_with_it_the_closing_line_follows_the_runs(tmp_path: Path) -> None:
    _junit(tmp_path / "deepspeed-0.19.8.xml", 5)
    _junit(tmp_path / "megatron-deepspeed-0.19.5.xml", 3, failures=1)
    rc, lines = _summary(tmp_path)
    assert rc == 1 and lines[-1] == "7 passed, 1 failed, 0 skipped"
    assert not any("did NOT run" in line for line in lines)


def test_a_checkout_without_results_is_not_called_missing(tmp_path: Path) -> None:
    checkout = tmp_path / "Megatron-DeepSpeed"
    checkout.mkdir()
    (checkout / "pretrain_gpt_alcf.py").write_text("")
    results = tmp_path / "results"
    results.mkdir()
    _junit(results / "deepspeed-0.19.8.xml", 2, failures=1)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(results)],
        capture_output=True,
        text=True,
        env={"MEGATRON_DEEPSPEED_DIR": str(checkout)},
    )
    assert done.returncode == 1 and f"a checkout is at {checkout}, but no run against it" in done.stdout
