"""The package is layered one way (``../shared/DESIGN.md``, "Rule of the house"): no import cycle, no
arrow up the layers, no module importing another's private name. Imports inside functions and under
``TYPE_CHECKING`` count: a reader follows them as much as Python does.

Family knowledge lives in one place (`countlens.model.families`): a family's names (its model types, its
class-name prefixes, its remote-code model types) appear in package code only in its own module
under ``countlens/model/families/``, its tiny model's builder under ``countlens/toy/tiny_models/`` (the
mirror of the families, `tests/unit/test_arch_matrix.py`), and the two registries; nothing but the registry
imports a family module. Comments and docstrings may name any family; code may not. What still names a family
elsewhere is listed in `FAMILY_NAMES_ELSEWHERE` with its reason."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "countlens"

#: Layer of each top-level part, lowest first; an import may point to its own layer or below.
LAYERS: dict[str, float] = {
    "errors": 0,
    "validate": 0,
    "progress": 1,
    "settings": 1,
    "files": 1,
    "labels": 1,
    "intervals": 1,
    "html_page": 1,
    "datasets": 2,
    "results": 3,
    "sweep_store": 3,
    "distributed": 3,
    # countlens.model: what a VLM is; its data-only parts sit below the rest (data generation reads the grid).
    "model.geometry": 1,
    "model.cells": 1,
    "model.shipped": 1,
    "model.families": 2,
    "model.arch": 2,
    "model": 3,
    "toy": 5,  # on the engine: its planting and checks resample through circuits.engine
    "circuits": 4.9,  # the package's public face (its __init__), on top of its rooms below
    # circuits/ by idea, lowest first: the vocabulary, the engine that opens it, the lenses, the graph, the
    # objects, the methods with their registry on top.
    "circuits.sites": 4.0,
    "circuits.engine": 4.1,
    "circuits.lenses": 4.2,
    "circuits.graph": 4.3,
    "circuits.objects": 4.4,
    "circuits.methods": 4.5,
    "analysis": 5,
    "features": 5,
    "training": 6,
    "pipeline": 7,
    "cli": 8,
    "": 9,
    # countlens.reference is cut by paper, not by layer: each reproduction sits at the layer of what it
    # reproduces (a parser reads text, the attention diagnostics read a VLM).
    "reference": 0,
    "reference.counting_to_four": 0,
    "reference.counting_to_four.parse": 1,
    "reference.counting_to_four.attention": 4,
    "reference.counting_to_four.probe": 4,
}
#: Parts that may import only these (besides themselves): data generation needs no model.
# files: its directory lock (an export holds it while writing), which imports only errors.
DATA: set[str] = {"datasets", "model.geometry", "errors", "validate", "progress", "files"}
ONLY: dict[str, set[str]] = {"datasets": DATA}


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
    """The entry of `LAYERS` a module belongs to: the longest of its dotted prefixes (below
    ``countlens``) that has one, else its top-level part."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return parts[0] if parts else ""


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


#: The most lines a package module may have: past it a module holds more than one idea (split it by idea).
MAX_LINES = 500


