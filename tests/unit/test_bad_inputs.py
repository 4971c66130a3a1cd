"""Bad input, one table: every case is a `CountlensError` (CLI: exit 2, one line, no traceback) whose
message names the input, and nothing is left on disk.

Each API row is (id, call, error class, text the message must hold); each CLI row is (id, argv,
text the error line must hold). ``ctx`` hands rows the organism, a tiny real-vocabulary Qwen2.5-VL,
a scratch directory and a few prepared objects.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import xarray as xr
from benchmark_files import clevr_root, mathvista_rows, mmmu_copy, mmmu_rows, png
from PIL import Image
from typer.testing import CliRunner

import countlens
from countlens import circuits, results
from countlens.analysis.evaluate import generate, score
from countlens.analysis.heads import HeadThresholds, read_heads
from countlens.analysis.parse import parse_count
from countlens.analysis.probes import ProbeConfig
from countlens.cli import app
from countlens.datasets import count_pairs, countingtricks, task_samples
from countlens.datasets.pairs import CountPair
from countlens.datasets.scene import Obj, Scene
from countlens.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CountlensError,
    DeviceError,
    InputError,
    LayerError,
    RunDirError,
)
from countlens.model.geometry import Geometry
from countlens.model.loading import meta_vlm
from countlens.model.shipped import TOY_DIR
from countlens.pipeline.config import DiscoverConfig
from countlens.results import ResultError, ResultNotFoundError
from countlens.toy.recipe import TrainConfig
from countlens.training.finetune import FinetuneConfig


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, loaded, tiny_checkpoint):
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
    no_vision = tmp / "no_vision"
    shutil.copytree(TOY_DIR, no_vision, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((no_vision / "config.json").read_text())
    del config["vision_config"]
    (no_vision / "config.json").write_text(json.dumps(config))
    p = pairs[0]  # the corrupt side asked another question of the same length
    asked_apart = [
        CountPair(p.clean, replace(p.corrupt, question=p.corrupt.question.replace("many", "mony")), p.kind, 0)
    ]
    nan_heads, odd_class = _head_table(tmp, "nan_heads", importance="nan"), _head_table(tmp, "odd", cls="chef")
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    moe = loaded("qwen3_vl_moe")
    return SimpleNamespace(
        moe=moe,
        moe_samples=task_samples("count", 2, 1, image_size=64),
        moe_pairs=count_pairs(2, 3, 5, kind="polygons", image_size=64, prompt="short", seed=1),
        scan=_scan(),
        edited_name=_result_with_name_attr(tmp, "{effect"),
        toy=toy,
        qwen=qwen,
        tmp=tmp,
        pairs=pairs,
        samples=samples,
        bad_config=bad_config,
        truncated=truncated,
        image=Image.new("RGB", (192, 192)),
        effect=xr.DataArray(
            np.arange(6.0).reshape(2, 3), dims=("layer", "head"), coords={"layer": [0, 1], "head": [0, 1, 2]}
        ),
        no_vision=no_vision,
        asked_apart=asked_apart,
        nan_heads=nan_heads,
        odd_class=odd_class,
        short_layer_types=_edited(
            tiny_checkpoint("qwen3_5"), checkpoints / "short_layer_types", _drop_a_layer_type, weights=False
        ),
        too_many_experts=_edited(
            tiny_checkpoint("qwen3_vl_moe"), checkpoints / "experts", _more_experts_per_token, weights=False
        ),
        wider_mlp=_edited(TOY_DIR, checkpoints / "wider_mlp", _wider_mlp, weights=True),
        bitsandbytes=_edited(TOY_DIR, checkpoints / "bnb", _bitsandbytes, weights=False),
        paligemma_no_tokenizer=_without(tiny_checkpoint("paligemma"), checkpoints / "pali", "tokenizer*"),
        patch_8=_edited(TOY_DIR, checkpoints / "patch_8", _patch_8, weights=True, file="preprocessor_config.json"),
        image_token_7=_edited(TOY_DIR, checkpoints / "token_7", _image_token_7, weights=True),
        clip_processor=_swapped(tiny_checkpoint("llava"), checkpoints / "clip", "*processor_config.json"),
        llava_tokenizer=_swapped(tiny_checkpoint("llava"), checkpoints / "llava_tok", "tokenizer*"),
    )


def _scan() -> xr.Dataset:
    """An ablation scan's shape (`circuits.ablation_scan`): two tasks over 2 layers × 3 heads."""
    drop = np.arange(12.0).reshape(2, 2, 3)
    drop[1] = drop[1, :, ::-1]  # the second task ranks the heads of each layer the other way round
    return xr.Dataset(
        {"logp_drop": (("task", "layer", "head"), drop)},
        coords={"task": ["count", "color"], "layer": [0, 1], "head": [0, 1, 2]},
    )


