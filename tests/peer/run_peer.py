"""DeepSpeed's own checkpoint tests, run three ways: stock DeepSpeed, with megatron-ucp's hooks installed in every
process, and with the hooks and asynchronous saves; then each test whose outcome differs from stock's, with its first
error (``make peer``).

The tests are DeepSpeed's (``../shared/third_party/deepspeed-tests/``, its README says which commit and which CPU
edits): they are copied to a temporary folder, the two edits its README lists are applied there with ``patch`` (and
DeepSpeed's CPU accelerator told fp16 works, which torch runs on any CPU: the fp16 cases, the mixture-of-experts ones
among them, run instead of stopping at DeepSpeed's start-up check; ``UCP_PEER_FP16=0`` leaves it as it is), and
each node id runs in a pytest of its own (DeepSpeed's harness ends the whole pytest at its first hang), bounded in
time: a test still running after ``--timeout`` seconds is a hang, reported with each of its processes' stack (every
process registers ``faulthandler`` on SIGUSR1 through this folder's ``site/sitecustomize.py``, which also installs the
hooks in the hooked modes) and the rank it ran, then killed.

Usage (from the repository root, the project's environment; ``make peer`` puts the pytest < 8.4 that DeepSpeed's
harness needs first on ``PYTHONPATH``, and the runner refuses a newer one)::

    PYTHONPATH=.peer-pytest python tests/peer/run_peer.py [--ids FILE] [--modes stock,hooks,async] [--timeout 300]
        [--out DIR] [-k EXPR]

Exit status: 0 when every difference from stock is one the docs list as intended (docs/peer_suite.md,
:data:`INTENDED`), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(os.environ.get("DEEPSPEED_TESTS_DIR", REPO.parent / "shared" / "third_party" / "deepspeed-tests"))
"""DeepSpeed's checkpoint tests (``DEEPSPEED_TESTS_DIR``, default the snapshot beside the checkout)."""
SITE = Path(__file__).resolve().parent / "site"
EDITS = ("cpu-edit-bf16-check.diff", "cpu-edit-sparse-names.diff")
MODES = {
    "stock": {},
    "hooks": {"UCP_PEER_HOOKS": "1"},
    "async": {"UCP_PEER_HOOKS": "1", "MEGATRON_UCP_ASYNC_SAVE": "1"},
}
EXTRA_IDS = (
    "unit/checkpoint/test_pipeline.py",
    "unit/checkpoint/test_moe_checkpoint.py",
    "unit/checkpoint/test_universal_checkpoint.py",
    "unit/checkpoint/test_reshape_checkpoint.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_other_optimizer.py",
)
"""Whole modules beside ``selected_45.txt`` (their CPU node ids are collected, then run one by one)."""
SAMPLED = {"test_universal_checkpoint.py": re.compile(r"\[-1-True-True-[13]-dtype0\]$")}
"""Modules whose parametrization is sampled (144 universal-checkpoint cases: each DP change at ZeRO-1 and 3, bf16, the
optimizer loaded, torch's Adam, no sub-groups)."""
INTENDED = {
    "test_elastic_checkpoint_change_dp[True-False-False]": (
        ("hooks", "async"),
        ("failed", "hang"),
        "a DP change with optimizer states: stock DeepSpeed refuses it (ZeRORuntimeException); megatron-ucp's elastic "
        "resume reshards the rank files instead (the test expects the refusal: DID NOT RAISE, after which DeepSpeed's "
        "harness may wait for the ranks that went on)",
    ),
}
"""Parts of node ids whose difference from stock, in the modes named and with one of the outcomes named, is the
product's purpose, with the reason (docs/peer_suite.md). Any other outcome of those tests is a difference."""
READS_RIGHT_AFTER_SAVE = (
    "test_save_exclude_frozen_weights",
    "test_save_exclude_custom_frozen_weights",
    "test_checkpoint_shared_weights",
    "TestMoECheckpoint::test_checkpoint_moe",
    "test_universal_checkpoint.py::",  # its fixture runs DeepSpeed's ds_to_universal right after the save
)
"""Tests that open the rank files themselves (``torch.load``) the moment ``save_checkpoint`` returns. An asynchronous
save returns before its files are on disk, which is its purpose, and the docs tell such a script to call
``megatron_ucp.wait_for_saves()`` first: in the asynchronous mode these tests run with each save followed by it
(``UCP_PEER_WAIT_AFTER_SAVE=1``, site/sitecustomize.py), so that they check the files the asynchronous save wrote."""