def test_no_package_module_is_over_500_lines():
    long = {
        path.relative_to(PACKAGE.parent).as_posix(): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"package modules over {MAX_LINES} lines (split each by idea): {long}"


def test_the_shared_import_layers_tool_finds_no_cycle():
    tool = PACKAGE.parents[1] / "shared" / "tools" / "import_layers.py"
    if not tool.exists():
        pytest.skip(f"{tool} is not on this machine (the in-repo checks above cover the same rule)")
    run = subprocess.run([sys.executable, str(tool), "countlens"], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


#: (file, family) → why that family's name still appears in that file's code. An entry no longer
#: needed fails the test, so the list is the debt as it stands.
FAMILY_NAMES_ELSEWHERE: dict[tuple[str, str], str] = {
    ("countlens/training/finetune.py", "qwen"): (
        "an example model type in an error message; moves when countlens/training/finetune.py is reworked"
    ),
    ("countlens/training/finetune.py", "internvl"): (
        "an example model type in an error message; moves when countlens/training/finetune.py is reworked"
    ),
    ("countlens/training/finetune.py", "ovis2"): (
        "an example model type in an error message; moves when countlens/training/finetune.py is reworked"
    ),
    ("countlens/toy/recipe.py", "qwen"): (
        "the shipped organism is a Qwen2-VL by design: its recipe builds that architecture's config, "
        "processor and model from transformers' classes (a user of the family, not knowledge of it)"
    ),
    ("countlens/toy/plant.py", "qwen"): (
        "the planted organisms are the Qwen2-VL organism trained further: it loads and saves that HF class "
        "(a user of the family, like countlens/toy/recipe.py)"
    ),
    ("countlens/toy/regions.py", "qwen"): (
        "the top-half organism is the Qwen2-VL organism trained further: it loads and saves that HF class "
        "(a user of the family, like countlens/toy/plant.py)"
    ),
    ("countlens/circuits/methods/atp_star.py", "qwen"): (
        "the model types AtP*'s attention recomputation was verified on (it also checks itself against the "
        "model's own z on every run); moves into ArchSpec as data when a second family is verified"
    ),
    ("countlens/circuits/methods/relp.py", "qwen"): (
        "the model types RelP's LRP rules were written and checked for (RMSNorm, gated MLP; every run also "
        "checks that the rewritten forward reproduces the model's logits); data in ArchSpec with a second family"
    ),
    ("countlens/pipeline/presets.py", "ovis2"): (
        "citations of the MAS paper's code (file paths in its repositories, MAS_w_Ovis/ovis/..., run_ovis.py), "
        "quoted as published"
    ),
}


def code_tokens(path: Path):
    """The tokens of a module's code: its comments and docstrings (any string statement) left out."""
    source = path.read_text(encoding="utf-8")
    docs = {
        (node.lineno, node.col_offset)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.start in docs):
            continue
        yield token


def family_names_outside() -> dict[tuple[str, str], list[str]]:
    """(file, family) → "line: token" for every token of package code outside the family's own module
    and the registry that contains one of the family's names (case-insensitive)."""
    from countlens.model.families import FAMILIES

    # Each file tokenised once, not once per family (the families × files tokenisations took seconds).
    tokens = {path: [(t, t.string.lower()) for t in code_tokens(path)] for path in sorted(PACKAGE.rglob("*.py"))}
    found: dict[tuple[str, str], list[str]] = {}
    for family in FAMILIES:
        words = {w.lower() for w in (*family.model_types, *family.names, *family.remote_code)}
        own = {PACKAGE / "model" / "families" / f"{family.name}.py", PACKAGE / "model" / "families" / "__init__.py"}
        own |= {
            PACKAGE / "toy" / "tiny_models" / f"{family.name}.py",
            PACKAGE / "toy" / "tiny_models" / "__init__.py",
        }
        for path, path_tokens in tokens.items():
            if path in own:
                continue
            for token, text in path_tokens:
                if any(w in text for w in words):
                    key = (path.relative_to(PACKAGE.parent).as_posix(), family.name)
                    found.setdefault(key, []).append(f"{token.start[0]}: {token.string[:80]}")
    return found


def test_every_family_has_its_module():
    from countlens.model.families import FAMILIES

    missing = [f.name for f in FAMILIES if not (PACKAGE / "model" / "families" / f"{f.name}.py").exists()]
    assert not missing, f"families without a module countlens/model/families/<name>.py: {missing}"


def test_a_family_is_named_only_in_its_own_module():
    found = family_names_outside()
    new = {k: v for k, v in found.items() if k not in FAMILY_NAMES_ELSEWHERE}
    assert not new, "family names outside their module (move the knowledge there, or list it with a reason):\n" + (
        "\n".join(f"{path} names {family}: {hits}" for (path, family), hits in sorted(new.items()))
    )
    stale = sorted(set(FAMILY_NAMES_ELSEWHERE) - set(found))
    assert not stale, f"FAMILY_NAMES_ELSEWHERE lists what no longer names its family; drop it: {stale}"


def test_only_the_registry_imports_a_family_module():
    from countlens.model.families import FAMILIES

    family_modules = {f"countlens.model.families.{f.name}" for f in FAMILIES}
    wrong = [
        f"{a} imports {b}"
        for a, targets in graph().items()
        for b, _ in targets
        if b in family_modules and a != "countlens.model.families"
    ]
    assert not wrong, "only countlens/model/families/__init__.py may import a family module:\n" + "\n".join(wrong)