def _result_with_name_attr(tmp: Path, name: str) -> Path:
    """A DataArray result as `results.save` writes it, its name attribute edited to ``name``."""
    path = tmp / "edited_name.nc"
    data = xr.DataArray([1.0], dims="x").to_dataset(name=results.DATAARRAY_VAR)
    data.attrs = {results.KIND_ATTR: "DataArray", results.NAME_ATTR: name}
    data.to_netcdf(path, engine=results.ENGINE)
    return path


def _edited(source: Path, where: Path, edit, weights: bool, file: str = "config.json") -> Path:
    """A copy of the checkpoint at ``source`` (its weight files only with ``weights``) whose
    ``file`` (config.json) ``edit`` changed in place."""
    shutil.copytree(source, where, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    config = json.loads((where / file).read_text())
    edit(config)
    (where / file).write_text(json.dumps(config))
    return where


def _without(source: Path, where: Path, pattern: str) -> Path:
    """A copy of the checkpoint at ``source`` without its weights and without the files ``pattern`` matches."""
    shutil.copytree(source, where, ignore=shutil.ignore_patterns("*.safetensors", pattern))
    return where


def _swapped(other: Path, where: Path, pattern: str) -> Path:
    """The organism with the files ``pattern`` matches taken from the checkpoint ``other`` instead
    (its own removed first): another family's processor, another model's tokenizer."""
    shutil.copytree(TOY_DIR, where, ignore=shutil.ignore_patterns(pattern))
    for file in other.glob(pattern):
        shutil.copy(file, where / file.name)
    return where


def _patch_8(processor: dict) -> None:  # the vision tower's patch is 16
    processor["patch_size"] = 8


def _image_token_7(config: dict) -> None:  # the tokenizer's <|image_pad|> is id 5
    config["image_token_id"] = 7


def _drop_a_layer_type(config: dict) -> None:  # 3 layer types for 4 layers
    config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:-1]


def _more_experts_per_token(config: dict) -> None:  # 6 experts per token of 4
    config["text_config"]["num_experts_per_tok"] = config["text_config"]["num_local_experts"] + 2


def _wider_mlp(config: dict) -> None:  # the MLP weights stay 384 wide
    config["text_config"]["intermediate_size"] += 8


def _bitsandbytes(config: dict) -> None:
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}


