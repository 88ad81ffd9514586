"""Every command the README and docs/ show is one the code accepts: each ``megatron-ucp ...`` line (synopses
included, their placeholders filled in) parses with the CLI's own parser, and every ``--ucp-*`` option shown
anywhere is one of the runner's. A flag renamed or removed in the code fails here, naming the document.

What the commands do is the business of the tests of each command; this holds the documents to the code.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_ucp.cli import build_parser
from megatron_ucp.config import spec_by_option
from megatron_ucp.integration.run import ALCF_BATCH_ENV

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "device" / "README.md"]
COMMAND = re.compile(r"megatron-ucp (?:convert|inspect|verify|status|synthesize|export-hf)\b(?:[^`|\n#\\]|\\\|)*")
PLACEHOLDERS = {
    "I/N": "0/2",
    "N": "2",
    "E": "4",
    "SECONDS": "60",
    "RANGE": "1-8",
    "V": "0.19.8",
    "ID": "attempt",
    "GIB": "1",
}
"""Values for a synopsis's placeholders where the option takes a typed value (anything else is a path)."""


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCUMENTS:
        for match in COMMAND.finditer(doc.read_text()):
            text = match.group(0).strip().rstrip(".,;:)")
            if "..." in text or len(text.split()) < 3:
                continue  # "megatron-ucp convert" named in prose, or elided: not a command line
            found.append((doc.name, text))
    return found


def _as_argv(synopsis: str) -> list[str]:
    """A synopsis as one command line: optional parts taken, the first of alternatives, placeholders filled; a
    command named in prose with options only (``megatron-ucp convert --workers 2``) gets its ROOT, and a
    trailing option named without its value gets one."""
    text = re.sub(r"\\?\|[^\]\s]*", "", synopsis).replace("[", " ").replace("]", " ")
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(text)[1:]]  # without "megatron-ucp"
    if words[0] != "inspect" and all(w.startswith("-") for w in words[1:2]):
        words.insert(1, "ROOT")
    sub = build_parser()._subparsers._group_actions[0].choices[words[0]]  # type: ignore[union-attr]
    last = next((a for a in sub._actions if words[-1] in a.option_strings), None)
    if last is not None and last.nargs is None and last.const is None and not isinstance(last.default, bool):
        words.append("1")
    return words


@pytest.mark.parametrize("doc,command", _commands(), ids=lambda v: v if len(v) < 60 else v[:57] + "...")
def test_every_cli_command_shown_parses(doc: str, command: str):
    argv = _as_argv(command)
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's refusal: an option or a choice the code does not know
        pytest.fail(f"{doc}: `{command}` does not parse ({argv}): exit {exc.code}")


def test_every_ucp_option_shown_is_the_runners():
    known = set(spec_by_option()) | {ALCF_BATCH_ENV}
    shown = {
        (doc.name, option) for doc in DOCUMENTS for option in re.findall(r"--ucp-[a-z0-9-]+[a-z0-9]", doc.read_text())
    }
    unknown = sorted(f"{doc}: {option}" for doc, option in shown if option not in known)
    assert not unknown, unknown
    assert shown, "no --ucp-* option found in the documents: the scan is broken"


def test_the_scan_finds_the_commands_and_fills_synopses():
    commands = [c for _, c in _commands()]
    assert any(c.startswith("megatron-ucp status") for c in commands) and len(commands) > 10
    assert _as_argv("megatron-ucp convert ROOT [--share I/N --attempt-id ID] [--optimizer bf16\\|zero]") == [
        "convert",
        "ROOT",
        "--share",
        "0/2",
        "--attempt-id",
        "attempt",
        "--optimizer",
        "bf16",
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(_as_argv("megatron-ucp status ROOT --no-such-flag"))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_local_link_and_section_named_exists():
    """A relative link's file (and its #section), and every section of the README the docs name in quotes, exist."""
    headings = {
        doc: {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", doc.read_text(), re.M)} for doc in DOCUMENTS
    }
    broken = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: link to {target}: no such file")
            elif anchor and file.suffix == ".md":
                known = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
                if anchor not in known:
                    broken.append(f"{doc.name}: link to {target}: no such section")
        for section in re.findall(r"the README's \"([^\"]+)\"", text):
            if section not in headings[REPO / "README.md"]:
                broken.append(f'{doc.name}: names the README\'s "{section}", which has no such section')
    assert not broken, "\n".join(broken)


def test_every_option_of_every_command_has_help_and_every_command_takes_no_progress():
    """``--help`` is the first document a user reads: no option without its line; ``--no-progress`` (which scripts
    pass to every command) accepted by each."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)]
    silent = [
        (name, a.option_strings)
        for name, sub in commands.choices.items()
        for a in sub._actions
        if a.option_strings and a.help is None
    ]
    assert not silent, silent
    for name, sub in commands.choices.items():  # but the training runner, whose options are the job's
        assert name == "run" or any("--no-progress" in a.option_strings for a in sub._actions), name
