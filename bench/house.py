"""The house's measures: how many ways lead into the model, and how the package is built.

Counts, read from the source as text and syntax trees (nothing is imported or run):

- ``files`` / ``lines``: the package's Python files and lines;
- ``imports_in_functions``: imports of countlens inside a function body (an arrow a reader cannot see
  at the top of the file); imports of other packages there (often deferred on purpose: torch, typer's
  start-up) are counted apart;
- ``hook_registrations``: ``register_forward_hook`` / ``register_forward_pre_hook`` / backward hooks
  outside the engine (``circuits/engine/``), the model layer (``model/``) and fine-tuning's LoRA wiring;
- ``module_path_literals``: the grep list of the issue "One engine" outside ``model/`` (and the tiny
  models' builders, `countlens.toy.tiny_models`: family knowledge kept beside the organism) and the engine:
  ``get_submodule``, ``.self_attn.``, ``language_model.layers``, ``"norm" in``, ``register_forward_*hook``;
- ``named_METHODS``: module-level names ``METHODS`` (the registry's one is expected).

Run: ``python bench/house.py`` (prints JSON; ``--write`` stores it in ``bench/house.json``).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "countlens"
# The tiny builders are each family's model knowledge (they build and condition HF modules), kept under toy/
# only because their tokenizers read the organism's vocabulary: the model layer by what they do.
MODEL_ROOMS = ("model/", "circuits/engine/", "toy/tiny_models/")
HOOKS = re.compile(
    r"register_(forward_hook|forward_pre_hook|full_backward_hook|full_backward_pre_hook)\(|\.register_hook\("
)
PATH_LITERALS = (
    "get_submodule",
    "register_forward_hook",
    "register_forward_pre_hook",
    ".self_attn.",
    "language_model.layers",
    '"norm" in',
)


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _is_internal(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").startswith("countlens")
    return any(alias.name.startswith("countlens") for alias in node.names)


def _imports_in_functions(tree: ast.Module) -> tuple[int, int]:
    """(countlens imports, other imports) inside function bodies, each counted once when functions nest."""
    seen: dict[int, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    seen[id(inner)] = _is_internal(inner)
    internal = sum(seen.values())
    return internal, len(seen) - internal


def measure() -> dict:
    files = sorted(PACKAGE.rglob("*.py"))
    lines = 0
    in_functions = [0, 0]
    hooks: dict[str, int] = {}
    literals: dict[str, int] = {}
    methods_names: list[str] = []
    for path in files:
        text = path.read_text()
        lines += text.count("\n")
        tree = ast.parse(text)
        internal, other = _imports_in_functions(tree)
        in_functions[0] += internal
        in_functions[1] += other
        rel = _relative(path)
        inside = rel.startswith(MODEL_ROOMS)
        n_hooks = len(HOOKS.findall(text))
        if n_hooks and not inside:
            hooks[rel] = n_hooks
        n_literals = sum(text.count(s) for s in PATH_LITERALS)
        if n_literals and not inside:
            literals[rel] = n_literals
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == "METHODS" for t in targets):
                methods_names.append(rel)
    return {
        "files": len(files),
        "lines": lines,
        "imports_in_functions": in_functions[0],
        "imports_in_functions_of_other_packages": in_functions[1],
        "hook_registrations": sum(hooks.values()),
        "hook_registrations_by_file": hooks,
        "module_path_literals": sum(literals.values()),
        "module_path_literals_by_file": literals,
        "named_METHODS": methods_names,
    }


def main(argv: list[str]) -> None:
    figures = measure()
    text = json.dumps(figures, indent=2, sort_keys=True)
    print(text)
    if "--write" in argv:
        (ROOT / "bench" / "house.json").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
