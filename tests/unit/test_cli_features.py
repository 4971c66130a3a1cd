"""``countlens features graph``: every refusal exits 2 with its message before the model loads and
writes nothing; one run on the organism with tiny transcoders trained here writes the viewer JSON,
the Dataset, the page and the cards of the top features, and prints them."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xarray as xr
from typer.testing import CliRunner

from countlens.cli import app
from countlens.features import train_transcoders

runner = CliRunner()


@pytest.fixture(scope="module")
def transcoders(loaded, tmp_path_factory):
    """Tiny transcoders of the organism (every layer), saved as circuit-tracer's folder."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tcs")
    train_transcoders(loaded("toy"), width=32, k=4, steps=8, mix={"count": 16}, out=out, progress=False)
    yield out / "transcoders"
    torch.set_num_threads(before)


def test_the_graph_commands_refusals_exit_2_before_any_load_and_write_nothing(transcoders, tmp_path, monkeypatch):
    import countlens

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(countlens, "load", no_load)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    tcs = ["--transcoders", str(transcoders)]
    cases = [
        (["--transcoders", str(tmp_path / "missing"), "--out", str(out)], "is not a folder"),
        (["--transcoders", str(transcoders.parent), "--out", str(out)], "give the set inside it"),
        (["--transcoders", str(empty), "--out", str(out)], "has no config.yaml"),
        ([*tcs, "--out", str(out), "--node-threshold", "0"], "--node-threshold must be in (0, 1]"),
        ([*tcs, "--out", str(out), "--node-threshold", "1.5"], "--node-threshold must be in (0, 1]"),
        ([*tcs, "--out", str(out), "--edge-threshold", "-0.1"], "--edge-threshold must be in (0, 1]"),
        ([*tcs, "--out", str(out), "--count", "13"], "give 0 … 12"),
        ([*tcs, "--out", str(out), "--count", "-1"], "give 0 … 12"),
        ([*tcs, "--out", str(out), "--seed", "-2"], "--seed must be ≥ 0"),
        ([*tcs, "--out", str(out), "--card-scenes", "0"], "--card-scenes must be ≥ 1"),
        ([*tcs, "--out", str(out), "--top", "0"], "--top must be ≥ 1"),
        ([*tcs, "--out", str(a_file)], "is a file"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["features", "graph", *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]
    assert not list(empty.iterdir()) and a_file.read_text() == "x"


def test_a_set_that_does_not_fit_the_model_is_refused_and_nothing_is_written(loaded, tmp_path):
    """A set of layers 0 and 1 for a six-layer model: refused once the model is loaded, before any file."""
    from countlens.features import save_transcoders

    run = train_transcoders(loaded("toy"), layers=[0, 1], width=16, k=2, steps=2, mix={"count": 4}, progress=False)
    save_transcoders(run.transcoders, tmp_path / "two")
    out = tmp_path / "out"
    result = runner.invoke(app, ["features", "graph", "--transcoders", str(tmp_path / "two"), "--out", str(out)])
    assert result.exit_code == 2 and "needs a transcoder for every layer" in result.output, result.output
    assert not out.exists()


def test_the_graph_command_writes_the_graph_the_page_and_the_cards(transcoders, tmp_path):
    out = tmp_path / "graph"
    args = ["features", "graph", "--transcoders", str(transcoders), "--out", str(out), "--count", "3"]
    args += ["--node-threshold", "0.9", "--card-scenes", "16", "--top", "3"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cards = sorted(p.name for p in out.glob("card_*.png"))
    assert len(cards) == 3
    want = ["graph.json", "graph.nc", "graph.html", "cards.nc", "effects.nc", *cards]
    assert sorted(p.name for p in out.iterdir()) == sorted(want)
    assert "(answer 3)" in result.output
    effects = xr.load_dataset(out / "effects.nc")  # the top features' removal, graph against real model
    assert effects.sizes["node"] == 3 and set(effects) >= {"removal_graph", "removal_real", "steer_real"}
    assert re.search(r"graph vs real model over these features: removal Spearman (-?\d|nan)", result.output)
    scores = r"graph scores \(circuit-tracer's\): replacement [01]\.\d{3}, completeness [01]\.\d{3}; pruned graph"
    assert re.search(scores, result.output), result.output
    for name in cards:  # each card is printed among the top features
        assert f"  {name.removeprefix('card_').removesuffix('.png')}  position" in result.output

    data = json.loads((out / "graph.json").read_text())
    assert data["metadata"]["node_threshold"] == 0.9
    assert data["metadata"]["prompt"].startswith("how many")
    ds = xr.load_dataset(out / "graph.nc")
    assert 0 < ds.attrs["replacement_score"] <= 1 and 0 < ds.attrs["completeness_score"] <= 1
    assert ds.sizes["node"] == len(data["nodes"])
    assert int((ds.adjacency != 0).sum()) == len(data["links"])
    assert list(ds.node_id.values) == [n["node_id"] for n in data["nodes"]]
    page = (out / "graph.html").read_text()
    assert all(f'"{n["node_id"]}"' in page for n in data["nodes"])
    assert f"replacement {ds.attrs['replacement_score']:.4g}, completeness" in page  # the pruned graph's
    assert "<script src" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    card_ds = xr.load_dataset(out / "cards.nc")
    assert sorted(f"card_{c}.png" for c in card_ds.card.values) == cards
    kept = {
        f"L{n['layer']}F{n['node_id'].split('_')[1]}" for n in data["nodes"] if n["feature_type"].startswith("cross")
    }
    shown = set(card_ds.card.values) & kept  # the top features the pruned graph kept carry their card on the page
    assert all(f'"card": "{c}"' in page for c in shown)
