"""Bad input, one table: every case is a `CountlensError` (CLI: exit 2, one line, no traceback) whose
message names the input, and nothing is left on disk.

Each API row is (id, call, error class, text the message must hold); each CLI row is (id, argv,
text the error line must hold). ``ctx`` hands rows the organism, a tiny real-vocabulary Qwen2.5-VL,
a scratch directory and a few prepared objects.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import xarray as xr
from PIL import Image
from typer.testing import CliRunner

import countlens
from countlens import circuits, results
from countlens.analysis.evaluate import generate, parse_count, score
from countlens.cli import app
from countlens.datasets import count_pairs, countingtricks, task_samples
from countlens.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CountlensError,
    DeviceError,
    InputError,
    LayerError,
)
from countlens.geometry import Geometry
from countlens.loading import TOY_DIR
from countlens.results import ResultError, ResultNotFoundError


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, loaded):
    toy = loaded("toy")
    qwen = loaded("qwen2_5_vl")
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "a_file").write_text("x")
    bad_config = tmp / "bad_config"
    shutil.copytree(TOY_DIR, bad_config)
    (bad_config / "config.json").write_text("{not json")
    truncated = tmp / "truncated"
    shutil.copytree(TOY_DIR, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    pairs = count_pairs(2, 3, 5, kind="shapes", grid=toy.geometry, prompt="short", seed=1)
    samples = task_samples("count", 3, 1, image_size=toy.geometry.image_height)
    return SimpleNamespace(
        toy=toy,
        qwen=qwen,
        tmp=tmp,
        pairs=pairs,
        samples=samples,
        bad_config=bad_config,
        truncated=truncated,
        image=Image.new("RGB", (192, 192)),
    )


API_CASES = [
    # data generation
    ("patch size 0", lambda c: countingtricks(["1A"], 2, image_size=192, patch_size=0), InputError, "patch_size"),
    ("image size 0", lambda c: countingtricks(["1A"], 2, image_size=0, patch_size=16), InputError, "image_size"),
    ("image below a patch", lambda c: countingtricks(["1A"], 2, image_size=12, patch_size=16), InputError, "12"),
    ("unknown case", lambda c: countingtricks(["99Z"], 2, image_size=192, patch_size=16), InputError, "99Z"),
    ("n_per_case 0", lambda c: countingtricks(["1A"], 0, image_size=192, patch_size=16), InputError, "n_per_case"),
    (
        "counts above capacity",
        lambda c: countingtricks(["8A"], 2, image_size=192, patch_size=16, counts=[40]),
        InputError,
        "40",
    ),
    (
        "unknown shape",
        lambda c: countingtricks(["1A"], 2, image_size=192, patch_size=16, shapes="hexagon"),
        InputError,
        "hexagon",
    ),
    (
        "unknown prompt",
        lambda c: countingtricks(["1A"], 2, image_size=192, patch_size=16, prompt="polite"),
        InputError,
        "polite",
    ),
    ("pairs n float", lambda c: count_pairs(2.5, 3, 5, image_size=192), InputError, "2.5"),
    ("pairs n 0", lambda c: count_pairs(0), InputError, "got 0"),
    ("pair kind", lambda c: count_pairs(2, kind="cats"), InputError, "cats"),
    ("pair counts equal", lambda c: count_pairs(2, 3, 3), InputError, "clean=3"),
    ("pair prompt with a distractor", lambda c: count_pairs(2, prompt="conflict"), InputError, "conflict"),
    ("task n negative", lambda c: task_samples("count", -1, 0), InputError, "-1"),
    ("unknown task", lambda c: task_samples("dance", 2, 0), CountlensError, "dance"),
    ("geometry patch 0", lambda c: Geometry(192, 192, 0), CountlensError, "patch_size"),
    # results
    (
        "save under /proc",
        lambda c: results.save(xr.DataArray([1.0], dims="x"), "/proc/countlens/x.nc"),
        ResultError,
        "/proc/countlens",
    ),
    (
        "save under a file",
        lambda c: results.save(xr.DataArray([1.0], dims="x"), c.tmp / "a_file" / "x.nc"),
        ResultError,
        "a_file",
    ),
    ("load a missing result", lambda c: results.load(c.tmp / "missing.nc"), ResultNotFoundError, "missing.nc"),
    # loading
    ("missing checkpoint", lambda c: countlens.load(c.tmp / "nowhere"), CheckpointNotFoundError, "nowhere"),
    ("invalid config.json", lambda c: countlens.load(c.bad_config), CheckpointError, "config.json"),
    ("truncated weights", lambda c: countlens.load(c.truncated), CheckpointError, "model.safetensors"),
    ("bad dtype", lambda c: countlens.load("toy", dtype="bf16"), ConfigError, "bf16"),
    ("cuda on a CPU build", lambda c: countlens.load("toy", device_map="cuda"), DeviceError, "cuda"),
    ("a CUDA ordinal on a CPU build", lambda c: countlens.load("toy", device_map=0), DeviceError, "device 0"),
    ("cuda in a device map", lambda c: countlens.load("toy", device_map={"": "cuda:0"}), DeviceError, "cuda:0"),
    # inputs
    ("one image not in a list", lambda c: c.toy.prepare(c.image, ["how many circles?"]), InputError, "images"),
    ("one prompt as a string", lambda c: c.toy.prepare([c.image], "how many circles?"), InputError, "prompts"),
    ("empty prompt", lambda c: c.toy.prepare([c.image], ["  "]), InputError, "prompt 0 is empty"),
    ("images and prompts differ", lambda c: c.toy.prepare([c.image, c.image], ["how many?"]), InputError, "2 images"),
    ("grey image", lambda c: c.toy.prepare([c.image.convert("L")], ["how many?"]), InputError, "mode 'L'"),
    ("empty answer", lambda c: c.toy.prepare([c.image], ["how many?"], [""]), InputError, "answer ''"),
    (
        "answer outside the vocabulary",
        lambda c: c.toy.prepare([c.image], ["how many?"], ["zebra"]),
        InputError,
        "zebra",
    ),
    # evaluation
    ("score no samples", lambda c: score(c.toy, []), InputError, "no samples"),
    ("score method", lambda c: score(c.toy, c.samples, method="vibes"), InputError, "vibes"),
    ("one candidate", lambda c: score(c.toy, c.samples, candidates=["3"]), InputError, "at least two"),
    (
        "gold outside the candidates",
        lambda c: score(c.toy, c.samples, candidates=["98", "99"]),
        InputError,
        "not among candidates",
    ),
    (
        "token scoring of a multi-token answer",
        lambda c: score(c.qwen, task_samples("count", 2, 1, image_size=64), method="token"),
        InputError,
        "single token",
    ),
    ("generation budget 0", lambda c: generate(c.toy, c.samples, max_new_tokens=0), InputError, "max_new_tokens"),
    ("parse a number", lambda c: parse_count(3), InputError, "int"),
    # circuits
    ("unknown token group", lambda c: circuits.patch_layers(c.toy, c.pairs, groups=("nope",)), InputError, "nope"),
    ("layer out of range", lambda c: circuits.patch_layers(c.toy, c.pairs, layers=[99]), LayerError, "99"),
    ("no pairs", lambda c: circuits.patch_heads(c.toy, []), InputError, "no pairs"),
    ("head out of range", lambda c: circuits.ablate(c.toy, c.samples, heads=[(0, 99)]), InputError, "head 99"),
    ("lens no samples", lambda c: circuits.logit_lens(c.toy, []), InputError, "no samples"),
    ("headlens no samples", lambda c: circuits.HeadLens.fit(c.toy, []), InputError, "needs samples"),
    ("ablation no tasks", lambda c: circuits.ablation_scan(c.toy, {}), InputError, "tasks="),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input(case, ctx):
    _, call, error, text = case
    before = sorted(p.name for p in ctx.tmp.iterdir())
    with pytest.raises(error) as info:
        call(ctx)
    assert isinstance(info.value, CountlensError)
    assert text in str(info.value), str(info.value)
    assert sorted(p.name for p in ctx.tmp.iterdir()) == before  # nothing written


def test_a_case_named_alone_is_one_case():
    one = countingtricks("1A", 2, image_size=192, patch_size=16)
    assert [s.meta["case"] for s in one] == ["1A", "1A"]


runner = CliRunner()


def _run_dir(tmp: Path, spec: dict | None) -> Path:
    run = tmp / f"run_{len(list(tmp.iterdir()))}"
    run.mkdir()
    if spec is not None:
        (run / "spec.json").write_text(json.dumps(spec))
    return run


CLI_CASES = [
    ("eval n 0", lambda t: ["eval", "--n", "0", "--out", str(t / "out")], "--n must be ≥ 1"),
    ("eval n negative", lambda t: ["eval", "--n", "-5", "--out", str(t / "out")], "--n must be ≥ 1, got -5"),
    ("eval seed", lambda t: ["eval", "--seed", "5000", "--out", str(t / "out")], "--seed 5000"),
    ("eval out under a file", lambda t: ["eval", "--out", str(t / "a_file" / "out")], "a_file is a file"),
    ("eval out under /proc", lambda t: ["eval", "--out", "/proc/countlens-out"], "not writable"),
    ("eval cuda", lambda t: ["eval", "--device", "cuda", "--n", "4", "--out", str(t / "out")], "device 'cuda'"),
    ("missing model", lambda t: ["eval", "--model", str(t / "nowhere"), "--out", str(t / "out")], "nowhere"),
    (
        "data workers 0",
        lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--workers", "0"],
        "--workers must be ≥ 1",
    ),
    (
        "data image size 0",
        lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--image-size", "0", "--patch-size", "16"],
        "--image-size 0",
    ),
    ("data unknown case", lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--cases", "99Z"], "99Z"),
    (
        "data counts not numbers",
        lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--counts", "a,b"],
        "--counts 'a,b'",
    ),
    (
        "data counts above capacity",
        lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--cases", "8A", "--counts", "50", "--n", "2"],
        "50",
    ),
    (
        "discover batch size 0",
        lambda t: ["discover", "--out", str(t / "out"), "--batch-size", "0"],
        "--batch-size must be ≥ 1",
    ),
    ("discover pairs 0", lambda t: ["discover", "--out", str(t / "out"), "--n-pairs", "0"], "--n-pairs"),
    ("discover prompt", lambda t: ["discover", "--out", str(t / "out"), "--prompt", "conflict"], "conflict"),
    ("discover out is a file", lambda t: ["discover", "--out", str(t / "a_file")], "a_file is a file"),
    ("finetune garbage heads.csv", lambda t: ["finetune", "--circuit", str(_garbage_circuit(t))], "heads.csv"),
    ("finetune no circuit", lambda t: ["finetune", "--circuit", str(t / "nowhere")], "nowhere"),
    ("report empty spec", lambda t: ["report", "--run", str(_run_dir(t, {}))], "lacks ['model', 'arch']"),
    ("report not a run", lambda t: ["report", "--run", str(_run_dir(t, None))], "no spec.json"),
    ("classify empty spec", lambda t: ["classify", "--run", str(_run_dir(t, {}))], "lacks ['model', 'arch']"),
]


def _garbage_circuit(tmp: Path) -> Path:
    run = _run_dir(tmp, None)
    (run / "heads.csv").write_text("this,is\nnot,a head table\n")
    return run


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(case, tmp_path):
    _, argv, text = case
    (tmp_path / "a_file").write_text("x")
    result = runner.invoke(app, argv(tmp_path))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and text in result.output, result.output
    assert not (tmp_path / "out").exists()  # validated before anything was written


def test_discover_refused_then_corrected_in_the_same_directory(tmp_path, loaded):
    """A refused run leaves no spec.json behind to block the corrected rerun."""
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.discover import discover

    toy = loaded("toy")
    with pytest.raises(ConfigError, match="batch_size"):
        discover(toy, tmp_path / "run", DiscoverConfig(batch_size=0))
    assert not (tmp_path / "run").exists()


def test_pairs_of_equal_token_counts_on_different_grids_are_refused(ctx):
    from dataclasses import replace

    from countlens.datasets.pairs import CountPair
    from countlens.datasets.scene import Scene

    p = ctx.pairs[0]
    wide = replace(p.corrupt, scene=Scene(384, 96, p.corrupt.scene.objects[:0]))  # 36 tokens on a 3×12 grid
    with pytest.raises(InputError, match=r"\(6, 6\).*\(3, 12\)"):
        circuits.patch_layers(ctx.toy, [CountPair(p.clean, wide, p.kind, 0)])
    assert np.isfinite(circuits.patch_layers(ctx.toy, ctx.pairs, layers=[-1]).effect.values).all()
