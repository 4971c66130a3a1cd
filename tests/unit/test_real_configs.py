"""Real published checkpoint configs (tests/data/checkpoints, sources in its README.md), read by countlens.

No weights and no tokenizer: each config.json is read as countlens reads a checkpoint (`read_config`),
resolved (`spec_for`, `resolve`), and its model built on the meta device to check that every spec path
exists at every layer (as tests/unit/test_arch_matrix.py does on tiny models). The image tokens per
image are computed here from the preprocessor config's own numbers and compared with countlens's
sizing of an image processor built from that file (`countlens.processor_files._load_image_processor`).

The expected figures below are the models' published ones (layers, heads, hidden size), as the
README's table gives them with their sources; they are checked against the config's own fields too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from real_checkpoints import TOKENIZER_FROM, planning_dir
from typer.testing import CliRunner

from countlens.arch import resolve, spec_for
from countlens.cli import app
from countlens.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from countlens.geometry import Geometry
from countlens.loading import meta_vlm, read_config
from countlens.pipeline import plan
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.stages import STAGES
from countlens.processor_files import _load_image_processor
from countlens.sizing import default_size, fixed_size, is_dynamic, processed_size

CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "checkpoints"

# Published figures: decoder layers, attention heads, kv heads, hidden size, image token id, ViT patch,
# patches merged per side (README.md names each figure's source).
PUBLISHED = {
    "Qwen__Qwen2.5-VL-3B-Instruct": dict(
        arch="qwen2_5_vl", layers=36, heads=16, kv=2, d_model=2048, image_token=151655, patch=14, merge=2
    ),
    "Qwen__Qwen2.5-VL-7B-Instruct": dict(
        arch="qwen2_5_vl", layers=28, heads=28, kv=4, d_model=3584, image_token=151655, patch=14, merge=2
    ),
    "Qwen__Qwen3-VL-8B-Instruct": dict(
        arch="qwen3_vl", layers=36, heads=32, kv=8, d_model=4096, image_token=151655, patch=16, merge=2
    ),
    "llava-hf__llava-1.5-7b-hf": dict(
        arch="llava", layers=32, heads=32, kv=32, d_model=4096, image_token=32000, patch=14, merge=1
    ),
}
# Remote-code checkpoints (``trust_remote_code``) whose transformers conversion countlens supports.
REMOTE_CODE = {"OpenGVLab__InternVL3-8B": "OpenGVLab/InternVL3-8B-hf"}


def _dir(name: str) -> str:
    return str(CHECKPOINTS / name)


def _raw(name: str, file: str = "config.json") -> dict:
    return json.loads((CHECKPOINTS / name / file).read_text())


def test_every_config_directory_is_tested():
    dirs = {p.name for p in CHECKPOINTS.iterdir() if p.is_dir()}
    assert dirs == set(PUBLISHED) | set(REMOTE_CODE)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_resolve_matches_the_config_and_the_published_figures(name):
    want = PUBLISHED[name]
    config = read_config(_dir(name))
    spec, arch = spec_for(config), resolve(config)
    assert spec.name == arch.name == want["arch"]
    # The config's own fields (LLaVA's text_config leaves the Llama defaults implicit: transformers' value).
    raw = _raw(name)
    text = raw.get("text_config", raw)
    own = {
        "layers": text.get("num_hidden_layers", config.text_config.num_hidden_layers),
        "heads": text.get("num_attention_heads", config.text_config.num_attention_heads),
        "kv": text.get("num_key_value_heads", config.text_config.num_key_value_heads),
        "d_model": text.get("hidden_size", config.text_config.hidden_size),
    }
    got = {"layers": arch.n_layers, "heads": arch.n_heads, "kv": arch.n_kv_heads, "d_model": arch.d_model}
    assert got == own
    assert got == {k: want[k] for k in got}
    assert arch.kinds == ("full",) * arch.n_layers and arch.uniform_heads
    assert arch.d_head == text.get("head_dim", own["d_model"] // own["heads"])
    image_token = raw.get("image_token_id", raw.get("image_token_index"))
    assert arch.image_token_id == image_token == want["image_token"]
    vision = raw["vision_config"]
    assert arch.patch_size == vision["patch_size"] == want["patch"]
    assert arch.merge_size == vision.get("spatial_merge_size", 1) == want["merge"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_spec_path_exists_at_every_layer_of_the_meta_model(name):
    config = read_config(_dir(name))
    spec, arch = spec_for(config), resolve(config)
    with torch.device("meta"):
        model = getattr(transformers, spec.loader).from_config(config)
    for layer in range(arch.n_layers):
        softmax = (arch.q_site(layer),) if arch.softmax(layer) else ()
        for path in (arch.layer(layer), *softmax, arch.o_proj(layer), arch.attention(layer)):
            model.get_submodule(path)  # raises AttributeError when a path is wrong
        assert model.get_submodule(arch.o_proj(layer)).in_features == arch.heads(layer) * arch.head_dim(layer)
        model.get_submodule(f"{arch.layer(layer)}.{spec.k_proj}")
    for path in (spec.final_norm, spec.lm_head, spec.vision_blocks, spec.projector, spec.vision_tower):
        model.get_submodule(path)
    assert len(model.get_submodule(spec.layers)) == arch.n_layers
    blocks = _raw(name)["vision_config"]
    assert len(model.get_submodule(spec.vision_blocks)) == blocks.get("depth", blocks.get("num_hidden_layers"))


def _budget_resize(h: int, w: int, unit: int, lo: int, hi: int) -> tuple[int, int]:
    """Qwen's pixel-budget rule, written out from its description: each side rounded to the unit, then
    scaled (keeping the aspect) into [lo, hi] pixels, rounding down when shrinking, up when enlarging."""
    hb, wb = max(unit, round(h / unit) * unit), max(unit, round(w / unit) * unit)
    if hb * wb > hi:
        beta = math.sqrt(h * w / hi)
        hb, wb = max(unit, math.floor(h / beta / unit) * unit), max(unit, math.floor(w / beta / unit) * unit)
    elif hb * wb < lo:
        beta = math.sqrt(lo / (h * w))
        hb, wb = math.ceil(h * beta / unit) * unit, math.ceil(w * beta / unit) * unit
    return hb, wb


def test_llava_1_5_image_tokens_from_its_preprocessor_config():
    name = "llava-hf__llava-1.5-7b-hf"
    pre, proc = _raw(name, "preprocessor_config.json"), _raw(name, "processor_config.json")
    side = pre["crop_size"]["height"]  # resized to shortest_edge 336, then centre-cropped to 336 × 336
    assert pre["size"]["shortest_edge"] == side == pre["crop_size"]["width"]
    expected = (side // proc["patch_size"]) ** 2  # 336 / 14 = 24 per side
    assert expected == 576
    # The processor counts the CLS token too and drops it for the "default" feature strategy.
    assert proc["vision_feature_select_strategy"] == "default" and proc["num_additional_image_tokens"] == 1
    arch = resolve(read_config(_dir(name)))
    ip = _load_image_processor(_dir(name))
    assert not is_dynamic(ip)
    assert fixed_size(ip) == default_size(ip, arch.patch_size * arch.merge_size) == (side, side)
    rows, cols = Geometry.square(side, arch.patch_size, arch.merge_size).token_grid
    assert rows * cols == expected


@pytest.mark.parametrize("name", ["Qwen__Qwen2.5-VL-7B-Instruct", "Qwen__Qwen3-VL-8B-Instruct"])
@pytest.mark.parametrize("size", [(448, 448), (336, 336), (1000, 700), (40, 40), (4000, 3000)])
def test_qwen_image_tokens_from_its_preprocessor_config(name, size):
    pre = _raw(name, "preprocessor_config.json")
    # Qwen2.5-VL names its budget min_pixels / max_pixels, Qwen3-VL size.shortest_edge / longest_edge.
    lo = pre.get("min_pixels", pre.get("size", {}).get("shortest_edge"))
    hi = pre.get("max_pixels", pre.get("size", {}).get("longest_edge"))
    unit = pre["patch_size"] * pre["merge_size"]
    h, w = _budget_resize(*size, unit, lo, hi)
    expected = (h // unit) * (w // unit)
    arch = resolve(read_config(_dir(name)))
    assert arch.patch_size * arch.merge_size == unit
    ip = _load_image_processor(_dir(name))
    assert is_dynamic(ip)
    assert processed_size(ip, *size, unit) == (h, w)
    rows, cols = Geometry(h, w, arch.patch_size, arch.merge_size).token_grid
    assert rows * cols == expected


@pytest.mark.parametrize(
    "name, side, tokens",
    [("Qwen__Qwen2.5-VL-7B-Instruct", 448, 256), ("Qwen__Qwen3-VL-8B-Instruct", 448, 196)],
)
def test_qwen_default_square_image(name, side, tokens):
    """countlens's assumed image for a dynamic processor (448 px): 448 / 28 = 16 per side for Qwen2.5-VL,
    448 / 32 = 14 for Qwen3-VL (patch 16)."""
    arch = resolve(read_config(_dir(name)))
    unit = arch.patch_size * arch.merge_size
    ip = _load_image_processor(_dir(name))
    assert default_size(ip, unit) == (side, side)
    rows, cols = Geometry.square(side, arch.patch_size, arch.merge_size).token_grid
    assert rows * cols == tokens


@pytest.mark.parametrize("name", sorted(REMOTE_CODE))
def test_remote_code_checkpoint_is_refused(name):
    assert _raw(name)["model_type"] == "internvl_chat"
    with pytest.raises(UnsupportedArchitectureError):
        read_config(_dir(name))


@pytest.mark.parametrize("name", sorted(REMOTE_CODE))
def test_remote_code_refusal_names_the_converted_checkpoint(name):
    with pytest.raises(UnsupportedArchitectureError, match=REMOTE_CODE[name]):
        read_config(_dir(name))


# `countlens plan` on the real configs: every stage sized in bf16 on an 80 GiB and a 141 GiB device, at the
# processor's own image size and at 448 px. A small discover run (2 scenes per case, 4 pairs, 4 samples)
# keeps the test fast: each stage still prepares its batch and sizes its forwards; batch 16 as by default.
SMALL = DiscoverConfig(n_per_case=2, n_pairs=4, n_samples=4, batch_size=16)
GIB = 1 << 30


@pytest.fixture(scope="module")
def plannable(tiny_checkpoint, tmp_path_factory):
    """``plannable(name)``: checkpoint ``name``'s published files with a stand-in tokenizer
    (`real_checkpoints.planning_dir`), made once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = planning_dir(name, tiny_checkpoint(TOKENIZER_FROM[name]), tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def planned_vlm(plannable):
    """``planned_vlm(name, side)``: the meta model and processor of ``name`` pinned to ``side`` px,
    built once per module (a dynamic processor's own size is 448 px: the same model as ``side=448``)."""
    made: dict[tuple, object] = {}

    def get(name: str, side: int | None):
        key = (name, side or _native_side(name)[0])
        if key not in made:
            made[key] = meta_vlm(str(plannable(name)), dtype="bfloat16", image_size=side)
        return made[key]

    return get


def _native_side(name: str) -> tuple[int, bool]:
    """The processor's own square side and whether it is fixed, read from the preprocessor config:
    a fixed processor's crop (LLaVA-1.5: 336), else countlens's assumed 448 px for a pixel budget."""
    pre = _raw(name, "preprocessor_config.json")
    crop = pre.get("crop_size")
    if pre.get("do_center_crop") and crop:
        return (crop["height"] if isinstance(crop, dict) else crop), True
    return 448, False


@pytest.mark.parametrize("side", [None, 448])
@pytest.mark.parametrize("name", sorted(TOKENIZER_FROM))
def test_plan_sizes_every_stage_in_bf16_on_80_and_141_gib(name, side, plannable, planned_vlm):
    native, fixed = _native_side(name)
    if side is not None and fixed and side != native:  # LLaVA-1.5's processor takes 336 px only
        with pytest.raises(ConfigError, match=f"resizes every image to {native}×{native}; leave --image-size unset"):
            meta_vlm(str(plannable(name)), dtype="bfloat16", image_size=side)
        return
    vlm = planned_vlm(name, side)
    want_side = side or native
    patch = _raw(name)["vision_config"]["patch_size"]
    params = sum(t.numel() for t in vlm.hf.parameters())
    stages = [s.name for s in STAGES if s.plan is not None and s.enabled(SMALL)]
    rows = {}
    for gib in (80, 141):
        p = plan.plan(vlm, SMALL, memory=gib * GIB, device="cuda")
        assert (p.image_size, p.patches) == (want_side, (want_side // patch) ** 2)
        assert 2 * params <= p.widths.weight_bytes < 2.001 * params  # bf16 parameters (and a few buffers)
        assert [s.name for s in p.stages] == stages
        for s in p.stages:
            assert p.widths.weight_bytes < p.peak(s) <= p.memory, s.name  # every stage fits (7-8B in bf16)
            assert p.flops(s) > 0, s.name
        assert p.over() == []
        rows[gib] = {s.name: max(f.rows for f in s.forwards) for s in p.stages}
    assert all(rows[80][k] <= rows[141][k] for k in stages)  # less memory never stacks more rows


def test_plan_command_on_a_real_config(plannable):
    name = "Qwen__Qwen2.5-VL-7B-Instruct"
    args = ["plan", "--model", str(plannable(name)), "--image-size", "448", "--memory", "80", "--device", "cuda"]
    args += ["--dtype", "bfloat16", "--n-per-case", "2", "--n-pairs", "4", "--n-samples", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "with 80.0 GiB" in result.output and "448 px images (1024 patches each)" in result.output
    for stage in (s.name for s in STAGES if s.plan is not None and s.enabled(SMALL)):
        assert f"| {stage} " in result.output
    assert "over 80.0 GiB" not in result.output


@pytest.mark.parametrize("name", sorted(TOKENIZER_FROM))
def test_plan_of_a_config_only_directory_names_the_missing_tokenizer(name):
    """A published config without its tokenizer (as stored here) was an 'internal error in countlens'
    (a ValueError from transformers: no chat template, or no tokenizer to instantiate)."""
    with pytest.raises(CheckpointError, match="no tokenizer files .*copy the checkpoint's tokenizer files"):
        meta_vlm(_dir(name), dtype="bfloat16")


def test_plan_of_a_directory_without_chat_template_names_it(plannable, tmp_path):
    name = "Qwen__Qwen2.5-VL-7B-Instruct"
    for f in plannable(name).iterdir():
        if f.name != "chat_template.jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no chat template"):
        meta_vlm(str(tmp_path), dtype="bfloat16")
