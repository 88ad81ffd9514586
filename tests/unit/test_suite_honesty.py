"""The suite checks itself for the patterns that make a test weaker than its name.

A static scan of every test module (``ast``, nothing imported or run):

* a ``test_*`` function that asserts nothing, directly or through a helper of the suite that does;
* ``zip()`` without ``strict=``, which silently drops the tail of the longer side;
* a timed assertion (a duration measured with the clock and compared), flaky on two busy cores: timings
  belong in ``benchmarks/``;
* a Hypothesis test without ``deadline=None`` (its default deadline is a timed assertion too);
* a skip decided by the code under test, which turns a broken feature into a skip: ``pytest.skip`` under a
  condition that calls into ``megatron_ucp`` directly or through one of the module's own functions that does
  (a skip behind a helper), ``pytest.mark.skipif`` on such a condition, ``pytest.importorskip`` of a
  ``megatron_ucp`` module;
* a log read from a marker to its end (``log[log.index("...") :]``), where what follows the marker is other
  output too (a later load's summary says words the marked section is meant to say): the section is cut at
  both ends (a helper of the suite that returns it) or the claim is made of the one line;
* "at least N" counted over a combined log (``log.count(...) >= N``), where N ranks each saying it once and
  one rank saying it N times read the same: per rank section, exact;
* a module that launches runs expecting them to fail (``expect_failure=`` anything but ``False``) and never
  reads an exit status (``returncode``, ``ok``): a run that should have succeeded and crashed passes unseen.

What the scan cannot find mechanically, a reviewer must: a substring asserted over a whole log that is always
there for another reason (the scan does not know what else the log says; the suite's convention is to assert in
the section the claim is about: ``TrainResult.rank_logs``, ``elastic_support.fallback_announcements``), an
exit status read in one test of a module and not in another, and an oracle that shares the code under test.

Each rule is also run on a small bad example, so that the scan itself is seen to catch what it names.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
DURATION_NAMES = {"elapsed", "wall_s", "duration", "took", "seconds_taken"}
ASSERTING_CALLS = {"raises", "fail", "warns", "deprecated_call", "approx"}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(TESTS.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _asserts_directly(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assert, ast.Raise)):
            return True
        if isinstance(node, ast.Call) and _called_name(node) in ASSERTING_CALLS:
            return True
    return False


def asserting_functions(trees: list[ast.Module]) -> set[str]:
    """Names of the suite's functions that assert, directly or through another such function (fixpoint
    by name: a helper's name stands for every definition of it)."""
    defs: dict[str, list[ast.AST]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, []).append(node)
    asserting = {name for name, fns in defs.items() if any(_asserts_directly(f) for f in fns)}
    changed = True
    while changed:
        changed = False
        for name, fns in defs.items():
            if name in asserting:
                continue
            calls = {_called_name(c) for f in fns for c in ast.walk(f) if isinstance(c, ast.Call)}
            if calls & asserting:
                asserting.add(name)
                changed = True
    return asserting


def unasserted_tests(tree: ast.Module, asserting: set[str]) -> list[str]:
    out = []
    for node in tree.body:
        fns = [node] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef):
            fns = [n for n in node.body if isinstance(n, ast.FunctionDef)]
        for fn in fns:
            if not fn.name.startswith("test_"):
                continue
            calls = {_called_name(c) for c in ast.walk(fn) if isinstance(c, ast.Call)}
            if not _asserts_directly(fn) and not (calls & asserting):
                out.append(f"{fn.name} (line {fn.lineno})")
    return out


def zips_without_strict(tree: ast.Module) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "zip"
        and len(node.args) > 1
        and not any(k.arg == "strict" for k in node.keywords)
    ]


def _is_clock_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS


def _measures_duration(expr: ast.AST) -> bool:
    for node in ast.walk(expr):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            if _is_clock_call(node.left) or _is_clock_call(node.right):
                return True
        if isinstance(node, ast.Name) and node.id in DURATION_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in DURATION_NAMES:
            return True
    return False


def timed_assertions(tree: ast.Module) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and _measures_duration(node.test)
    ]


