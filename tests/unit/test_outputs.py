"""Outputs: every argument is checked, then the folder is claimed, then it is written.

The mechanism (`countlens.files`): a command validates all it was given before it claims its folder
(`claim_directory` writes the owner marker last of all checks), so a refused run never blocks the
corrected rerun; saves are all or nothing (`results.save` and `results.save_all` write temp files
and rename them only once every one is written); an output path that is one of the inputs is
refused (`refuse_output_over_input`); a rerun of other settings names the settings that differ
(`settings_changes`, old → new); the machine's failures — a full disk the netCDF library reports as
``RuntimeError("NetCDF: HDF error")``, a path under a file — reach the command line as `OSError`s
and end in one line that names the real cause and its fix (`countlens.files.machine_error`,
`countlens.cli.app`). Every case here is refused before any forward and before anything is written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from typer.testing import CliRunner

from countlens import results
from countlens.cli.app import app
from countlens.errors import ConfigError, CountlensError, InputError, RunDirError
from countlens.files import OWNER, claim_directory

runner = CliRunner()


def _listing(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def _refused(args: list[str], text: str, **kw) -> str:
    result = runner.invoke(app, args, **kw)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and text in result.output, result.output
    return result.output


# -- every argument checked, then the folder claimed ------------------------------------------------


def test_toy_plant_top_half_refuses_bad_steps_before_it_claims_the_folder(tmp_path):
    """--steps 0 used to be refused after the owner marker was written: the corrected rerun was refused."""
    out = tmp_path / "top"
    _refused(["toy", "plant", "--circuit", "top-half", "--steps", "0", "--out", str(out)], "steps")
    assert not out.exists()


def test_plant_refuses_a_bad_second_stage_before_it_claims_the_folder(tmp_path):
    """A sharpening stage out of range was refused only after the first stage had trained."""
    from countlens.toy.edge_plant import plant_edges
    from countlens.toy.plant import PlantConfig, plant
    from countlens.toy.planted import CIRCUITS, EDGE_CIRCUITS

    circuit = next(c for c in CIRCUITS.values() if c.sharpen is not None)
    bad = replace(circuit, sharpen=replace(circuit.sharpen, steps=0))
    with pytest.raises(ConfigError, match="steps"):
        plant(tmp_path / "p", bad, PlantConfig(steps=1))
    edges = EDGE_CIRCUITS["value-route"]
    with pytest.raises(ConfigError, match="steps"):
        plant_edges(tmp_path / "e", replace(edges, sharpen=replace(edges.sharpen, steps=0)), PlantConfig(steps=1))
    assert sorted(tmp_path.iterdir()) == []


# -- all or nothing ---------------------------------------------------------------------------------


def test_save_all_writes_every_result_or_none(tmp_path):
    """`b` cannot be stored in netCDF: `a.nc` is neither written nor replaced, and no temp is left."""
    folder = tmp_path / "many"
    old = results.save(xr.DataArray(np.zeros(2), dims="x", name="old"), folder / "a.nc")
    before = _listing(tmp_path)
    good = xr.DataArray(np.arange(3.0), dims="x", name="a")
    mixed = xr.DataArray(np.array([{"k": 1}, 2, "x"], dtype=object), dims="x", name="b")
    with pytest.raises(results.ResultError, match="b.nc: netCDF cannot hold"):
        results.save_all({"a": good, "b": mixed}, folder)
    assert _listing(tmp_path) == before | {"many": _listing(tmp_path)["many"]}  # the temps came and went
    assert results.load(old).name == "old"
    with pytest.raises(results.ResultError):
        results.save_all({"a": good, "b": mixed}, tmp_path / "new" / "deep")
    assert not (tmp_path / "new").exists()  # the folders it would have made are not left behind


# -- an output that is one of the inputs ------------------------------------------------------------


def test_graph_page_refuses_to_write_over_its_own_json(tmp_path, monkeypatch):
    from countlens.features.graph_page import graph_page

    viewer = {
        "metadata": {"slug": "g", "prompt_tokens": ["a"]},
        "nodes": [{"node_id": "E_0_0", "feature_type": "embedding", "ctx_idx": 0, "layer": "E"}],
        "links": [],
    }
    source = tmp_path / "g.json"
    source.write_text(json.dumps(viewer))
    before = _listing(tmp_path)
    monkeypatch.chdir(tmp_path)  # the same file spelled two ways
    with pytest.raises(InputError, match="overwrite its own input"):
        graph_page(source, "./sub/../g.json")
    assert _listing(tmp_path) == before and json.loads(source.read_text()) == viewer


def test_features_graph_refuses_out_in_the_transcoder_folder(tmp_path):
    transcoders = tmp_path / "set"
    transcoders.mkdir()
    (transcoders / "config.yaml").write_text("model_kind: transcoder_set\n")
    before = _listing(tmp_path)
    args = ["features", "graph", "--transcoders", str(transcoders), "--out", str(transcoders)]
    _refused(args, "overwrite its own input")
    assert _listing(tmp_path) == before


# -- the machine's failures -------------------------------------------------------------------------


def _full_disk(monkeypatch):
    """The netCDF library's own words for a full disk, and a disk with nothing free."""

    def hdf_error(dataset, tmp):
        Path(tmp).write_bytes(b"\x89HDF half")
        raise RuntimeError("NetCDF: HDF error")

    monkeypatch.setattr(results, "_write_netcdf", hdf_error)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30, 0))