@dataclass
class Outcome:
    node: str
    mode: str
    outcome: str
    """passed, failed, skipped, error, hang."""
    seconds: float
    first_error: str = ""
    stacks: dict = field(default_factory=dict)
    """A hang's processes: ``rank <r> pid <p>`` -> where each waited (its main thread's innermost frames)."""


def prepared_copy(work: Path) -> Path:
    """The snapshot's tests copied into ``work`` with the README's CPU edits applied (the snapshot stays as it is)."""
    tests = work / "deepspeed-tests"
    shutil.copytree(SNAPSHOT, tests)
    for edit in EDITS:
        subprocess.run(["patch", "-p1", "-s", "-i", str(SNAPSHOT / edit)], cwd=tests, check=True)
    return tests


def node_ids(tests: Path, ids_file: Optional[Path], env: dict, select: str) -> list[str]:
    ids = [line.strip() for line in (ids_file or tests / "selected_45.txt").read_text().splitlines() if line.strip()]
    if ids_file is None:
        listing = tests / "extra-ids.txt"
        collected = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-p",
                "ucp_peer_ids",
                "-p",
                "no:cacheprovider",
                *EXTRA_IDS,
            ],
            cwd=tests / "tests",
            env={**env, "UCP_PEER_IDS": str(listing)},
            capture_output=True,
            timeout=600,
        )
        found = [line.strip() for line in listing.read_text().splitlines() if line.strip()] if listing.is_file() else []
        if collected.returncode != 0 or not found:  # never a run that silently leaves the extra modules out
            raise SystemExit(
                f"collecting {', '.join(EXTRA_IDS)} failed (exit {collected.returncode}, {len(found)} ids):\n"
                + (collected.stdout + collected.stderr)[-3000:]
            )
        ids += [node for node in found if node not in ids and _sampled(node)]
    return [i for i in ids if not select or re.search(select, i)]


def _pytest_version(env: dict) -> tuple[int, ...]:
    """The pytest the test runs import (the runs' ``PYTHONPATH`` first)."""
    out = subprocess.run(
        [sys.executable, "-c", "import pytest; print(pytest.__version__)"], env=env, capture_output=True, text=True
    )
    return tuple(int(x) for x in re.findall(r"\d+", out.stdout)[:2]) or (0,)


def _sampled(node: str) -> bool:
    return all(pattern.search(node) for module, pattern in SAMPLED.items() if module in node)


