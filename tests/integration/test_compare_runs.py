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


def test_compare_the_organism_with_a_tiny_model_of_another_depth(toy_run, tiny_checkpoint, tmp_path):
    """The organism (6 layers) beside a tiny Qwen2-VL of 2 layers on the real Qwen vocabulary: the
    models' own runs, compared on relative depth (its protocol differs from the organism's prompt and
    sizes, so --allow-mixed, and compare.md says what differs)."""
    import countlens
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.discover import discover

    runs = []
    for layers in (2,):
        vlm = countlens.load(tiny_checkpoint("qwen2_vl", image_side=128, layers=layers))
        runs.append(tmp_path / f"qwen-{layers}")
        config = DiscoverConfig(n_per_case=1, n_pairs=4, n_samples=4, batch_size=8)
        discover(vlm, runs[-1], config, log=lambda _: None)
    out = tmp_path / "cmp"
    refused = runner.invoke(app, ["compare", str(toy_run), *map(str, runs), "--out", str(out)])
    assert refused.exit_code == 2 and "differ in protocol" in refused.output and not out.exists()
    result = runner.invoke(app, ["compare", str(toy_run), *map(str, runs), "--out", str(out), "--allow-mixed"])
    assert result.exit_code == 0, result.output
    md = (out / "compare.md").read_text()
    assert "**The runs differ in protocol**" in md and "- prompt: toy = 'short'" in md
    hand = pd.read_csv(out / "handoff.csv", index_col=0)
    labels = list(hand.index)
    assert hand["layers"].tolist() == [6, 2]
    curves = pd.read_csv(out / "vap_curves.csv")
    classes = pd.read_csv(out / "head_classes.csv")
    for run, label in zip([toy_run, *runs], labels):
        vap = results.load(run / "results" / "vap.nc")
        mine = curves[curves.model == label].set_index("layer")
        assert mine["last"].to_numpy() == pytest.approx(vap.effect.sel(group="last").values)
        n_layers = int(vap.layer.max()) + 1
        assert mine.loc[n_layers - 1, "depth"] == pytest.approx(1.0) and mine.loc[0, "depth"] == 0
        heads = pd.read_csv(run / "heads.csv")
        assert classes[classes.model == label].drop(columns=["model", "depth"]).to_numpy().sum() == len(heads)
    page = (out / "compare.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 and "Not embedded" not in page
