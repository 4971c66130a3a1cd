"""The shipped planted organisms: each loads by name, is no larger than the organism, passes its planted
checks again on the held-out pairs, and `discover` runs on one end to end."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import countlens
from countlens.cli import app
from countlens.organisms import ORGANISMS, TOY_DIR
from countlens.toy.plant import PLANTED_CHECKS, planted_checks, verify
from countlens.toy.planted import CIRCUITS

PLANTED = [name for name in ORGANISMS if name.startswith("planted-")]


def _size(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".safetensors")


@pytest.mark.slow  # about 30 s per organism: 256 held-out samples, 6–9 resampled forwards each
@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_organism_loads_by_name_and_its_circuit_is_still_planted(name):
    folder = ORGANISMS[name]
    circuit = CIRCUITS[name.removeprefix("planted-")]
    record = json.loads((folder / "planted.json").read_text())
    assert record["circuit"]["name"] == circuit.name and all(record["checks"].values())
    assert _size(folder) <= _size(TOY_DIR)
    vlm = countlens.load(name)
    assert vlm.name == name and vlm.arch.n_layers == 6
    # Re-measured on the same held-out pairs the record was made on: the checks hold again, and the
    # figures agree with the record up to an answer or two flipped by another CPU's kernels.
    figures = verify(vlm.hf.float(), circuit)
    checks = planted_checks(circuit, figures)
    assert all(checks.values()), (checks, figures, PLANTED_CHECKS)
    for key, value in record["figures"].items():
        assert abs(figures[key] - value) <= 2 / figures["n_samples"] + 1e-9, key


@pytest.mark.slow
def test_discover_runs_on_a_planted_organism(tmp_path):
    out = tmp_path / "run"
    small = ["--n-per-case", "1", "--n-pairs", "4", "--n-samples", "4", "--batch-size", "8"]
    result = CliRunner().invoke(app, ["discover", "--model", "planted-route", "--out", str(out), *small])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "spec.json").read_text())["prompt"] == "short"  # the organism's own prompt
    report = (out / "report.md").read_text()
    assert "Is it a circuit?" in report
    # The report scores each ranking against the planted circuit.
    assert "This model is a planted organism: the heads L0H2" in report and "AUROC" in report