def _head_table(tmp: Path, name: str, importance: str = "0.5", cls: str = "other") -> Path:
    run = tmp / name
    run.mkdir()
    (run / "heads.csv").write_text(f"head_id,layer,head,class,importance\nL0H0,0,0,{cls},{importance}\n")
    return run


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
    (
        "paper-code cases no circle fits on the grid",
        lambda c: countingtricks(["1A", "8A"], 2, Geometry.square(48, 16), design="paper-code"),
        InputError,
        "cases ['8A'] can draw no circle",
    ),
    (
        "white objects on white",
        lambda c: countingtricks(["1A"], 2, image_size=192, patch_size=16, color=("red", "white")),
        InputError,
        "objects coloured 'white' on a 'white' background cannot be seen",
    ),
    (
        "a scene of black on black",
        lambda c: Scene(64, 64, (Obj("circle", "black", 32, 32, 10),), "black"),
        InputError,
        "on a 'black' background",
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
    (
        "load a result whose name attr was edited",
        lambda c: results.load(c.edited_name),
        ResultError,
        "edited_name.nc: its attr 'countlens_name' is '{effect'",
    ),
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
    ("headlens no samples", lambda c: circuits.HeadLens.fit(c.toy, []), InputError, "no samples given to HeadLens.fit"),
    ("ablation no tasks", lambda c: circuits.ablation_scan(c.toy, {}), InputError, "tasks="),
    # ranges declared once, on the configurations and the generators
    ("task image too small", lambda c: task_samples("count", 2, 1, image_size=10), InputError, "image_size ≥ 32"),
    ("task seed negative", lambda c: task_samples("count", 2, -1), InputError, "seed must be an integer ≥ 0"),
    (
        "tricks case twice",
        lambda c: countingtricks(["1A", "4A", "1A"], 2, image_size=192, patch_size=16),
        InputError,
        "1A more than once",
    ),
    (
        "tricks seed negative",
        lambda c: countingtricks("1A", 2, image_size=192, patch_size=16, seed=-1),
        InputError,
        "-1",
    ),
    ("pairs seed negative", lambda c: count_pairs(2, seed=-1), InputError, "seed must be"),
    ("score batch 2.5", lambda c: score(c.toy, c.samples, batch_size=2.5), InputError, "batch_size"),
    ("compare k 0", lambda c: circuits.compare(c.effect, c.effect, k=0), InputError, "k must be"),
    ("jaccard k 0", lambda c: circuits.jaccard(c.scan, k=0), InputError, "k must be an integer ≥ 1, got 0"),
    ("top heads k 0", lambda c: circuits.top_heads(c.scan, k=0), InputError, "k must be an integer ≥ 1, got 0"),
    # experts: the labels results write, integers only, groups checked before a store is written
    (
        "an expert id that is no integer",
        lambda c: circuits.ablate_experts(c.moe, c.moe_samples, [(1, 1.7)]),
        InputError,
        "expert (1, 1.7): give (layer, expert) as two integers",
    ),
    (
        "an expert label spelled wrong",
        lambda c: circuits.ablate_experts(c.moe, c.moe_samples, ["L1X0"]),
        InputError,
        "'L1E0'",
    ),
    (
        "an expert label out of range",
        lambda c: circuits.ablate_experts(c.moe, c.moe_samples, ["L1E9"]),
        InputError,
        "expert 9 out of range",
    ),
    (
        "patch_experts misspelt group into a store",
        lambda c: circuits.patch_experts(c.moe, c.moe_pairs, positions="imgae", store=c.tmp / "experts_store"),
        InputError,
        "unknown token group 'imgae'",
    ),
    (
        "patch_heads misspelt group into a store",
        lambda c: circuits.patch_heads(c.toy, c.pairs, positions="lst", store=c.tmp / "heads_store"),
        InputError,
        "unknown token group 'lst'",
    ),
    ("temperature β inf", lambda c: _enter(circuits.head_temperature(c.toy, {(0, 0): np.inf})), InputError, "L0H0"),
    ("temperature β NaN", lambda c: _enter(circuits.head_temperature(c.toy, {"L0H1": np.nan})), InputError, "L0H1"),
    (
        "temperature head twice",
        lambda c: _enter(circuits.head_temperature(c.toy, {(0, 0): 1.2, "L0H0": 1.5})),
        InputError,
        "twice",
    ),
    ("a head spelled wrong", lambda c: circuits.ablate(c.toy, c.samples, ["head 0"]), InputError, "'L3H2'"),
    (
        "β from NaN importance",
        lambda c: circuits.beta_from_importance(c.effect.where(c.effect > 1e9)),
        InputError,
        "NaN",
    ),
    ("patch_layers on samples", lambda c: circuits.patch_layers(c.toy, c.samples), InputError, "takes pairs"),
    ("ablate on pairs", lambda c: circuits.ablate(c.toy, c.pairs, ["L0H0"]), InputError, "got clean/corrupt pairs"),
    (
        "pairs whose questions differ",
        lambda c: circuits.patch_heads(c.toy, c.asked_apart),
        InputError,
        "share its question",
    ),
    ("FinetuneConfig lr 0", lambda c: FinetuneConfig(lr=0.0), ConfigError, "lr must be a finite number > 0"),
    ("FinetuneConfig lr negative", lambda c: FinetuneConfig(lr=-1e-3), ConfigError, "-0.001"),
    (
        "thresholds inverted",
        lambda c: HeadThresholds(early=0.9, late=0.1),
        ConfigError,
        "early (0.9) must not exceed late",
    ),
    ("threshold above 1", lambda c: HeadThresholds(cter_min=50), ConfigError, "cter_min must be a number in [0, 1]"),
    ("importance threshold negative", lambda c: HeadThresholds(important=-1), ConfigError, "important"),
    ("probe prior 0", lambda c: ProbeConfig(prior=0.0), ConfigError, "prior must be a number in (0, 1)"),
    ("toy steps negative", lambda c: TrainConfig(steps=-5), ConfigError, "steps must be an integer ≥ 0"),
    ("discover seed negative", lambda c: DiscoverConfig(seed=-1), ConfigError, "seed"),
    ("config without vision_config", lambda c: meta_vlm(str(c.no_vision)), CheckpointError, "vision_config"),
    ("plan int8", lambda c: meta_vlm("toy", dtype="int8"), ConfigError, "int8"),
    ("load int8", lambda c: countlens.load("toy", dtype="int8"), ConfigError, "floating"),
    # libraries' errors translated where countlens calls them
    (
        "layer_types of the wrong length",
        lambda c: countlens.load(c.short_layer_types),
        CheckpointError,
        "`num_hidden_layers` (4) must be equal to the number of `layer_types` (3)",
    ),
    (
        "more experts per token than experts",
        lambda c: countlens.load(c.too_many_experts),
        CheckpointError,
        "text_config.num_experts_per_tok = 6 experts per token, but text_config.num_local_experts = 4",
    ),
    (
        "plan more experts per token than experts",
        lambda c: meta_vlm(str(c.too_many_experts)),
        CheckpointError,
        "num_experts_per_tok = 6",
    ),
    (
        "weights the config does not shape",
        lambda c: countlens.load(c.wider_mlp),
        CheckpointError,
        "has shape [128, 384] in the checkpoint's weight files but config.json makes it [128, 392]",
    ),
    ("a bitsandbytes checkpoint", lambda c: countlens.load(c.bitsandbytes), CheckpointError, "'bitsandbytes'"),
    ("plan a bitsandbytes checkpoint", lambda c: meta_vlm(str(c.bitsandbytes)), CheckpointError, "unquantised"),
    # a checkpoint whose files disagree, refused at load with one message per kind
    (
        "a PaliGemma copy without tokenizer files",
        lambda c: countlens.load(c.paligemma_no_tokenizer),
        CheckpointError,
        "has no tokenizer vocabulary (none of tokenizer.json",
    ),
    (
        "processor patch 8 on a tower of patch 16",
        lambda c: countlens.load(c.patch_8),
        CheckpointError,
        "has patch_size 8, but config.json's vision_config.patch_size is 16",
    ),
    (
        "an image-token id the tokenizer does not write",
        lambda c: countlens.load(c.image_token_7),
        CheckpointError,
        "config.json's image_token_id is 7, but the tokenizer writes the image token '<|image_pad|>' as id 5",
    ),
    (
        "another family's image processor",
        lambda c: countlens.load(c.clip_processor),
        CheckpointError,
        "builds a CLIPImageProcessor, another model family's image processor",
    ),
    (
        "another model's tokenizer",
        lambda c: countlens.load(c.llava_tokenizer),
        CheckpointError,
        "it is another model's tokenizer",
    ),
    ("heads.csv with NaN importance", lambda c: read_heads(c.nan_heads), RunDirError, "no finite importance"),
    ("heads.csv with an unknown class", lambda c: read_heads(c.odd_class), RunDirError, "unknown classes"),
]


