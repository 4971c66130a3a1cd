"""The method registry (`countlens.circuits.methods.registry`) is the single source of method facts: the only
module-level ``METHODS``, one name per method (listed by ``countlens methods``, taken by ``countlens
discover --methods``), each default written once, and imports that point down to the methods."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from typer.testing import CliRunner

import countlens
from countlens.cli import app

runner = CliRunner()
PACKAGE = Path(countlens.__file__).parent


def _module_names(path: Path) -> set[str]:
    """The names a module assigns at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_registry_is_the_only_module_named_methods_and_each_default_is_written_once():
    written = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _module_names(path) & {"METHODS", "IG_STEPS", "EAP_IG_STEPS", "EDGE_STEPS", "RANDOM_DRAWS"}:
            written.setdefault(name, []).append(path.relative_to(PACKAGE).as_posix())
    assert written == {
        "METHODS": ["circuits/methods/registry.py"],
        "IG_STEPS": ["circuits/graph/integrated.py"],
        "RANDOM_DRAWS": ["circuits/graph/faithfulness.py"],
    }
    # (by module path: the package exports functions of the same names)
    edge_attribution, faithfulness, integrated, methods = (
        importlib.import_module(f"countlens.circuits.{m}")
        for m in ("graph.edge_attribution", "graph.faithfulness", "graph.integrated", "methods.registry")
    )

    assert methods.IG_STEPS is integrated.IG_STEPS and methods.RANDOM_DRAWS is faithfulness.RANDOM_DRAWS
    for fn in (integrated.node_attribution, edge_attribution.edge_attribution, edge_attribution.edge_attributions):
        assert inspect.signature(fn).parameters["steps"].default == integrated.IG_STEPS, fn.__name__
    assert (
        inspect.signature(faithfulness.faithfulness_curves).parameters["random_draws"].default == methods.RANDOM_DRAWS
    )
    assert methods.method("eap_ig").cost.grad(6) == methods.method("eap_ig_edges").cost.grad(6) == methods.IG_STEPS


def test_each_method_has_one_name_and_its_facts_agree_with_the_modules_below():
    from countlens.circuits.graph.edge_attribution import EDGE_VARIANTS
    from countlens.circuits.methods.patching import ATP_VARIANTS
    from countlens.circuits.methods.registry import METHODS, OBJECT_RANKERS
    from countlens.circuits.objects.gradients import OBJECT_VARIANTS
    from countlens.pipeline.stages import STAGES

    names = [m.name for m in METHODS] + [r.name for r in OBJECT_RANKERS]
    assert len(set(names)) == len(names) and all(n.isidentifier() for n in names)
    assert {m.stage for m in METHODS if m.stage} <= {s.name for s in STAGES}
    assert {m.variant for m in METHODS if m.variant} <= set(ATP_VARIANTS + EDGE_VARIANTS)
    for r in OBJECT_RANKERS:
        assert r.variant in (OBJECT_VARIANTS if r.function == "object_attribution" else EDGE_VARIANTS), r.name
    # The object modules sit below the registry: they never import it.
    for module in ("gradients", "edges"):
        tree = ast.parse((PACKAGE / "circuits" / "objects" / f"{module}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "countlens.circuits.methods.registry" not in imported, module


def test_countlens_methods_lists_every_registered_name():
    from countlens.circuits.methods.registry import METHODS, OBJECT_RANKERS

    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0, result.output
    rows = {line.split("|")[1].strip(): line for line in result.output.splitlines()[2:]}
    assert list(rows) == [m.name for m in METHODS] + [r.name for r in OBJECT_RANKERS]
    assert "| AtP*" in rows["atp_star"] and "1 + (L + 1)" in rows["atp_star"]
    assert "1 + 29" in runner.invoke(app, ["methods", "--layers", "28"]).output
    refused = runner.invoke(app, ["methods", "--layers", "0"])
    assert refused.exit_code == 2 and "--layers must be ≥ 1" in refused.output


@pytest.mark.parametrize("given", ["exact,bogus", "exact,relp", "atp,atp"])
def test_discover_refuses_a_method_it_does_not_rank_with_before_anything_runs(given, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --methods was checked")

    monkeypatch.setattr(countlens, "load", no_model)
    out = tmp_path / "run"
    result = runner.invoke(app, ["discover", "--out", str(out), "--methods", given])
    assert result.exit_code == 2 and "exact, atp, eap_ig, ablation, atp_star" in result.output, result.output
    assert not out.exists()


def test_a_run_names_the_methods_its_faithfulness_stage_ranks_with():
    from countlens.circuits.methods.registry import discover_methods
    from countlens.errors import ConfigError
    from countlens.pipeline.config import DiscoverConfig

    chosen = DiscoverConfig(methods=("atp_star", "exact")).methods
    assert [m.name for m in discover_methods(names=chosen)] == ["exact", "atp_star"]  # the registry's order
    assert len(discover_methods(names=())) == 5
    with pytest.raises(ConfigError, match="give a tuple"):
        DiscoverConfig(methods="exact")


def test_the_faithfulness_stage_ranks_with_the_methods_a_run_names(loaded):
    """Only AtP* named: the stage computes it (no earlier stage does) and ranks with it beside the
    random draws, reading no other stage's result."""
    from types import SimpleNamespace

    from countlens.circuits.methods.registry import RANDOM_DRAWS
    from countlens.datasets.pairs import count_pairs
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.stages.faithfulness import _faithfulness

    vlm = loaded("toy")
    pairs = count_pairs(4, 3, 5, kind="shapes", grid=vlm.geometry, prompt="short", seed=21)
    run = SimpleNamespace(vlm=vlm, pairs=pairs, batch_size=4, results={}, config=DiscoverConfig(methods=("atp_star",)))
    ds = _faithfulness(run)
    assert list(ds.ranking.values) == ["AtP*", *(f"random{d}" for d in range(RANDOM_DRAWS)), "random"]
    assert "atp_star_effect" in ds
