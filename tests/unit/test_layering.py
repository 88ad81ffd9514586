"""The package's layout holds: layers (import-linter contracts), no import cycle, no private name
used across modules, no oversized module without a reason at its top (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_ucp"
MAX_LINES = 500
SIZE_REASON = "Size:"
"""A module longer than MAX_LINES says at the top of its docstring why it is one module."""


def test_the_import_linter_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml")], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _cycles(graph: "grimp.ImportGraph", modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), imports inside functions included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v) & modules:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle():
    graph = grimp.build_graph("megatron_ucp")
    # a package's __init__ importing its own submodules is how re-exports work, not a cycle
    modules = {
        m
        for m in graph.modules
        if not (PACKAGE / m.split(".", 1)[-1].replace(".", "/")).is_dir() or m == "megatron_ucp"
    }
    modules.discard("megatron_ucp")
    assert _cycles(graph, modules) == []


def _private_uses(path: Path) -> list[str]:
    """``from megatron_ucp.x import _name`` and ``alias._name`` where alias is a megatron_ucp module."""
    tree = ast.parse(path.read_text())
    aliases = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_ucp"):
            for name in node.names:
                if name.name.startswith("_") and not name.name.startswith("__"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {node.module}.{name.name}")
                else:
                    aliases.add(name.asname or name.name)
        elif isinstance(node, ast.Import):
            for name in node.names:
                if name.name.startswith("megatron_ucp"):
                    aliases.add(name.asname or name.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _private_uses(path)]
    assert found == []


def test_long_modules_say_why_they_are_one_module():
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and SIZE_REASON not in doc:
            unexplained.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert unexplained == []
