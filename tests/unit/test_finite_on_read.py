"""Finite on read: every number countlens reads from a file is checked at the door, naming the file and
the tensor or variable, and so is every stored result's shape where it is read.

- A transcoder set's tensors (`load_transcoders`): no NaN, no ±inf.
- A result (`countlens.results.load`): no ±inf anywhere (an inf ranks first whatever it means); NaN stays
  legal, since it marks "no value there" (a layer's absent head).
- A discover run's stored results, read for its report (`countlens.pipeline.rundir`): the faithfulness
  curves are measured at every size, so NaN there is refused, and their sizes increase; the spec holds
  what the report reads (its prompt). `compare` refuses a run whose result lacks a variable its tables
  read, or holds NaN where one is measured.
- An attribution graph of a replacement model that computes NaN says so, not "a cycle".
- Faithfulness sizes are checked once, as an ordered list: a set (no order) is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr
from test_transcoders import random_set, write_set
from typer.testing import CliRunner

from countlens import results
from countlens.errors import InputError, RunDirError
from countlens.features import attribution_graph, load_transcoders
from countlens.features.influence import influence, normalized
from countlens.pipeline import rundir
from countlens.pipeline.stages import STAGES

runner = CliRunner()


# ----------------------------------------------------------------------------- transcoder files


@pytest.mark.parametrize("key, bad", [("W_dec", float("nan")), ("b_enc", float("inf"))])
def test_a_transcoder_file_with_a_non_finite_tensor_is_refused_naming_file_and_tensor(tmp_path, key, bad):
    write_set(tmp_path / "set", n=2)
    layer = tmp_path / "set" / "layer_1.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(layer))
    tensors[key].view(-1)[3] = bad
    save_file(tensors, str(layer))
    with pytest.raises(InputError, match=rf"layer_1\.safetensors: tensor {key} holds 1 (NaN|±inf)"):
        load_transcoders(tmp_path / "set")


def test_a_replacement_that_computes_nan_is_not_called_a_cycle(loaded):
    """The graph of a set with NaN weights (held in memory: a file with them no longer loads)."""
    vlm = loaded("toy")
    tcs = random_set(width=16, k=2)
    with torch.no_grad():
        tcs.layer(2).W_enc[0] = float("nan")
    from countlens.datasets import task_samples

    with pytest.raises(InputError, match="NaN or ±inf") as info:
        attribution_graph(vlm, tcs, task_samples("count", 1, seed=0)[0], max_features=4)
    assert "cycle" not in str(info.value)
    adjacency = torch.zeros(3, 3)
    adjacency[2, 0], adjacency[1, 0] = float("nan"), 1.0
    with pytest.raises(InputError, match=r"adjacency holds \d+ NaN or ±inf") as info:
        influence(normalized(adjacency), torch.tensor([0.0, 0.0, 1.0]))
    assert "cycle" not in str(info.value)


# ----------------------------------------------------------------------------- result files


def test_a_result_file_with_inf_is_refused_and_nan_stays_legal(tmp_path):
    ranking = xr.DataArray([[0.5, np.nan], [0.25, 0.1]], dims=("layer", "head"), name="effect")
    results.save(ranking, tmp_path / "ok.nc")
    assert np.isnan(results.load(tmp_path / "ok.nc").values[0, 1])  # no head there: read as it is
    # countlens saves no ±inf (refused before anything is written), so such a file is another program's.
    infinite = ranking.where(ranking != 0.25, np.inf)
    with pytest.raises(results.ResultError, match=r"inf\.nc: the result holds 1 ±inf.*replace ±inf by NaN"):
        results.save(infinite, tmp_path / "inf.nc")
    with pytest.raises(results.ResultError, match=r"b\.nc: variable 'cpr' holds 1 ±inf"):
        results.save_all({"a": ranking, "b": xr.Dataset({"cpr": ("r", [0.5, -np.inf])})}, tmp_path / "all")
    assert not (tmp_path / "inf.nc").exists() and not (tmp_path / "all").exists()
    results.save(ranking, tmp_path / "edited.nc")
    edited = xr.load_dataset(tmp_path / "edited.nc")
    edited[next(iter(edited.data_vars))][1, 0] = np.inf
    edited.to_netcdf(tmp_path / "inf.nc")
    with pytest.raises(results.ResultError, match=r"inf\.nc: the result holds 1 ±inf of its 4 values"):
        results.load(tmp_path / "inf.nc")
    ds = xr.Dataset({"cpr": ("ranking", [0.5, -np.inf])}, coords={"ranking": ["a", "b"]})
    ds.to_netcdf(tmp_path / "ds.nc")
    with pytest.raises(results.ResultError, match=r"ds\.nc: variable 'cpr' holds 1 ±inf"):
        results.load(tmp_path / "ds.nc")


def _faithfulness(**edit) -> xr.Dataset:
    sizes = edit.pop("size", [0.0, 0.5, 1.0])
    ds = xr.Dataset(
        {
            "faithfulness": (("ranking", "size"), [[0.0, 0.7, 1.0], [0.0, 0.4, 1.0]]),
            "kept_fraction": ("size", [0.0, 0.5, 1.0]),
            "cpr": ("ranking", [0.6, 0.45]),
            "cmd": ("ranking", [0.4, 0.55]),
        },
        coords={"ranking": ["exact patching", "AtP"], "size": sizes},
        attrs={"n_nodes": 24},
    )
    for var, value in edit.items():
        ds[var].values[...] = value
    return ds


def _fake_run(tmp_path, **spec) -> tuple:
    """A finished run as the report reads it: spec.json and a result of every required stage, each
    holding the variables its stage declares (dims of size 1 or 3)."""
    out = tmp_path / "run"
    (out / "results").mkdir(parents=True)
    full = {"model": "toy", "arch": "qwen2_vl", "prompt": "short", "top_k": 5, "jaccard_k": 5}
    (out / "spec.json").write_text(json.dumps({k: v for k, v in {**full, **spec}.items() if v is not None}))
    for stage in STAGES:
        if stage.optional:
            continue
        ds = (
            _faithfulness()
            if "faithfulness" in stage.name
            else xr.Dataset({v: (dims, np.zeros((1,) * len(dims))) for v, dims in stage.variables.items()})
        )
        results.save(ds, out / "results" / f"{stage.name}.nc")
    return out, out / "results" / "faithfulness.nc"


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"cpr": np.nan}, r"'cpr' holds 2 NaN of its 2 values"),
        ({"faithfulness": np.nan}, r"'faithfulness' holds 6 NaN"),
        ({"size": [0.0, 1.0, 0.5]}, r"size coordinate \[.*\] does not increase strictly"),
    ],
    ids=["nan-cpr", "nan-curve", "unsorted-sizes"],
)
def test_a_report_refuses_a_stored_faithfulness_with_nan_or_unsorted_sizes(tmp_path, edit, message):
    """The report's door (`rundir.stored`): a NaN figure or a curve out of order is a broken file."""
    out, path = _fake_run(tmp_path)
    results.save(_faithfulness(**edit), path)
    with pytest.raises(RunDirError, match=message) as info:
        rundir.load_run(out)
    assert "faithfulness.nc" in str(info.value) and "rerun `countlens discover" in str(info.value)


