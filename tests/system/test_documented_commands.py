"""Every command README.md and docs/ show is run, or the test that runs it is named here.

The documents' command lines (each line of a shell block that starts a program, continuation lines joined, and
every ``megatron-ucp ...`` named in prose) are matched against :data:`RULES`, first match wins:

* ``megatron-ucp`` commands run here, as shown, on one small synthetic checkpoint saved through the hooks'
  record (placeholders: ``ROOT`` and the example roots are its root, ``TAG``/``T`` and the example tags its tag,
  ``DIR`` its universal twin); each must exit 0. A conversion runs on a fresh copy, so that each one converts;
* ``python -m megatron_ucp.run`` runs here too, with ``--ucp-dry-run`` (it would launch training), and must
  say it would do what the document says;
* commands that need a cluster or a Megatron-DeepSpeed checkout name the test that runs them in a dry run or
  in a real one, which must exist;
* shell set-up (``cd``, ``export``, ``module load``) and the suite's own entry points say why they are not run.

A new command in a document that no rule covers fails here, naming the document and the line.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from megatron_ucp.cli import main
from megatron_ucp.plan.llama_shapes import LlamaShape
from megatron_ucp.synthetic.content import SyntheticSpec
from megatron_ucp.synthetic.writer import write_checkpoint
from tests.unit.test_docs_commands import DOCUMENTS, REPO, _as_argv, _commands

pytestmark = pytest.mark.slow

PROGRAMS = {"megatron-ucp", "python", "make", "bash", "pip", "cd", "export", "qsub", "mpiexec", "torchrun", "module"}
TAG = "global_step4"
ROOTS = ("/path/to/checkpoints", "/lus/flare/projects/MyProj/ckpts/aGPT-7B")
EXAMPLE_TAGS = ("global_step95600",)


@dataclass(frozen=True)
class RunHere:
    """Run by :func:`test_every_documented_command_runs`."""


@dataclass(frozen=True)
class Covered:
    """Run by another test (``path::function``), which must exist."""

    test: str
    why: str


@dataclass(frozen=True)
class NotRun:
    """Not a command of this tool's (shell set-up), or the suite's own entry point: said why."""

    why: str


TRAIN_SCRIPTS = "tests/system/test_train_scripts.py"
RULES: list[tuple[str, object]] = [
    (
        r"^megatron-ucp \w+ .*\[",
        Covered(
            "tests/unit/test_docs_commands.py::test_every_cli_command_shown_parses",
            "a synopsis: each of its options parses with the CLI's parser",
        ),
    ),
    (
        r"--distributed",
        Covered(
            "tests/system/test_distributed_convert.py::test_mpiexec_style_three_processes_commit_once_byte_identical",
            "mpiexec- and torchrun-style launches of several processes",
        ),
    ),
    (
        r"^megatron-ucp relaunch ",
        Covered(
            "tests/system/test_relaunch_command.py::test_a_node_down_is_dropped_and_the_launch_goes_on_on_the_rest",
            "the loop around stand-in launches and probes (a documented launch would start a training job)",
        ),
    ),
    (r"^megatron-ucp ", RunHere()),
    (r"^python -m megatron_ucp\.run ", RunHere()),
    (
        r"^UCP=1 UCP_DRY_RUN=1 bash \S*train_aGPT_7B_ucp\.sh",
        Covered(f"{TRAIN_SCRIPTS}::test_wrapper_dry_run_prints_the_final_command_lines", "the wrapper's dry run"),
    ),
    (
        r"^UCP=1 bash \S*train_aGPT_7B_ucp\.sh",
        Covered(
            f"{TRAIN_SCRIPTS}::test_wrapper_launch_reaches_the_entry_script_through_the_runner",
            "the wrapper launching through the runner; tests/integration runs it on the real Megatron-DeepSpeed",
        ),
    ),
    (r"^qsub .*pbs_resume_elastic\.sh", Covered(f"{TRAIN_SCRIPTS}::test_pbs_example_dry_run", "its dry run")),
    (
        r"^bash tests/device/gpu_checks\.sh",
        NotRun(
            "the device checks need a lent GPU (tests/device/README.md); the script is held shellcheck-clean by "
            f"{TRAIN_SCRIPTS}"
        ),
    ),
    (r"^make test\b", NotRun("the suite's own entry point: .ci/run runs it")),
    (
        r"^make demo\b",
        NotRun(
            f"the demo trains twice with DeepSpeed (minutes): run by hand; its helpers are tested in {TRAIN_SCRIPTS}"
        ),
    ),
    (r"^(make bench|python benchmarks/)", NotRun("a benchmark: timings are measured by make bench, never by tests")),
    (
        r"^make peer\b",
        Covered(
            "tests/unit/test_peer_runner.py::test_only_outcomes_that_differ_from_stocks_are_differences",
            "DeepSpeed's own checkpoint tests three ways (about an hour: by hand); the runner's judgement is tested "
            "there, and what it found is held by tests/system/test_peer_behaviours.py",
        ),
    ),
    (r"^pip install -e ", NotRun("how make test's own environment installs the package (Makefile)")),
    (r"^(cd|export|module load) |^NNODES=", NotRun("shell set-up for the commands that follow it")),
]


def _block_commands() -> list[tuple[str, str]]:
    """(document, command) for each line of a shell block that starts a program."""
    found = []
    for doc in DOCUMENTS:
        for block in re.finditer(r"```(\w*)\n(.*?)```", doc.read_text(), re.S):
            joined = re.sub(r"\\\n\s*", " ", block.group(2))
            for line in joined.splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                words = line.split()
                first = next((w for w in words if not re.match(r"^[A-Z_]+=", w)), "")
                if re.match(r"^megatron-ucp [a-z ]+:", line):
                    continue  # a line of its log, shown as an example
                if first in PROGRAMS or re.match(r"^[A-Z_]+=\$\(", line):
                    found.append((doc.name, " ".join(words)))
    return found


def documented_commands() -> list[tuple[str, str]]:
    seen, out = set(), []
    for doc, command in _block_commands() + _commands():
        command = " ".join(command.split())
        if (doc, command) not in seen:
            seen.add((doc, command))
            out.append((doc, command))
    return out


def rule_of(command: str) -> Optional[object]:
    return next((how for pattern, how in RULES if re.search(pattern, command)), None)


def test_every_documented_command_has_a_rule_and_named_tests_exist():
    commands = documented_commands()
    assert len(commands) > 20 and any(c.startswith("mpiexec") for _, c in commands), commands  # the scan works
    unruled = [f"{doc}: {command}" for doc, command in commands if rule_of(command) is None]
    assert not unruled, "documented commands that nothing runs:\n" + "\n".join(unruled)
    for how in {rule_of(c) for _, c in commands}:
        if isinstance(how, Covered):
            path, function = how.test.split("::")
            tree = ast.parse((REPO / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert function in names, f"{how.test} (named for a documented command) does not exist"


# ------------------------------------------------------------------------------------------------
# the ones run here


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A small checkpoint with the hooks' record, converted once: what inspect, verify and status read."""
    root = tmp_path_factory.mktemp("documented") / "checkpoints"
    shape = LlamaShape(layers=2, hidden=16, ffn=32, heads=2, kv_heads=1, vocab=64, original_vocab=61)
    write_checkpoint(root, SyntheticSpec(shape=shape, dp=4, record=True, iteration=4), progress=False)
    fresh = root.parent / "pristine"
    shutil.copytree(root, fresh)
    assert main(["convert", str(root), "--no-progress"]) == 0
    return root