def test_a_full_disk_in_the_netcdf_write_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    _full_disk(monkeypatch)
    path = tmp_path / "r.nc"
    with pytest.raises(OSError) as err:
        results.save(xr.DataArray(np.zeros(3), dims="x"), path)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert os.listdir(tmp_path) == []  # the temp is gone too


def test_hdf_errors_are_translated_only_when_the_machine_caused_them(tmp_path):
    from countlens.files import machine_error

    path = tmp_path / "r.nc"
    h5 = OSError("Unable to create file (unable to open file: errno = 28, error message = 'No space left on device')")
    assert machine_error(h5, path).errno == errno.ENOSPC
    assert machine_error(RuntimeError("NetCDF: HDF error"), path) is None  # room on the disk: not the machine
    assert machine_error(PermissionError(errno.EACCES, "Permission denied"), path) is None  # the OS's own already


def test_the_command_line_reports_a_full_disk_as_the_disk_not_a_bug(tmp_path, monkeypatch):
    """discover's netCDF write on a full disk ended in exit 70, "a bug in countlens"."""
    import countlens
    import countlens.pipeline.held_out as held_out

    _full_disk(monkeypatch)
    monkeypatch.setattr(countlens, "load", lambda *a, **kw: object())
    monkeypatch.setattr(held_out, "held_out_scores", lambda *a, **kw: xr.Dataset({"x": ("s", np.zeros(2))}))
    monkeypatch.setattr(held_out, "accuracy_report", lambda *a, **kw: "")
    monkeypatch.setattr(held_out, "write_held_out", lambda out, ds, text: results.save(ds, out / "scores.nc"))
    output = _refused(["eval", "--n", "1", "--out", str(tmp_path / "eval")], "No space left on device")
    assert str(tmp_path / "eval" / "scores.nc") in output and "free space" in output and "bug" not in output


# -- fixes that name the real cause -----------------------------------------------------------------


def test_a_path_under_a_file_is_said_to_be_under_a_file(tmp_path, monkeypatch):
    """It was "free space or fix the permissions there"."""
    import countlens

    (tmp_path / "a_file").write_text("x")
    under = tmp_path / "a_file" / "sub"
    _refused(["features", "train", "--out", str(under)], "a_file is a file")

    def mkdir_under_a_file(*a, **kw):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(under))

    monkeypatch.setattr(countlens, "load", mkdir_under_a_file)
    output = _refused(["eval", "--n", "1"], f"{tmp_path / 'a_file'} is a file, not a folder")
    assert "free space" not in output


def test_features_train_rerun_names_the_setting_and_the_command_line_fix(tmp_path, monkeypatch, loaded):
    """It dumped the old spec's JSON and offered resume=False, which the command line does not have."""
    import torch

    import countlens
    from countlens.features.activations import check_mix
    from countlens.features.train import BATCH_TOKENS, CHECKPOINT, LR

    vlm = loaded("toy")
    spec = {
        "model": vlm.name or vlm.arch.name,
        "layers": list(range(vlm.arch.n_layers)),
        "width": 512,
        "k": 16,
        "steps": 2,
        "batch_tokens": BATCH_TOKENS,
        "lr": LR,
        "seed": 0,
        "mix": check_mix(None),
        "held_out": 0.25,
    }
    out = tmp_path / "tc"
    out.mkdir()
    torch.save({"spec": spec, "done": {}, "layer": None}, out / CHECKPOINT)
    before = _listing(tmp_path)
    monkeypatch.setattr(countlens, "load", lambda *a, **kw: vlm)
    output = _refused(["features", "train", "--out", str(out), "--steps", "3"], "steps 2 → 3")
    assert f"delete {out / CHECKPOINT}" in output and "--out" in output
    assert _listing(tmp_path) == before


