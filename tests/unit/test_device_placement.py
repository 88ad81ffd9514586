"""No device or collective backend is assumed anywhere in the package.

On Aurora the engine's tensors live on XPU and the collectives run on ccl/xccl; in CI on the CPU with
gloo. The package places tensors through DeepSpeed's accelerator abstraction
(:func:`megatron_ucp.integration.collectives.device`) or next to the engine tensor they meet, and
uses the process groups DeepSpeed hands it. This scan of the source fails on what would break that:
``.cuda()`` / ``.xpu()``, ``torch.cuda`` / ``torch.xpu``, a device or backend named in code
(``"cuda"``, ``"xpu"``, ``"nccl"``, ``"ccl"``, ``"xccl"``, ``"gloo"``), and explicit host placement
(``device="cpu"``, ``.to("cpu")``, ``map_location="cpu"``) outside the places listed below (and one backend:
the offline converter's own CPU process group), each with why it is right there
(``tests/support/device_policy.py``; the harness's recording accelerator checks a real run against the
same list, ``tests/system/test_native_reshard.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_ucp
from tests.support.device_policy import BACKEND_ON_PURPOSE, HOST_ON_PURPOSE

PACKAGE = Path(megatron_ucp.__file__).parent
ACCELERATOR_NAMES = {"cuda", "xpu", "nccl", "ccl", "xccl", "gloo", "hccl", "mps"}


def _enclosing_functions(tree: ast.AST) -> dict[ast.AST, str]:
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[child] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _findings(path: Path) -> list[tuple[str, str, int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    owner = _enclosing_functions(tree)
    rel = path.relative_to(PACKAGE).as_posix()
    found = []

    def note(node: ast.AST, what: str) -> None:
        found.append((rel, owner.get(node, "<module>"), node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in ("cuda", "xpu"):
                note(node, f".{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            word = node.value.split(":")[0]
            if word in ACCELERATOR_NAMES:
                note(node, repr(node.value))
            elif node.value == "cpu":
                note(node, "host 'cpu'")
    return found


def _scan() -> list[tuple[str, str, int, str]]:
    return [f for path in sorted(PACKAGE.rglob("*.py")) for f in _findings(path)]


def test_no_device_or_backend_is_hard_coded():
    findings = _scan()
    named = [f for f in findings if f[3] != "host 'cpu'" and (f[0], f[1], f[3]) not in BACKEND_ON_PURPOSE]
    assert not named, "a device or backend named in code (use integration.collectives.device()): " + str(named)


def test_host_placement_only_where_it_is_meant():
    host = [f for f in _scan() if f[3] == "host 'cpu'"]
    unexpected = [f for f in host if (f[0], f[1]) not in HOST_ON_PURPOSE and not _is_device_type_check(f)]
    assert not unexpected, f"host placement outside {sorted(HOST_ON_PURPOSE)}: {unexpected}"
    used = {(f[0], f[1]) for f in host}
    assert not set(HOST_ON_PURPOSE) - used, "stale entries: " + str(sorted(set(HOST_ON_PURPOSE) - used))


def _is_device_type_check(finding: tuple[str, str, int, str]) -> bool:
    """``t.device.type == "cpu"`` / ``!= "cpu"`` asks where a tensor is; it places nothing."""
    rel, _, line, _ = finding
    text = (PACKAGE / rel).read_text().splitlines()[line - 1]
    return "device.type" in text


def test_the_scan_sees_what_it_forbids(tmp_path):
    """The scan itself: each forbidden form in a scratch module is reported."""
    scratch = PACKAGE / "_device_scan_probe.py"
    scratch.write_text(
        "import torch\n"
        "def f(t):\n"
        "    a = t.cuda()\n"
        "    b = torch.zeros(1, device='xpu:0')\n"
        "    c = t.to('cpu')\n"
        "    torch.distributed.init_process_group('nccl')\n"
    )
    try:
        found = {what for _, _, _, what in _findings(scratch)}
    finally:
        scratch.unlink()
    assert {".cuda", "'xpu:0'", "host 'cpu'", "'nccl'"} <= found, found