def base_env(work: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("UCP_PEER_FP16", "1")
    env.update(
        {
            "LOCAL_SIZE": "4",
            "PEER_CPU_BF16": "1",
            "DS_ACCELERATOR": "cpu",
            "DS_UNITTEST_TIMEOUT": "3600",  # this runner bounds each test itself, and says where it hung
            "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"),
            "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
    )
    return env


def run_one(tests: Path, node: str, mode: str, env: dict, timeout: float, stacks_root: Path) -> Outcome:
    stacks_root.mkdir(parents=True, exist_ok=True)
    stacks = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=stacks_root))
    env = {**env, **MODES[mode], "UCP_PEER_STACKS": str(stacks)}
    if mode == "async" and any(part in node for part in READS_RIGHT_AFTER_SAVE):
        env["UCP_PEER_WAIT_AFTER_SAVE"] = "1"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", node],
        cwd=tests / "tests",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        _signal_group(proc.pid, signal.SIGUSR1)  # every process dumps its stacks (faulthandler)
        time.sleep(3)
        _signal_group(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    seconds = time.monotonic() - t0
    if hung:
        return Outcome(node, mode, "hang", seconds, f"no end after {timeout:.0f} s", _stacks(stacks))
    return Outcome(node, mode, _outcome(out, proc.returncode), seconds, _first_error(out))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _outcome(out: str, code: int) -> str:
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    for word in ("failed", "error", "passed", "skipped"):
        if re.search(rf"\b\d+ {word}", tail):
            return word
    return "failed" if code else "passed"


def _first_error(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("E ") or re.search(r"\b[A-Za-z_.]*(Error|Exception)\b: ", line):
            return " ".join(line.split())[:400]
    return ""


def _stacks(folder: Path) -> dict:
    """Each dumped process: its rank (the file was renamed to it once the rank was known) -> the innermost frames of
    its main thread."""
    found = {}
    for path in sorted(folder.glob("*.txt")):
        text = path.read_text(errors="replace")
        current = text.split("Current thread", 1)
        main = current[1] if len(current) > 1 else text
        frames = [line.strip() for line in main.splitlines() if line.strip().startswith("File ")][:16]
        if frames:
            found[path.stem] = frames
    return found


def differences(results: list[Outcome]) -> list[tuple[str, str, Outcome, Outcome]]:
    """(node, mode, stock's outcome, this mode's outcome) where they differ."""
    by = {(r.node, r.mode): r for r in results}
    out = []
    for (node, mode), r in sorted(by.items()):
        stock = by.get((node, "stock"))
        if mode != "stock" and stock is not None and stock.outcome != r.outcome:
            out.append((node, mode, stock, r))
    return out


def intended(node: str, mode: str, outcome: str = "failed") -> Optional[str]:
    for part, (modes, outcomes, why) in INTENDED.items():
        if part in node and mode in modes and outcome in outcomes:
            return why
    return None


def table(results: list[Outcome], modes: list[str]) -> str:
    by = {(r.node, r.mode): r for r in results}
    nodes = sorted({r.node for r in results})
    lines = ["| test | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for node in nodes:
        cells = [by[(node, m)].outcome if (node, m) in by else "-" for m in modes]
        lines.append(f"| {node.split('::', 1)[1]} | " + " | ".join(cells) + " |")
    counts = []
    for m in modes:
        outcomes = [by[(n, m)].outcome for n in nodes if (n, m) in by]
        counts.append(", ".join(f"{outcomes.count(o)} {o}" for o in sorted(set(outcomes))))
    lines.append("| **in all** | " + " | ".join(counts) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--ids", type=Path, help="node ids, one per line (default: the snapshot's selected_45.txt)")
    p.add_argument("--modes", default="stock,hooks,async")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a test is a hang")
    p.add_argument("-k", dest="select", default="", help="only node ids matching this regular expression")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "peer")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    pytest_version = _pytest_version(base_env(Path(tempfile.gettempdir())))
    if pytest_version >= (8, 4):
        raise SystemExit(
            f"pytest {'.'.join(map(str, pytest_version))} on the runs' path: DeepSpeed's DistributedFixture tests find "
            "no fixture under pytest >= 8.4 (every mode alike, so no difference would show): `make peer` puts pytest "
            "8.3 first on PYTHONPATH"
        )
    work = Path(tempfile.mkdtemp(prefix="ucp-peer-"))
    try:
        tests = prepared_copy(work)
        env = base_env(work)
        ids = node_ids(tests, args.ids, env, args.select)
        print(f"{len(ids)} tests x {len(modes)} modes ({', '.join(modes)}), each bounded by {args.timeout:.0f} s")
        results: list[Outcome] = []
        for node in ids:
            for mode in modes:
                r = run_one(tests, node, mode, env, args.timeout, work / "stacks")
                results.append(r)
                print(f"{r.outcome:8s} {r.seconds:6.1f}s {mode:6s} {node}", flush=True)
                for who, frames in r.stacks.items():
                    print(f"    {who} waited in: {' <- '.join(frames[:3])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M")
    (args.out / f"peer-{stamp}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print("\n" + table(results, modes))
    unexplained = 0
    for node, mode, stock, r in differences(results):
        why = intended(node, mode, r.outcome)
        unexplained += why is None
        label = f"intended: {why}" if why else f"{r.first_error or '-'}"
        print(f"DIFFERS ({mode}: {r.outcome}, stock: {stock.outcome}) {node}\n    {label}")
        for who, frames in r.stacks.items():
            print(f"    {who}: {' <- '.join(frames)}")
    print(f"results: {args.out / f'peer-{stamp}.json'}; {unexplained} unexplained difference(s) from stock")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