def hypothesis_without_deadline(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        decorators = [d for d in node.decorator_list if isinstance(d, ast.Call)]
        if not any(_called_name(d) == "given" for d in decorators):
            continue
        settings = [d for d in decorators if _called_name(d) == "settings"]
        ok = any(
            k.arg == "deadline" and isinstance(k.value, ast.Constant) and k.value.value is None
            for d in settings
            for k in d.keywords
        )
        if not ok:
            out.append(f"{node.name} (line {node.lineno})")
    return out


def _imported_from_us(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_ucp"):
            names.update(a.asname or a.name for a in node.names)
    return names


def _calls_into(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` calls a name in ``names`` (``f(...)``, ``f.g(...)``, ``module.f(...)``)."""
    for c in ast.walk(node):
        if isinstance(c, ast.Call):
            root = c.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in names:
                return True
    return False


def _ours_and_helpers(tree: ast.Module) -> set[str]:
    """Names imported from ``megatron_ucp`` and the module's own functions that call them, directly or through
    another such function (fixpoint)."""
    ours = _imported_from_us(tree)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    changed = True
    while changed:
        changed = False
        for name, fn in functions.items():
            if name not in ours and not name.startswith("test_") and _calls_into(fn, ours):
                ours.add(name)
                changed = True
    return ours


def skips_decided_by_the_code(tree: ast.Module) -> list[int]:
    """``if <call into megatron_ucp>: pytest.skip(...)`` (directly or through a helper),
    ``@pytest.mark.skipif(<such a call>)``, ``pytest.importorskip("megatron_ucp...")``: the code under test
    chooses not to be tested."""
    ours = _ours_and_helpers(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            skips = any(isinstance(c, ast.Call) and _called_name(c) == "skip" for s in node.body for c in ast.walk(s))
            if skips and _calls_into(node.test, ours):
                out.append(node.lineno)
        elif isinstance(node, ast.Call) and _called_name(node) == "skipif" and node.args:
            if _calls_into(node.args[0], ours):
                out.append(node.lineno)
        elif isinstance(node, ast.Call) and _called_name(node) == "importorskip" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("megatron_ucp"):
                out.append(node.lineno)
    return out


def _is_log(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "log") or (isinstance(node, ast.Name) and node.id == "log")


def logs_read_to_the_end(tree: ast.Module) -> list[int]:
    """``<log>[<log>.index(...) :]`` or ``.find``: a section with no end."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_log(node.value) and isinstance(node.slice, ast.Slice):
            lower, upper = node.slice.lower, node.slice.upper
            if (
                upper is None
                and isinstance(lower, ast.Call)
                and _called_name(lower) in ("index", "find")
                and isinstance(lower.func, ast.Attribute)
                and _is_log(lower.func.value)
            ):
                out.append(node.lineno)
    return out


def counts_at_least_over_a_log(tree: ast.Module) -> list[int]:
    """``<log>.count(...) >= N`` (or ``>``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and _called_name(node.left) == "count":
            func = node.left.func
            if isinstance(func, ast.Attribute) and _is_log(func.value) and isinstance(node.ops[0], (ast.GtE, ast.Gt)):
                out.append(node.lineno)
    return out


def failures_expected_and_never_read(tree: ast.Module) -> list[int]:
    """The lines passing ``expect_failure=`` (not ``False``) in a module that reads no ``returncode`` or ``ok``."""
    expecting = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword)
        and node.arg == "expect_failure"
        and not (isinstance(node.value, ast.Constant) and node.value.value is False)
    ]
    reads = any(isinstance(n, ast.Attribute) and n.attr in ("returncode", "ok") for n in ast.walk(tree))
    return [] if reads else expecting


def _scan() -> dict[str, list[str]]:
    modules = list(_modules())
    asserting = asserting_functions([t for _, t in modules])
    found: dict[str, list[str]] = {}
    for path, tree in modules:
        rel = str(path.relative_to(TESTS.parent))
        for what, hits in (
            ("test without an assertion", unasserted_tests(tree, asserting)),
            ("zip without strict", zips_without_strict(tree)),
            ("timed assertion", timed_assertions(tree)),
            ("Hypothesis test without deadline=None", hypothesis_without_deadline(tree)),
            ("skip decided by the code under test", skips_decided_by_the_code(tree)),
            ("log read from a marker to its end", logs_read_to_the_end(tree)),
            ("at-least count over a combined log", counts_at_least_over_a_log(tree)),
            ("failure expected, exit status never read", failures_expected_and_never_read(tree)),
        ):
            for hit in hits:
                found.setdefault(what, []).append(f"{rel}: {hit}")
    return found


def test_the_suite_has_none_of_the_weak_patterns():
    found = _scan()
    assert not found, "\n".join(f"{what}: {hit}" for what, hits in found.items() for hit in hits)


BAD = """
import time
from hypothesis import given, settings
from megatron_ucp.format import osio
import pytest

def test_nothing():
    x = 1

def test_zips(a, b):
    assert list(zip(a, b))

def test_timed():
    t0 = time.monotonic()
    assert time.monotonic() - t0 < 1
    elapsed = 2
    assert elapsed < 3

@given(1)
def test_default_deadline(x):
    assert x

@settings(deadline=None)
@given(1)
def test_fine(x):
    assert x

def test_skipped(a, b):
    if not osio.exchange(a, b):
        pytest.skip("unsupported")
    assert True

def helper():
    assert 1

def test_through_a_helper():
    helper()

def _unsupported(a):
    return osio.exchange(a, a)

def test_skipped_behind_a_helper(a):
    if _unsupported(a):
        pytest.skip("unsupported")
    assert True

@pytest.mark.skipif(osio.exchange(1, 2), reason="the code says so")
def test_skipif(a):
    assert a

def test_importorskip():
    pytest.importorskip("megatron_ucp.integration.save.recording")
    assert True

def test_sections(res):
    said = res.log[res.log.index("FALLING BACK") :]
    assert "checksum" in said
    assert res.log.count("Error") >= 3
    assert run(expect_failure=True)
"""


def test_the_scan_catches_each_pattern():
    tree = ast.parse(BAD)
    asserting = asserting_functions([tree])
    assert [h.split(" ")[0] for h in unasserted_tests(tree, asserting)] == ["test_nothing"]
    assert len(zips_without_strict(tree)) == 1
    assert len(timed_assertions(tree)) == 2
    assert [h.split(" ")[0] for h in hypothesis_without_deadline(tree)] == ["test_default_deadline"]
    assert len(skips_decided_by_the_code(tree)) == 4
    assert len(logs_read_to_the_end(tree)) == 1
    assert len(counts_at_least_over_a_log(tree)) == 1
    assert len(failures_expected_and_never_read(tree)) == 1
    assert failures_expected_and_never_read(ast.parse("run(expect_failure=True).returncode")) == []
