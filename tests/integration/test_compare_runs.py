"""`countlens compare` end to end through the command line: a real organism run, and a "model" with
fewer layers derived from it by cutting every layer-indexed result (the cases left as they are)."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from typer.testing import CliRunner

from countlens import results
from countlens.cli import app

pytestmark = pytest.mark.slow  # reads the shared discover run of the organism
runner = CliRunner()


def _shallower(run, out, keep: int):
    """A copy of ``run`` whose model keeps its first ``keep`` layers: every layer-indexed result cut."""
    shutil.copytree(run, out)
    for path in (out / "results").glob("*.nc"):
        ds = results.load(path)
        if "layer" in ds.dims:
            results.save(ds.sel(layer=ds.layer < keep), path)
    heads = pd.read_csv(out / "heads.csv")
    heads[heads.layer < keep].to_csv(out / "heads.csv", index=False)
    spec = json.loads((out / "spec.json").read_text())
    (out / "spec.json").write_text(json.dumps({**spec, "model": "toy-shallow"}))
    return out


def test_compare_an_organism_run_with_a_shallower_one(toy_run, tmp_path):
    run = toy_run  # the shared organism run (conftest.py)
    shallow = _shallower(run, tmp_path / "shallow", keep=4)
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(run), str(shallow), "--out", str(out)])
    assert result.exit_code == 0, result.output
    hand = pd.read_csv(out / "handoff.csv", index_col=0)
    assert hand["layers"].tolist() == [6, 4]
    vap = results.load(run / "results" / "vap.nc")
    curves = pd.read_csv(out / "vap_curves.csv")
    toy = curves[curves.model == "toy"].set_index("layer")
    assert toy["image"].to_numpy() == pytest.approx(vap.effect.sel(group="image").values)
    assert toy.loc[3, "depth"] == pytest.approx(0.6)
    assert curves[curves.model == "toy-shallow"].set_index("layer").loc[3, "depth"] == pytest.approx(1.0)
    acc = pd.read_csv(out / "accuracy.csv", index_col=0)
    cases = results.load(run / "results" / "cases.nc")
    assert acc.loc["toy", "mean (all)"] == pytest.approx(
        pd.Series(cases.correct.values.astype(float)).groupby(cases.case.values).mean().mean()
    )
    assert acc.loc["toy"].equals(acc.loc["toy-shallow"].rename("toy"))  # the cases were not cut