def test_toy_train_rerun_names_the_setting_that_differs(tmp_path):
    from countlens.toy.recipe import ToyConfig, TrainConfig

    out = tmp_path / "toy"
    spec = {
        "config": json.loads(json.dumps(asdict(ToyConfig()), default=str)),
        "train": json.loads(json.dumps(asdict(TrainConfig(steps=2)), default=str)),
    }
    claim_directory(out, "countlens toy train", spec)
    before = _listing(tmp_path)
    _refused(["toy", "train", "--steps", "3", "--out", str(out)], "train.steps 2 → 3")
    assert _listing(tmp_path) == before


def test_toy_plant_after_a_sigterm_names_the_setting_that_differs(tmp_path):
    """A killed plant leaves its owner marker; a rerun with another --steps said only "other settings"."""
    from countlens.toy.plant import PlantConfig

    out = tmp_path / "route"
    claim_directory(out, "countlens toy plant", {"circuit": "route", "recipe": asdict(PlantConfig(steps=7))})
    (out / "train_log.jsonl").write_text("")  # what the killed run had written
    before = _listing(tmp_path)
    output = _refused(["toy", "plant", "--circuit", "route", "--steps", "5", "--out", str(out)], "recipe.steps 7 → 5")
    assert str(out / OWNER) in output and _listing(tmp_path) == before


def test_finetune_rerun_names_the_setting_that_differs(tmp_path, loaded):
    from countlens.datasets.tasks import task_samples
    from countlens.settings import FinetuneConfig
    from countlens.sweep_store import samples_digest
    from countlens.training.finetune import finetune

    vlm = loaded("toy")
    samples = task_samples("count", 2, seed=0)
    old = FinetuneConfig(focus=0.0, lr=1e-4)
    spec = {"model": vlm.name, "samples": 2, "digest": samples_digest(samples), **asdict(old)}
    spec.pop("save_every")
    out = tmp_path / "ft"
    out.mkdir()
    (out / "finetune.json").write_text(json.dumps(spec))
    before = _listing(tmp_path)
    with pytest.raises(RunDirError, match="lr 0.0001 → 0.0002"):
        finetune(vlm, samples, out, replace(old, lr=2e-4))
    assert _listing(tmp_path) == before
    # A spec that wrote "every head" as [] (target_heads=None now) differs only where it differs.
    (out / "finetune.json").write_text(json.dumps({**spec, "target_heads": []}))
    with pytest.raises(RunDirError, match="lr 0.0001 → 0.0002") as err:
        finetune(vlm, samples, out, replace(old, lr=2e-4))
    assert "target_heads" not in str(err.value)


def test_broken_yaml_is_said_to_be_broken_yaml_and_where(tmp_path):
    """It was "a folder in another format"."""
    from countlens.features import load_transcoders

    (tmp_path / "config.yaml").write_text("model_kind: transcoder_set\nactivation: [topk\n")
    with pytest.raises(InputError, match="broken YAML at line 3") as err:
        load_transcoders(tmp_path)
    assert "another format" not in str(err.value)


def test_features_plan_refuses_an_image_too_small_for_its_scene():
    """--image-size 7 planned a graph whose counting scene cannot be drawn (objects need ≥ 32 px)."""
    _refused(["features", "plan", "--image-size", "7"], "--image-size ≥ 32")


def test_discover_plan_names_the_image_size_when_its_scenes_cannot_be_drawn():
    """At 48 px the scenes' objects cover no pixel: it said "make it larger" of an object the user never made."""
    with pytest.raises(CountlensError, match="made at 32 px images .*larger --image-size"):  # 48 px: 32 px tokens
        from countlens.model.loading import meta_vlm
        from countlens.pipeline.plan import plan

        plan(meta_vlm("toy", image_size=48))


def test_train_transcoders_refuses_an_empty_out_rather_than_writing_here(loaded, tmp_path, monkeypatch):
    """``out=""`` is no folder: it would have put the checkpoint in the working directory."""
    from countlens.features import train_transcoders

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="out must be a path"):
        train_transcoders(loaded("toy"), out="", steps=1)
    assert not list(tmp_path.iterdir())