def _filled(words: list[str], root: Path) -> list[str]:
    out = []
    for word in words:
        for example in ROOTS:
            word = word.replace(example, str(root))
        for example in EXAMPLE_TAGS:
            word = word.replace(example, TAG)
        out.append(
            {"ROOT": str(root), "TAG": TAG, "T": TAG, "DIR": str(root / f"{TAG}_universal"), "PATH": str(root)}.get(
                word, word
            )
        )
    return out


def _cli_argv(command: str, root: Path) -> list[str]:
    return _filled(_as_argv(command), root)  # prose with options only gets its ROOT, a trailing option its value


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = main([*argv, "--no-progress"] if argv[0] == "convert" else argv)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


CLI = [
    (doc, c) for doc, c in documented_commands() if c.startswith("megatron-ucp ") and isinstance(rule_of(c), RunHere)
]


@pytest.mark.parametrize("doc,command", CLI, ids=[f"{d}: {c}"[:80] for d, c in CLI])
def test_every_documented_cli_command_runs(doc, command, saved, tmp_path, capsys):
    argv = _cli_argv(command, saved)
    if argv[0] == "export-hf":  # each export exports: a fresh copy of the saved folder, OUT a folder of its own
        root = tmp_path / "checkpoints"
        shutil.copytree(saved.parent / "pristine", root)
        argv = [str(root) if a == str(saved) else str(tmp_path / "export") if a == "OUT" else a for a in argv]
        rc, out = _run_cli([*argv, "--no-progress"], capsys)
        assert rc == 0, f"{doc}: `{command}` ({argv}) exited {rc}:\n{out}"
        assert len(list(tmp_path.rglob("ucp_export.json"))) == 1, f"{doc}: `{command}` exported nothing"
        return
    if argv[0] == "convert":  # each conversion converts: a fresh copy of the saved folder
        root = tmp_path / "checkpoints"
        shutil.copytree(saved.parent / "pristine", root)
        argv = [str(root) if a == str(saved) else a for a in argv]
        if "--share" in argv:  # a share is one of N converters: run every share, as the document means
            at = argv.index("--share") + 1
            count = int(argv[at].split("/")[1])
            for index in range(count):
                argv[at] = f"{index}/{count}"
                rc, out = _run_cli(argv, capsys)
                assert rc == 0, f"{doc}: `{command}` share {index}/{count} exited {rc}:\n{out}"
        else:
            rc, out = _run_cli(argv, capsys)
            assert rc == 0, f"{doc}: `{command}` ({argv}) exited {rc}:\n{out}"
        assert (root / f"{TAG}_universal" / "ucp_manifest.json").is_file(), f"{doc}: `{command}` converted nothing"
        assert main(["verify", str(root / f"{TAG}_universal"), "--source", str(root)]) == 0
        return
    rc, out = _run_cli(argv, capsys)
    assert rc == 0, f"{doc}: `{command}` ({argv}) exited {rc}:\n{out}"
    assert "Traceback" not in out and out.strip(), out


