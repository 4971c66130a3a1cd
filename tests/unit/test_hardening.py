"""Degenerate pairs, zero denominators, output ownership and ambiguous names: each refused by name
before any forward or any write."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

import countlens as cl
from countlens import circuits
from countlens.circuits.engine.pair_batch import normaliser
from countlens.circuits.methods.registry import METHODS
from countlens.datasets.pairs import CountPair, count_pairs
from countlens.errors import CheckpointNotFoundError, InputError, RunDirError
from countlens.files import claim_directory, directory_lock


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def same_image(organism):
    """Pairs whose corrupt side shows the clean image (answers still differ)."""
    pairs = count_pairs(2, 3, 5, kind="shapes", grid=organism.geometry, prompt="short", seed=3)
    return [CountPair(p.clean, replace(p.corrupt, scene=p.clean.scene), p.kind, p.index) for p in pairs]


def _refused_before_any_forward(vlm, call):
    calls = []
    handle = vlm.hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(InputError, match="the same picture"):
            call()
    finally:
        handle.remove()
    assert not calls


def test_pairs_without_a_difference_are_refused_by_every_method(organism, same_image):
    calls = {
        "patch_layers": lambda: circuits.patch_layers(organism, same_image),
        "effect": lambda: circuits.effect(organism, same_image, circuits.Patch(circuits.Residual(1))),
        "faithfulness": lambda: circuits.faithfulness_curves(organism, same_image, {}, random_draws=1),
        **{m.name: (lambda m=m: m.result(organism, same_image, 2)) for m in METHODS if m.name != "ablation"},
    }
    for call in calls.values():
        _refused_before_any_forward(organism, call)


@pytest.mark.parametrize("clean, corrupt", [(1.5, 1.5), (0.0, float("nan")), (0.0, float("inf"))])
def test_a_zero_or_broken_denominator_is_an_error_not_nan(clean, corrupt):
    with pytest.raises(InputError, match="no effect can be normalised"):
        normaliser(clean, corrupt)
    assert normaliser(1.0, 3.0) == 2.0


def test_plant_writes_only_into_its_own_output(tmp_path):
    from countlens.toy.plant import plant
    from countlens.toy.planted import CIRCUITS

    checkpoint = tmp_path / "other-model"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(RunDirError, match="not empty .*model.safetensors.index.json"):
        plant(checkpoint, CIRCUITS["route"])
    assert sorted(p.name for p in checkpoint.iterdir()) == ["model.safetensors.index.json"]
    claim_directory(tmp_path / "run", "countlens toy plant", {"circuit": "two-hop"})
    with pytest.raises(RunDirError, match="other settings"):
        plant(tmp_path / "run", CIRCUITS["route"])
    claim_directory(tmp_path / "run", "countlens toy plant", {"circuit": "two-hop"})  # its own: accepted again


def test_a_second_writer_of_one_folder_is_refused(tmp_path, organism):
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.discover import LOCK, discover

    with directory_lock(tmp_path, LOCK, "discover", "give another --out"):
        with pytest.raises(InputError, match=f"being written by another discover \\(process {os.getpid()}"):
            discover(organism, tmp_path, DiscoverConfig(n_pairs=2, n_per_case=1, n_samples=2), log=lambda _: None)
    assert not (tmp_path / LOCK).exists() and not (tmp_path / "spec.json").exists()


def test_an_organism_name_that_is_also_a_folder_is_ambiguous(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="names both a shipped organism and a local folder"):
        cl.load("toy")
    with pytest.raises(CheckpointNotFoundError, match="planted-route, planted-two-hop, planted-spread"):
        cl.load("no-such-model")


def test_a_damaged_or_foreign_stored_result_names_the_file_and_the_fix(tmp_path):
    import numpy as np
    import xarray as xr

    from countlens import results
    from countlens.pipeline.rundir import Stages

    stages = Stages(tmp_path, {"model": "toy", "arch": "qwen2_vl"}, log=lambda _: None)
    never = lambda: pytest.fail("a stored result is read, not recomputed")  # noqa: E731
    renamed = xr.Dataset({"effects": (("layer", "head"), np.zeros((2, 2)))})
    results.save(renamed, tmp_path / "results" / "heads.nc")
    with pytest.raises(RunDirError, match="heads.nc: 'effect' is missing.*delete .*heads.nc and rerun"):
        stages.run("heads", never)
    (tmp_path / "results" / "atp.nc").write_bytes(b"not a netCDF file")
    with pytest.raises(RunDirError, match="atp.nc.*delete .*atp.nc and rerun `countlens discover"):
        stages.run("atp", never)
    dims = xr.Dataset({"effect": (("lyr", "head"), np.zeros((2, 2))), "resid_effect": ("lyr", np.zeros(2))})
    results.save(dims, tmp_path / "results" / "atp.nc")
    with pytest.raises(RunDirError, match="'effect' is over the dims \\['lyr', 'head'\\], not \\['layer', 'head'\\]"):
        stages.run("atp", never)


def test_earlier_cases_end_in_a_clear_error(tmp_path, organism):
    from countlens.datasets.loaders import load_countingtricks_release
    from countlens.datasets.loaders.common import LoaderError
    from countlens.pipeline.finetune_job import check_recipe
    from countlens.pipeline.presets import recipe

    (tmp_path / "images" / "1A").mkdir(parents=True)
    with pytest.raises(LoaderError, match="case 1A holds no .png image"):
        load_countingtricks_release(tmp_path)
    from countlens.pipeline.finetune_sets import training_data

    assert len(training_data(recipe(), organism.geometry, "short", n=2)) == 2  # it drew 32 for n_train 2
    check_recipe(recipe(), n_train=2)
    vlm = cl.load("toy")  # private: its chat template is broken below
    vlm.processor.chat_template = "{% for m in messages %}{{ m.role }"
    with pytest.raises(InputError, match="chat template does not render.*fix or replace"):
        vlm.prepare_samples([count_pairs(1, 3, 5, grid=vlm.geometry, prompt="short")[0].clean])


def test_a_rank_correlation_over_part_of_the_sites_is_refused():
    import numpy as np
    import xarray as xr

    from countlens.circuits import compare

    grid = xr.DataArray(np.arange(6.0).reshape(2, 3), dims=("layer", "head"))
    assert compare(grid, grid, k=2)["spearman"] == 1.0
    with pytest.raises(InputError, match="score different sites \\(1 are NaN in one only\\)"):
        compare(grid.where(grid != 2), grid, k=2)
    with pytest.raises(InputError, match="±inf"):
        compare(grid.where(grid != 2, np.inf), grid, k=2)


def test_a_missing_tokenizer_is_named_as_missing(tmp_path):
    import shutil

    from countlens.errors import CheckpointError
    from countlens.model.loading import TOKENIZER_FILES
    from countlens.model.shipped import TOY_DIR

    shutil.copytree(TOY_DIR, tmp_path / "toy", ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    with pytest.raises(CheckpointError, match="has no tokenizer vocabulary .*copy tokenizer.json"):
        cl.load(tmp_path / "toy")


def test_a_zero_rescale_factor_is_named_as_the_processor_setting(tmp_path):
    import json
    import shutil

    from countlens.errors import CheckpointError
    from countlens.model.shipped import TOY_DIR

    shutil.copytree(TOY_DIR, tmp_path / "toy")
    path = tmp_path / "toy" / "preprocessor_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "rescale_factor": 0.0, "do_rescale": True}))
    with pytest.raises(CheckpointError, match="rescale_factor is 0.0: every image would be rescaled to nothing"):
        cl.load(tmp_path / "toy")


def test_report_tables_show_no_nan_or_inf_as_a_figure():
    import numpy as np
    import pandas as pd

    from countlens.analysis.tables import finite_markdown

    clean = pd.DataFrame({"a": [0.5, 1.25], "b": ["x", "y"]})
    assert finite_markdown(clean, index=False) == clean.to_markdown(index=False)  # untouched without a gap
    gaps = pd.DataFrame({"CPR": [0.9, np.nan], "CMD": [np.inf, 0.1]}, index=["exact", "random"])
    shown = finite_markdown(gaps)
    assert "nan" not in shown and "inf" not in shown and shown.count("–") == 2 and "0.9" in shown