def _enter(context):
    with context:
        pass


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


def _run_dir(tmp: Path, spec: dict | str | None) -> Path:
    run = tmp / f"run_{len(list(tmp.iterdir()))}"
    run.mkdir()
    if spec is not None:
        (run / "spec.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
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
    # ranges checked on the configuration, before anything is written
    ("discover seed negative", lambda t: ["discover", "--out", str(t / "out"), "--seed", "-1"], "seed must be"),
    ("discover spec not JSON", lambda t: ["discover", "--out", str(_run_dir(t, "{oops"))], "cannot be read as JSON"),
    ("data seed negative", lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--seed", "-1"], "seed"),
    (
        "data case twice",
        lambda t: ["data", "countingtricks", "--out", str(t / "out"), "--cases", "1A,4A,1A"],
        "1A more than once",
    ),
    ("plan int8", lambda t: ["plan", "--dtype", "int8"], "int8"),
    ("plan config not JSON", lambda t: ["plan", "--model", str(_checkpoint(t, "{not json"))], "config.json"),
    ("plan no vision_config", lambda t: ["plan", "--model", str(_checkpoint(t, None))], "vision_config"),
    (
        "plan a bitsandbytes checkpoint",
        lambda t: ["plan", "--model", str(_checkpoint(t, _quantised()))],
        "quant_method 'bitsandbytes'",
    ),
    (
        "check a bitsandbytes checkpoint",
        lambda t: ["check", "--model", str(_checkpoint(t, _quantised()))],
        "quant_method 'bitsandbytes'",
    ),
    (
        "check a processor of patch 8 on a tower of patch 16",
        lambda t: ["check", "--model", str(_patch_8_copy(t))],
        "has patch_size 8, but config.json's vision_config.patch_size is 16",
    ),
    ("plan --json onto a directory", lambda t: ["plan", "--json", str(t)], "is a directory"),
    ("plan memory NaN", lambda t: ["plan", "--memory", "nan"], "--memory"),
    (
        "classify inverted bands",
        lambda t: ["classify", "--run", str(_run_dir(t, SPEC)), "--early", "0.9", "--late", "0.1"],
        "early (0.9) must not exceed late (0.1)",
    ),
    ("classify cter 50", lambda t: ["classify", "--run", str(_run_dir(t, SPEC)), "--cter-min", "50"], "cter_min"),
    (
        "classify important negative",
        lambda t: ["classify", "--run", str(_run_dir(t, SPEC)), "--important", "-1"],
        "important must be",
    ),
    (
        "classify heads.nc with renamed dims",
        lambda t: ["classify", "--run", str(_run_with_renamed_heads(t))],
        "results/heads.nc: 'effect' is over the dims ['lyr', 'head'], not ['layer', 'head']",
    ),
    (
        "report heads.csv without class",
        lambda t: ["report", "--run", str(_heads_csv(_run_dir(t, SPEC), "layer,head,importance\n0,0,0.5\n"))],
        "lacks the columns ['class']",
    ),
    ("toy train steps negative", lambda t: ["toy", "train", "--out", str(t / "out"), "--steps", "-5"], "steps must be"),
    (
        "finetune into its own circuit",
        lambda t: ["finetune", "--circuit", str(c := _circuit(t)), "--out", str(c / ".")],
        "is the discover run itself",
    ),
    (
        "finetune lr negative",
        lambda t: ["finetune", "--circuit", str(_circuit(t)), "--lr", "-1e-3", "--out", str(t / "out")],
        "lr must be a finite number > 0",
    ),
    (
        "finetune FSC-147 without its images",
        lambda t: [
            "finetune",
            "--circuit",
            str(_circuit(t)),
            "--preset",
            "counting-to-four",
            "--fsc147",
            str(_fsc147_without_images(t)),
            "--out",
            str(t / "out"),
        ],
        "2 of the 2 images of split 'train' are missing",
    ),
    (
        "finetune MMMU answer not an option",
        lambda t: [
            "finetune",
            "--circuit",
            str(_circuit(t)),
            "--mmmu",
            str(_mmmu_answer_e(t)),
            "--out",
            str(t / "out"),
        ],
        "row 0: the answer 'E' is not the letter of one of its 4 options",
    ),
    (
        "finetune MathVista without a column",
        lambda t: ["finetune", "--circuit", str(_circuit(t)), "--mathvista", str(_mathvista_no_type(t))],
        "pid '2': field 'answer_type' is missing",
    ),
]

SPEC = {"model": "toy", "arch": "qwen2_vl"}


def _checkpoint(tmp: Path, config: str | None) -> Path:
    """The organism's config and processor files (no weights) with ``config`` as config.json (None:
    the organism's without its vision_config)."""
    where = tmp / "checkpoint"
    shutil.copytree(TOY_DIR, where, ignore=shutil.ignore_patterns("*.safetensors"))
    if config is None:
        config = json.loads((where / "config.json").read_text())
        del config["vision_config"]
        config = json.dumps(config)
    (where / "config.json").write_text(config)
    return where


def _patch_8_copy(tmp: Path) -> Path:
    """The organism, weights and all, its processor cutting 8 px patches for a tower of 16 px ones."""
    return _edited(TOY_DIR, tmp / "patch_8", _patch_8, weights=True, file="preprocessor_config.json")


def _run_with_renamed_heads(tmp: Path) -> Path:
    """A finished run's results as `countlens classify` reads them (2 layers × 2 heads, 3 samples; the
    stages it does not read empty), its heads.nc's ``layer`` dim renamed ``lyr``."""
    from countlens.pipeline.stages import REQUIRED

    run = _run_dir(tmp, SPEC)
    lh, lhs = ("layer", "head"), ("layer", "head", "sample")
    coords = {"layer": [0, 1], "head": [0, 1]}
    made = {
        "heads": xr.Dataset(
            {"effect": (lh, np.full((2, 2), 0.5)), "logit_diff": ((*lh, "pair"), np.ones((2, 2, 2)))}, coords=coords
        ).rename({"layer": "lyr"}),
        "ablation": xr.Dataset(
            {"logp_drop": (("task", *lh), np.zeros((1, 2, 2)))}, coords={**coords, "task": ["count"]}
        ),
        "headlens": xr.Dataset(
            {
                **{name: (lh, np.full((2, 2), 0.5)) for name in ("vgs", "cter", "difficulty")},
                "token_id": ((*lhs, "k"), np.ones((2, 2, 3, 2), dtype=int)),
                "token": ((*lhs, "k"), np.full((2, 2, 3, 2), "3")),
                "count_token": ("sample", np.ones(3, dtype=int)),
            },
            coords=coords,
        ),
        "attention": xr.Dataset({"image_attention": (lhs, np.full((2, 2, 3), 0.5))}, coords=coords),
    }
    for stage in REQUIRED:
        results.save(made.get(stage, xr.Dataset()), run / "results" / f"{stage}.nc")
    return run


def _quantised() -> str:
    """The organism's config.json with a bitsandbytes quantization_config."""
    config = json.loads((TOY_DIR / "config.json").read_text())
    _bitsandbytes(config)
    return json.dumps(config)


def _heads_csv(run: Path, text: str) -> Path:
    (run / "heads.csv").write_text(text)
    return run


def _circuit(tmp: Path) -> Path:
    return _heads_csv(_run_dir(tmp, SPEC), "head_id,layer,head,class,importance\nL0H0,0,0,other,0.5\n")


def _fsc147_without_images(tmp: Path) -> Path:
    root = tmp / "fsc147"
    root.mkdir()
    (root / "annotation_FSC147_384.json").write_text(json.dumps({f"{i}.jpg": {"points": [[1, 1]]} for i in (1, 2)}))
    (root / "Train_Test_Val_FSC_147.json").write_text(json.dumps({"train": ["1.jpg", "2.jpg"], "val": [], "test": []}))
    return root


def _mmmu_answer_e(tmp: Path) -> Path:
    rows = mmmu_rows()
    rows[0]["answer"] = "E"
    return mmmu_copy(tmp, {"Math": rows})


def _mathvista_no_type(tmp: Path) -> Path:
    records = {r["pid"]: {**r, "image": "1.png"} for r in mathvista_rows()}
    del records["2"]["answer_type"]
    png(tmp / "mathvista" / "1.png")
    (tmp / "mathvista" / "testmini.json").write_text(json.dumps(records))
    return tmp / "mathvista" / "testmini.json"


def test_discover_reads_every_record_of_a_local_copy_before_its_spec(tmp_path, loaded):
    """A CLEVR question (the run's second) whose program names an object its scene lacks: refused
    before spec.json, naming the file, the question and the step."""
    from countlens.datasets.loaders import LoaderError
    from countlens.pipeline.discover import discover

    root = clevr_root(tmp_path)
    file = root / "questions" / "CLEVR_val_questions.json"
    data = json.loads(file.read_text())
    data["questions"][2]["program"][1]["value_inputs"] = ["purple"]  # no purple object in image 1
    file.write_text(json.dumps(data))
    config = DiscoverConfig(n_per_case=1, n_pairs=2, n_samples=2, tasks=("count", "spatial"), spatial=str(root))
    with pytest.raises(LoaderError, match=r"CLEVR_val_questions\.json: question 2: .*step 3 \(unique\) finds 0"):
        discover(loaded("toy"), tmp_path / "run", config)
    assert not (tmp_path / "run").exists()


def _garbage_circuit(tmp: Path) -> Path:
    run = _run_dir(tmp, None)
    (run / "heads.csv").write_text("this,is\nnot,a head table\n")
    return run


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(case, tmp_path):
    _, argv, text = case
    (tmp_path / "a_file").write_text("x")
    args = argv(tmp_path)
    before = _listing(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and text in result.output, result.output
    assert result.output.strip().count("\n") == 0, result.output  # one line
    assert _listing(tmp_path) == before  # validated before anything was written


def _listing(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its modification time: what a refused command must leave alone."""
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_a_mislaunched_data_parallel_finetune_is_refused_before_anything(tmp_path):
    """WORLD_SIZE=2 without the launcher's rendezvous: refused at once, not after the baseline."""
    circuit = _circuit(tmp_path)
    before = _listing(tmp_path)
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "", "MASTER_PORT": ""}
    result = runner.invoke(app, ["finetune", "--circuit", str(circuit)], env=env)
    assert result.exit_code == 2 and "MASTER_ADDR and MASTER_PORT are not" in result.output, result.output
    assert _listing(tmp_path) == before


def test_discover_refuses_a_folder_it_did_not_make(tmp_path):
    """--out on a user's folder that holds a results/cases.nc of its own: refused, nothing added."""
    mine = tmp_path / "mine"
    (mine / "results").mkdir(parents=True)
    (mine / "results" / "cases.nc").write_bytes(b"not countlens's")
    before = _listing(tmp_path)
    result = runner.invoke(app, ["discover", "--out", str(mine)])
    assert result.exit_code == 2 and "no spec.json: it is not a countlens discover run" in result.output, result.output
    assert _listing(tmp_path) == before


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


def test_heads_are_accepted_as_pairs_or_as_the_labels_results_use(ctx):
    """The label results use ("L0H1": heads.csv, temperature.nc, the report) and (0, 1) are one head."""
    samples = ctx.samples[:2]
    by_label = circuits.ablate(ctx.toy, samples, ["L0H1", "L1H0"])
    by_pair = circuits.ablate(ctx.toy, samples, [(0, 1), (1, 0)])
    assert np.array_equal(by_label.logp.values, by_pair.logp.values) and by_label.attrs["heads"] == "L0H1,L1H0"
    assert not np.array_equal(by_label.logp.values, by_label.base_logp.values)  # the ablation did something
    base = score(ctx.toy, samples).p_gold.values
    with circuits.head_temperature(ctx.toy, {"L1H0": 3.0}):
        labelled = score(ctx.toy, samples).p_gold.values
    with circuits.head_temperature(ctx.toy, {(1, 0): 3.0}):
        paired = score(ctx.toy, samples).p_gold.values
    assert np.array_equal(labelled, paired) and not np.array_equal(labelled, base)


def test_a_prompt_the_model_does_not_answer_is_flagged(ctx):
    """The organism answers its short prompt; Pstd's "circle: 7" it cannot write, and scoring still
    picks a "prediction": `unanswered` says so (the report puts it at its top)."""
    from countlens.analysis.metrics import unanswered

    grid = ctx.toy.geometry
    short = score(ctx.toy, countingtricks(["1A", "4A"], 4, grid, prompt="short"))
    std = score(ctx.toy, countingtricks(["1A", "4A"], 4, grid, prompt="std"))
    assert unanswered(short) is None
    message = unanswered(std)
    assert message and "does not answer this prompt" in message and "candidate answers" in message


def test_discover_builds_every_stage_input_before_it_writes_its_spec(tmp_path, loaded):
    """On a 4×4 patch grid COUNTINGTRICKS' larger cases cannot be drawn: refused before spec.json,
    not when the cases stage comes (after the sweeps, on a sharded run)."""
    from countlens.pipeline.discover import discover

    with pytest.raises(CountlensError, match="fits only"):
        discover(loaded("llava"), tmp_path / "run", DiscoverConfig(n_per_case=1, n_pairs=2, n_samples=2))
    assert not (tmp_path / "run").exists()


def test_heads_given_as_a_numpy_table_or_one_list(ctx):
    rows = np.array([[0, 1], [1, 0]])
    assert circuits.sites.checked_heads(ctx.toy.arch, rows) == [(0, 1), (1, 0)]
    assert circuits.sites.checked_heads(ctx.toy.arch, [1, 0]) == [(1, 0)]  # one head, as a list
    with pytest.raises(InputError, match="'L3H2'"):
        circuits.sites.checked_heads(ctx.toy.arch, [np.array([True, False])])


def test_jaccard_clips_k_to_the_heads_and_says_so(ctx):
    """k above the model's 6 heads: every task's top k is every head, so each overlap is 1 — the
    result says which k it used, and a warning says why the overlaps mean nothing."""
    within = circuits.jaccard(ctx.scan, k=2)
    assert (within.attrs["k"], within.attrs["k_requested"]) == (2, 2)
    assert within.sel(task="count", task_other="color").item() == pytest.approx(1 / 3)  # {L1H2, L1H1} vs {L1H0, L1H1}
    with pytest.warns(UserWarning, match="k=100 is more than the model's 6 heads"):
        clipped = circuits.jaccard(ctx.scan, k=100)
    assert (clipped.attrs["k"], clipped.attrs["k_requested"]) == (6, 100)
    assert np.allclose(clipped.values, 1.0)


def test_experts_are_accepted_as_pairs_or_as_the_labels_results_write(ctx):
    """ablate_experts' own attr ("L1E0,L1E2") given back as the experts is the ablation it records."""
    samples = ctx.moe_samples
    means = circuits.expert_means(ctx.moe, samples)
    by_pair = circuits.ablate_experts(ctx.moe, samples, [(1, 0), (1, 2)], means=means)
    by_label = circuits.ablate_experts(ctx.moe, samples, by_pair.attrs["experts"].split(","), means=means)
    assert by_label.attrs["experts"] == "L1E0,L1E2"
    assert np.array_equal(by_label.logp.values, by_pair.logp.values)
    assert not np.array_equal(by_label.logp.values, by_label.base_logp.values)  # the ablation did something
    alone = circuits.ablate_experts(ctx.moe, samples, "L1E2", means=means)  # one expert given alone
    assert alone.attrs["experts"] == "L1E2"


def test_discover_reads_the_voc_lists_before_its_spec(tmp_path, loaded):
    """An empty VOC2007 trainval.txt: refused before spec.json, naming VOC2007 and the list — not at
    the probes stage, the run's last, where the rerun would meet the resume guard."""
    from benchmark_files import voc_root

    from countlens.datasets.loaders import LoaderError
    from countlens.pipeline.discover import discover

    voc = voc_root(tmp_path)
    (voc / "ImageSets" / "Main" / "trainval.txt").write_text("")
    config = DiscoverConfig(n_per_case=1, n_pairs=2, n_samples=2, probes=True, voc=str(voc))
    with pytest.raises(LoaderError, match=r"trainval\.txt: VOC2007's 'trainval' list names no images"):
        discover(loaded("toy"), tmp_path / "run", config)
    assert not (tmp_path / "run").exists()


def test_a_phi4_copy_without_audio_settings_loads(tmp_path, tiny_checkpoint):
    """Phi-4-multimodal's processor needs an audio feature extractor to build, which countlens never
    runs: a copy whose processor_config.json lacks the audio settings loads (the family's defaults),
    and its images are prepared as the full copy's are."""
    full = tiny_checkpoint("phi4_multimodal")
    copy = tmp_path / "phi4"
    shutil.copytree(full, copy)
    settings = json.loads((copy / "processor_config.json").read_text())
    del settings["audio_processor"]
    (copy / "processor_config.json").write_text(json.dumps(settings))
    vlm, whole = countlens.load(copy), countlens.load(full)
    image = Image.new("RGB", (64, 64), "white")
    a, b = (v.prepare([image], ["how many?"]) for v in (vlm, whole))
    assert a.inputs["input_ids"].tolist() == b.inputs["input_ids"].tolist()
