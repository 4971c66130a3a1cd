"""The package is layered one way (``../shared/DESIGN.md``, "Rule of the house"): no import cycle, no
arrow up the layers, no module importing another's private name. Imports inside functions and under
``TYPE_CHECKING`` count: a reader follows them as much as Python does."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "countlens"

#: Layer of each top-level part, lowest first; an import may point to its own layer or below.
LAYERS: dict[str, int] = {
    "errors": 0,
    "validate": 0,
    "geometry": 1,
    "progress": 1,
    "models": 2,
    "arch": 2,
    "datasets": 2,
    "answers": 3,
    "results": 3,
    "distributed": 3,
    "memory": 3,
    "layouts": 3,
    "vlm": 3,
    "loading": 3,
    "processors": 3,
    "sizing": 3,
    "toy": 3,
    "circuits": 4,
    "analysis": 5,
    "training": 6,
    "pipeline": 7,
    "cli": 8,
    "": 9,
}
#: Parts that may import only these (besides themselves): data generation needs no model.
ONLY: dict[str, set[str]] = {"datasets": {"datasets", "geometry", "errors", "validate", "progress"}}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module inside the package, imported name) for every import statement of a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [
                (f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, alias.name)
                for alias in node.names
            ]
        else:
            continue
        for module, imported in targets:
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module and module.startswith("countlens") and module != name:
                out.append((module, imported))
    return out


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def graph() -> dict[str, list[tuple[str, str]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycle():
    edges = {a: {b for b, _ in targets if not a.startswith(b + ".")} for a, targets in graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:  # depth-first: a node met again while on the stack closes a cycle
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_arrows_point_down():
    up = []
    for a, targets in graph().items():
        for b, name in targets:
            pa, pb = part(a), part(b)
            if pa not in LAYERS or pb not in LAYERS:
                up.append(f"{a} -> {b}: {pa or pb!r} has no layer in this test's LAYERS")
            elif a.startswith(b + "."):
                continue  # a subpackage's module reading its package's __init__
            elif LAYERS[pb] > LAYERS[pa] or (pa in ONLY and pb not in ONLY[pa]):
                up.append(f"{a} -> {b} ({name})")
    assert not up, "imports that point up the layers:\n" + "\n".join(up)


def test_no_module_imports_another_modules_private_name():
    private = [
        f"{a} imports {name} from {b}"
        for a, targets in graph().items()
        for b, name in targets
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, "\n".join(private)


def test_the_shared_import_layers_tool_finds_no_cycle():
    tool = PACKAGE.parents[1] / "shared" / "tools" / "import_layers.py"
    if not tool.exists():
        pytest.skip(f"{tool} is not on this machine (the in-repo checks above cover the same rule)")
    run = subprocess.run([sys.executable, str(tool), "countlens"], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
