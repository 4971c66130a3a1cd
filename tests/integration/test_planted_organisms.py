"""The shipped planted organisms: each loads by name, is no larger than the organism, passes its checks
again on 1,024 fresh samples (`countlens.toy.strictness`; the top-half organism's `countlens.toy.regions`),
and `discover` runs on one end to end."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import countlens
from countlens.cli import app
from countlens.model.shipped import ORGANISMS, SHIPPED_EDGES, SHIPPED_OBJECTS, SHIPPED_PLANTED, TOY_DIR
from countlens.toy.planted import CIRCUITS
from countlens.toy.strictness import FRESH_CHECKS, fresh_checks, fresh_strictness

PLANTED = [f"planted-{name}" for name in SHIPPED_PLANTED]
#: Fresh checks a shipped organism is known to fail (docs/organism/planted.md gives the figures): asserted to
#: fail still, so that a re-planted organism that passes them is noticed and this list emptied.
KNOWN_UNMET: dict[str, set[str]] = {}
#: The same for the edge organisms' edge-level checks (their node-level checks all pass).
KNOWN_UNMET_EDGES: dict[str, set[str]] = {}


def _size(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".safetensors")


def _rates(figures: dict, prefix: str = "") -> dict[str, float]:
    """Every rate of a figures record, flattened (intervals left out: they follow from the rates)."""
    out = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            out |= _rates(value, f"{prefix}{key}/")
        elif isinstance(value, float) and key not in ("chance",):
            out[prefix + key] = value
    return out


@pytest.mark.slow  # about 20–30 s per organism: 1,024 fresh samples, 5–7 resampled forwards each
@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_organism_loads_by_name_and_its_circuit_is_still_planted(name):
    folder = ORGANISMS[name]
    circuit = CIRCUITS[name.removeprefix("planted-")]
    record = json.loads((folder / "planted.json").read_text())
    assert record["circuit"]["name"] == circuit.name and all(record["checks"].values())
    unmet = KNOWN_UNMET.get(name, set())
    assert {k for k, ok in record["fresh_checks"].items() if not ok} == unmet, record["fresh"]
    assert _size(folder) <= _size(TOY_DIR)
    vlm = countlens.load(name)
    assert vlm.name == name and vlm.arch.n_layers == 6
    # Re-measured on the same fresh samples the record was made on: every check holds again, and each rate
    # agrees with the record up to an answer or two flipped by another CPU's kernels.
    figures = fresh_strictness(vlm.hf.float(), circuit)
    checks = fresh_checks(figures)
    assert {k for k, ok in checks.items() if not ok} == unmet, (checks, figures, FRESH_CHECKS)
    measured, recorded = _rates(figures), _rates(record["fresh"])
    assert measured.keys() == recorded.keys()
    for key, value in recorded.items():
        assert abs(measured[key] - value) <= 2 / figures["n_samples"] + 1e-9, key


@pytest.mark.slow  # about 30 s: 1,024 fresh scenes three ways, exact object effects on 64
@pytest.mark.parametrize("name", [f"planted-{name}" for name in SHIPPED_OBJECTS])
def test_an_object_organism_still_counts_only_its_objects(name):
    from countlens.circuits.graph.recovery import object_recovery
    from countlens.circuits.objects.effects import object_effects
    from countlens.circuits.sites import Residual
    from countlens.toy.regions import region_checks, top_half_sample, verify_regions

    folder = ORGANISMS[name]
    record = json.loads((folder / "planted.json").read_text())
    assert record["circuit"]["ground_truth"] == "objects" and all(record["fresh_checks"].values())
    assert _size(folder) <= _size(TOY_DIR)
    vlm = countlens.load(name)
    figures = verify_regions(vlm.hf.float())
    scenes = [top_half_sample(record["fresh"]["seed"], i) for i in range(64)]
    figures["objects"] = object_recovery(object_effects(vlm, scenes, "removed", Residual(-1)).effect, scenes)
    assert all(region_checks(figures).values()), figures
    measured, recorded = _rates(figures), _rates(record["fresh"])
    for key in ("accuracy", "bottom_removed/accuracy", "top_one_removed_follows"):
        assert abs(measured[key] - recorded[key]) <= 2 / figures["n_samples"] + 1e-9, key
    assert abs(measured["objects/auroc"] - recorded["objects/auroc"]) <= 1e-3


@pytest.mark.slow  # about 30 s: 1,024 fresh samples, 9 edge-ablated forwards each
@pytest.mark.parametrize("name", [f"planted-{name}" for name in SHIPPED_EDGES])
def test_an_edge_organism_still_carries_the_count_only_in_its_edges(name):
    from countlens.toy.edge_plant import fresh_edge_strictness
    from countlens.toy.planted import EDGE_CIRCUITS

    folder = ORGANISMS[name]
    circuit = EDGE_CIRCUITS[name.removeprefix("planted-")]
    record = json.loads((folder / "planted.json").read_text())
    assert record["circuit"]["name"] == circuit.name and tuple(record["circuit"]["edges"]) == circuit.edges
    # Node level (C = its nodes, MLPs as nodes) passed when it was planted; edge level but the known unmet.
    unmet = KNOWN_UNMET_EDGES.get(name, set())
    assert {k for k, ok in record["fresh_checks"].items() if not ok} == unmet, record["fresh"]
    assert all(record["fresh_node_checks"].values()), record["fresh_nodes"]
    assert _size(folder) <= _size(TOY_DIR)
    vlm = countlens.load(name)
    # The edge-level figures again (the node-level ones are the head organisms' measurement, tested above).
    figures = fresh_edge_strictness(vlm.hf.float(), circuit)
    assert {k for k, ok in fresh_checks(figures).items() if not ok} == unmet, figures
    measured, recorded = _rates(figures), _rates(record["fresh"])
    assert measured.keys() == recorded.keys()
    for key, value in recorded.items():
        assert abs(measured[key] - value) <= 2 / figures["n_samples"] + 1e-9, key


@pytest.mark.slow
def test_discover_runs_on_a_planted_organism(tmp_path, undrawn_report):
    out = tmp_path / "run"
    small = ["--n-per-case", "1", "--n-pairs", "4", "--n-samples", "4", "--batch-size", "8"]
    result = CliRunner().invoke(app, ["discover", "--model", "planted-route", "--out", str(out), *small])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "spec.json").read_text())["prompt"] == "short"  # the organism's own prompt
    report = (out / "report.md").read_text()
    assert "Is it a circuit?" in report
    # The report scores each ranking against the planted circuit.
    assert "This model is a planted organism: the heads L0H2" in report and "AUROC" in report