def test_a_run_whose_spec_has_no_prompt_is_refused_before_the_report(tmp_path):
    from countlens.cli import app

    out, _ = _fake_run(tmp_path, prompt=None)
    with pytest.raises(RunDirError, match=r"spec\.json lacks \['prompt'\], which the report reads"):
        rundir.load_run(out)
    result = runner.invoke(app, ["classify", "--run", str(out)])
    assert result.exit_code == 2 and "lacks ['prompt']" in result.output, result.output
    assert not (out / "heads.csv").exists()  # refused before classify writes its table
    out, _ = _fake_run(tmp_path / "b", top_k="5")
    with pytest.raises(RunDirError, match="top_k must be an integer"):
        rundir.load_run(out)


def test_compare_refuses_a_run_with_a_renamed_or_nan_variable_naming_the_file(tmp_path):
    from test_compare import make_run

    from countlens.analysis import compare_runs
    from countlens.cli import app

    for stage, old, new in (("vap", "effect", "eff"), ("probes", "ap50", "ap"), ("faithfulness", "cpr", "CPR")):
        run = make_run(tmp_path / stage, "a", "m", 4)
        path = run / "results" / f"{stage}.nc"
        results.save(results.load(path).rename({old: new}), path)
        with pytest.raises(RunDirError, match=rf"{stage}\.nc: '{old}' is missing.*delete"):
            compare_runs([run], tmp_path / stage / "out")
        assert not (tmp_path / stage / "out").exists()
    result = runner.invoke(app, ["compare", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "'cpr' is missing" in result.output, result.output
    run = make_run(tmp_path / "nan", "a", "m", 4)
    path = run / "results" / "faithfulness.nc"
    ds = results.load(path)
    ds["cmd"].values[1] = np.nan
    results.save(ds, path)
    with pytest.raises(RunDirError, match=r"faithfulness\.nc: 'cmd' holds 1 NaN"):
        compare_runs([run], tmp_path / "nan" / "out")


# ----------------------------------------------------------------------------- faithfulness sizes


def test_faithfulness_sizes_are_an_ordered_list_checked_once(loaded):
    from countlens.circuits import faithfulness_curves
    from countlens.datasets import count_pairs

    vlm = loaded("toy")
    pairs = count_pairs(2, 3, 5, kind="shapes", grid=vlm.geometry, prompt="short", seed=2)
    scores = {f"L{la}H{h}": float(la + h) for la in range(vlm.arch.n_layers) for h in range(vlm.arch.n_heads)}
    with pytest.raises(InputError, match="sizes is a set, which has no order"):
        faithfulness_curves(vlm, pairs, {"s": scores}, sizes={0.0, 1.0}, random_draws=0)
    ds = faithfulness_curves(vlm, pairs, {"s": scores}, sizes=(s for s in (0.0, 1.0)), random_draws=0)
    assert list(ds["size"].values) == [0.0, 1.0]