RUNNER = [(d, c) for d, c in documented_commands() if c.startswith("python -m megatron_ucp.run")]


@pytest.mark.parametrize("doc,command", RUNNER, ids=[f"{d}: {c}"[:80] for d, c in RUNNER])
def test_every_documented_runner_command_does_what_it_says(doc, command, tmp_path):
    words = shlex.split(re.sub(r"\[[^\]]*\]", " ", command))[3:]  # after "python -m megatron_ucp.run"
    if "--help" in words:
        out = subprocess.run([sys.executable, "-m", "megatron_ucp.run", *words], capture_output=True, text=True)
        assert out.returncode == 0 and "--ucp-resume-route" in out.stdout, out.stderr
        return
    (tmp_path / words[0]).write_text("raise SystemExit('a dry run must not run the script')\n")
    out = subprocess.run(
        [sys.executable, "-m", "megatron_ucp.run", *words, "--ucp-dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, f"{doc}: `{command}`: {out.stderr}"
    decided = json.loads(out.stdout)
    options = {word: words[i + 1] for i, word in enumerate(words[:-1])}
    if "--ucp-async-convert" in words:
        assert decided["config"]["async_convert"] is True, decided
    if "--ucp-keep-last" in options:
        assert decided["config"]["keep_last"] == int(options["--ucp-keep-last"]), decided
    assert decided["target"]["value"] == words[0]
