"""Real published checkpoint configs (tests/data/checkpoints, sources in its README.md), read by countlens.

No weights and no tokenizer: each config.json is read as countlens reads a checkpoint (`read_config`),
resolved (`spec_for`, `resolve`), and its model built on the meta device to check that every spec path
exists at every layer (as tests/unit/test_arch_matrix.py does on tiny models). The image tokens per
image are computed here from the preprocessor config's own numbers and compared with countlens's
sizing of an image processor built from that file (`countlens.model.processor_files._load_image_processor`).

The expected figures below are the models' published ones (layers, heads, hidden size), as the
README's table gives them with their sources; they are checked against the config's own fields too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from PIL import Image
from real_checkpoints import TOKENIZER_FROM, planning_dir
from typer.testing import CliRunner

from countlens.circuits.sites.positions import Objects
from countlens.cli import app
from countlens.datasets.scene import Obj, Scene
from countlens.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from countlens.model.arch import resolve, spec_for
from countlens.model.cells import object_coverage
from countlens.model.geometry import Geometry
from countlens.model.layouts import TILED
from countlens.model.loading import meta_vlm, read_config
from countlens.model.processor_files import _load_image_processor, load_processor
from countlens.model.sizing import default_size, fixed_size, is_dynamic, processed_size
from countlens.pipeline import plan
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.stages import STAGES

CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "checkpoints"


# Published figures: decoder layers, attention heads, kv heads, hidden size, image token id, ViT patch,
# patches merged per side (README.md names each figure's source; "the config's own" where none was read).
def _fig(arch, layers, heads, kv, d_model, image_token, patch, merge):
    return dict(
        arch=arch, layers=layers, heads=heads, kv=kv, d_model=d_model, image_token=image_token, patch=patch, merge=merge
    )


PUBLISHED = {
    "Qwen__Qwen2.5-VL-3B-Instruct": _fig("qwen2_5_vl", 36, 16, 2, 2048, 151655, 14, 2),
    "Qwen__Qwen2.5-VL-7B-Instruct": _fig("qwen2_5_vl", 28, 28, 4, 3584, 151655, 14, 2),
    "Qwen__Qwen3-VL-8B-Instruct": _fig("qwen3_vl", 36, 32, 8, 4096, 151655, 16, 2),
    "Qwen__Qwen3-VL-30B-A3B-Instruct": _fig("qwen3_vl_moe", 48, 32, 4, 2048, 151655, 16, 2),
    "Qwen__Qwen3.5-27B": _fig("qwen3_5", 64, 24, 4, 5120, 248056, 16, 2),
    "Qwen__Qwen3.5-35B-A3B": _fig("qwen3_5_moe", 40, 16, 2, 2048, 248056, 16, 2),
    "llava-hf__llava-1.5-7b-hf": _fig("llava", 32, 32, 32, 4096, 32000, 14, 1),
    "llava-hf__llava-onevision-qwen2-7b-ov-hf": _fig("llava_onevision", 28, 28, 4, 3584, 151646, 14, 1),
    "OpenGVLab__InternVL3-8B-hf": _fig("internvl", 28, 28, 4, 3584, 151667, 14, 2),
    "zai-org__GLM-4.1V-9B-Thinking": _fig("glm4v", 40, 32, 2, 4096, 151343, 14, 2),
    "mistralai__Mistral-Small-3.1-24B-Instruct-2503": _fig("mistral3", 40, 32, 8, 5120, 10, 14, 2),
    "meta-llama__Llama-3.2-11B-Vision-Instruct": _fig("mllama", 40, 32, 8, 4096, 128256, 14, 1),
    "google__gemma-4-26B-A4B": _fig("gemma4", 30, 16, 8, 2816, 258880, 16, 3),
    "google__gemma-4-26B-A4B-it": _fig("gemma4", 30, 16, 8, 2816, 258880, 16, 3),
    "HuggingFaceTB__SmolVLM-256M-Instruct": _fig("idefics3", 30, 9, 3, 576, 49190, 16, 4),
    "HuggingFaceTB__SmolVLM-500M-Instruct": _fig("idefics3", 32, 15, 5, 960, 49190, 16, 4),
    "HuggingFaceTB__SmolVLM-Instruct": _fig("idefics3", 24, 32, 32, 2048, 49153, 14, 3),
    "HuggingFaceTB__SmolVLM2-2.2B-Instruct": _fig("idefics3", 24, 32, 32, 2048, 49190, 14, 3),
}
# Remote-code checkpoints (``trust_remote_code``): what the refusal names instead.
REMOTE_CODE = {
    "OpenGVLab__InternVL3-8B": ("internvl_chat", "OpenGVLab/InternVL3-8B-hf"),
    "AIDC-AI__Ovis2-8B": ("ovis", "thisisiron/Ovis2-2B-hf .* no transformers conversion .*AIDC-AI/Ovis2-8B"),
}
# config.json's layer_types spellings → countlens's layer kinds.
KINDS = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}


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
    keys = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "kv": "num_key_value_heads"}
    keys["d_model"] = "hidden_size"
    own = {k: text[f] if f in text else getattr(config.text_config, f) for k, f in keys.items()}
    # Layer kinds, heads and head sizes from the config's own layer list: softmax layers have the attention
    # heads (Gemma 4's full layers its global_head_dim), linear ones their value heads, cross layers the
    # attention heads reading the image.
    n = own["layers"]
    types = text.get("layer_types") or ["full_attention"] * n
    cross = set(text.get("cross_attention_layers", ()))
    kinds = tuple("cross" if i in cross else KINDS[t] for i, t in enumerate(types))
    d_head = text.get("head_dim", own["d_model"] // own["heads"])
    heads = tuple(text["linear_num_value_heads"] if k == "linear" else own["heads"] for k in kinds)
    dims = tuple(
        text["linear_value_head_dim"]
        if k == "linear"
        else text.get("global_head_dim", d_head)
        if k == "full"
        else d_head
        for k in kinds
    )
    got = {"layers": arch.n_layers, "heads": arch.heads(_softmax_layer(arch)), "d_model": arch.d_model}
    assert got == {k: own[k] for k in got} == {k: want[k] for k in got}
    assert arch.n_kv_heads == own["kv"] == want["kv"]  # the most kv heads of any layer (Gemma 4's sliding ones)
    assert arch.kinds == kinds
    assert tuple(arch.heads(i) for i in range(n)) == heads and tuple(arch.head_dim(i) for i in range(n)) == dims
    assert arch.uniform_heads == (len(set(heads)) == len(set(dims)) == 1)
    image_token = raw.get("image_token_id", raw.get("image_token_index"))
    assert arch.image_token_id == image_token == want["image_token"]
    vision = raw["vision_config"]
    merge = vision.get("spatial_merge_size", raw.get("spatial_merge_size", raw.get("scale_factor")))
    merge = merge or vision.get("pooling_kernel_size") or round(1 / raw.get("downsample_ratio", 1))
    patch = vision["patch_size"]
    assert arch.patch_size == (patch[0] if isinstance(patch, list) else patch) == want["patch"]
    assert arch.merge_size == merge == want["merge"]


def _softmax_layer(arch) -> int:
    return next(i for i, k in enumerate(arch.kinds) if k in ("full", "sliding"))


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
        if arch.softmax(layer) and arch.kind(layer) != "cross":
            model.get_submodule(f"{arch.layer(layer)}.{spec.k_proj}")
    for path in (spec.final_norm, spec.lm_head, spec.vision_blocks, spec.projector, spec.vision_tower):
        model.get_submodule(path)
    assert len(model.get_submodule(spec.layers)) == arch.n_layers
    blocks = _raw(name)["vision_config"]
    assert len(model.get_submodule(spec.vision_blocks)) == blocks.get("depth", blocks.get("num_hidden_layers"))
    if arch.n_experts:  # every decoder layer of the MoE checkpoints here has its experts and router
        text = _raw(name)["text_config"]
        assert (arch.n_experts, arch.experts_top_k) == (text["num_experts"], text["num_experts_per_tok"])
        for layer in range(arch.n_layers):
            experts = model.get_submodule(f"{arch.layer(layer)}.{spec.moe.experts}")
            assert experts.gate_up_proj.shape[0] == arch.n_experts
            model.get_submodule(f"{arch.layer(layer)}.{spec.moe.router}")


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


@pytest.mark.parametrize("name", [n for n in sorted(PUBLISHED) if n.startswith("Qwen__Qwen") and "3.5" not in n])
@pytest.mark.parametrize("size", [(448, 448), (1000, 700), (4000, 3000)])
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


# Image tokens of the tiled and dynamic families, each computed here from the processor files' own fields
# (and config.json's patch and merge where the processor has none) and compared with what countlens
# prepares for one image of three sizes on the meta model (`VLM.prepare`: the image tokens it finds, which
# `countlens.model.layouts` checks against countlens's own tile grid or token grid, and those grids).
TOKEN_SIZES = [(448, 448), (1000, 700), (300, 1000)]  # (height, width)
#: Sizes past a bound of the family's rule: Mistral 3's and InternVL's largest (1540 px, 12 tiles), GLM-4.1V's
#: pixel budget at both ends (where its temporal frames count).
TOKEN_SIZES_OF = {
    "mistralai__Mistral-Small-3.1-24B-Instruct-2503": [(448, 448), (1000, 700), (4000, 3000)],
    "zai-org__GLM-4.1V-9B-Thinking": [(60, 90), (1000, 700), (4000, 3000)],
    "OpenGVLab__InternVL3-8B-hf": [(448, 448), (1000, 700), (4000, 3000)],
}
#: Fixed 384 px processors: SigLIP's 384 px is 27 whole 14 px patches and 6 px the tower's convolution drops
#: (`Geometry.dropped`). Their counts are checked against the processor itself too (`test_a_384_px_...`).
DROPPED_384 = {
    "HuggingFaceTB__SmolVLM-Instruct",
    "HuggingFaceTB__SmolVLM2-2.2B-Instruct",
    "llava-hf__llava-onevision-qwen2-7b-ov-hf",
}


def _smolvlm_tokens(name: str, h: int, w: int) -> tuple[tuple[int, int], int]:
    """(tile rows, cols), image tokens: the longest edge resized to size.longest_edge (which is whole tiles
    of max_image_size.longest_edge), the other side in proportion, each side cut into whole tiles (the last
    stretched); image_seq_len tokens per tile, and the whole image as one more tile when there are several."""
    pre, proc = _raw(name, "preprocessor_config.json"), _raw(name, "processor_config.json")
    longest, tile = pre["size"]["longest_edge"], pre["max_image_size"]["longest_edge"]
    assert pre["do_image_splitting"] and longest % tile == 0
    vision = _raw(name)["vision_config"]  # image_seq_len is a tile's patches pixel-shuffled by scale_factor
    assert proc["image_seq_len"] == (tile // vision["patch_size"] // _raw(name)["scale_factor"]) ** 2
    short = math.ceil(min(h, w) * longest / max(h, w) / tile)
    rows, cols = (longest // tile, short) if h >= w else (short, longest // tile)
    n = rows * cols
    return (rows, cols), proc["image_seq_len"] * (n + (n > 1))


def _mistral3_tokens(name: str, h: int, w: int) -> tuple[tuple[int, int], int]:
    """(rows, cols) of [IMG] tokens: shrunk (never enlarged) so the longest side fits size.longest_edge,
    then each side in whole patch × spatial_merge_size tokens, rounded up ([IMG_BREAK] / [IMG_END] are
    other tokens)."""
    pre, proc = _raw(name, "preprocessor_config.json"), _raw(name, "processor_config.json")
    unit, longest = proc["patch_size"] * proc["spatial_merge_size"], pre["size"]["longest_edge"]
    if max(h, w) > longest:
        h, w = math.floor(h * longest / max(h, w)), math.floor(w * longest / max(h, w))
    return (math.ceil(h / unit), math.ceil(w / unit)), math.ceil(h / unit) * math.ceil(w / unit)


def _glm4v_tokens(name: str, h: int, w: int) -> tuple[tuple[int, int], int]:
    """Qwen's pixel budget over the temporal_patch_size frames an image is repeated into: the image's own
    bounds are the budget's ÷ frames; one token per patch × merge square."""
    pre = _raw(name, "preprocessor_config.json")
    unit, frames = pre["patch_size"] * pre["merge_size"], pre["temporal_patch_size"]
    lo, hi = pre["size"]["shortest_edge"] / frames, pre["size"]["longest_edge"] / frames
    hb, wb = _budget_resize(h, w, unit, lo, hi)
    return (hb // unit, wb // unit), (hb // unit) * (wb // unit)


def _internvl_tokens(name: str, h: int, w: int) -> tuple[tuple[int, int], int]:
    """InternVL's dynamic tiling: of the grids of min_patches … max_patches tiles of size px, the one whose
    aspect is nearest the image's (a tie goes to the larger grid when the image has over half its area);
    each tile (size ÷ patch × downsample_ratio)² tokens, and a thumbnail after several. The preprocessor
    file says crop_to_patches false, but transformers' InternVLProcessor asks for it on every call."""
    pre, raw = _raw(name, "preprocessor_config.json"), _raw(name)
    assert pre["crop_to_patches"] is False  # overridden by the processor (see above)
    side, lo, hi = pre["size"]["height"], pre["min_patches"], pre["max_patches"]
    grids = sorted(
        {(i, j) for i in range(1, hi + 1) for j in range(1, hi + 1) if lo <= i * j <= hi}, key=lambda g: g[0] * g[1]
    )
    best, diff = (1, 1), math.inf
    for cols, rows in grids:
        d = abs(w / h - cols / rows)
        if d < diff:
            best, diff = (cols, rows), d
        elif d == diff and h * w > 0.5 * side * side * cols * rows:
            best = (cols, rows)
    cols, rows = best
    per_tile = round(side // raw["vision_config"]["patch_size"][0] * raw["downsample_ratio"]) ** 2
    return (rows, cols), per_tile * (rows * cols + (rows * cols > 1))


def _onevision_tokens(name: str, h: int, w: int) -> tuple[None, int]:
    """LLaVA-OneVision's anyres_max_9: the base image (num_image_tokens, SigLIP's 27 × 27), then the pinpoint
    that shows most of the image (least waste on a tie) as a grid of 384 px crops, their patches unpadded to
    the image's aspect, one newline per row, shrunk when over 9 base grids (the config's anyres_max_9)."""
    pre, proc = _raw(name, "preprocessor_config.json"), _raw(name, "processor_config.json")
    assert _raw(name)["vision_aspect_ratio"] == "anyres_max_9"
    base, side = proc["num_image_tokens"], pre["size"]["height"]
    best, most, waste = None, 0, math.inf
    for ph, pw in pre["image_grid_pinpoints"]:
        scale = min(pw / w, ph / h)
        shown = min(int(w * scale) * int(h * scale), w * h)
        if shown > most or (shown == most and ph * pw - shown < waste):
            best, most, waste = (ph, pw), shown, ph * pw - shown
    per = math.isqrt(base)
    rows, cols = per * (best[0] // side), per * (best[1] // side)
    if w / h > cols / rows:
        rows -= (rows - int(round(h * cols / w, 7))) // 2 * 2
    else:
        cols -= (cols - int(round(w * rows / h, 7))) // 2 * 2
    features, newlines = rows * cols, rows
    ratio = math.sqrt(rows * cols / (9 * per**2))
    if ratio > 1.1:
        features, newlines = int(rows // ratio) * int(cols // ratio), int(rows // ratio)
    return None, base + features + newlines


IMAGE_TOKENS = {
    "HuggingFaceTB__SmolVLM-256M-Instruct": _smolvlm_tokens,
    "HuggingFaceTB__SmolVLM-500M-Instruct": _smolvlm_tokens,
    "HuggingFaceTB__SmolVLM-Instruct": _smolvlm_tokens,
    "HuggingFaceTB__SmolVLM2-2.2B-Instruct": _smolvlm_tokens,
    "mistralai__Mistral-Small-3.1-24B-Instruct-2503": _mistral3_tokens,
    "zai-org__GLM-4.1V-9B-Thinking": _glm4v_tokens,
    "OpenGVLab__InternVL3-8B-hf": _internvl_tokens,
    "llava-hf__llava-onevision-qwen2-7b-ov-hf": _onevision_tokens,
}


def test_every_processor_file_has_an_image_token_test():
    with_processor = {n for n in PUBLISHED if (CHECKPOINTS / n / "preprocessor_config.json").exists()}
    others = {"llava-hf__llava-1.5-7b-hf"} | {n for n in with_processor if n.startswith("Qwen__")}
    assert with_processor == set(IMAGE_TOKENS) | others


def _image_cases():
    for name in sorted(IMAGE_TOKENS):
        for size in TOKEN_SIZES_OF.get(name, TOKEN_SIZES):
            yield pytest.param(name, size, id=f"{name}-{size[0]}x{size[1]}")


@pytest.mark.matrix
@pytest.mark.parametrize("name, size", list(_image_cases()))
def test_image_tokens_from_the_processor_files(name, size, planned_vlm):
    grid, expected = IMAGE_TOKENS[name](name, *size)
    vlm = planned_vlm(name, None)
    batch = vlm.prepare([Image.new("RGB", size[::-1])], ["How many?"])
    assert len(batch.image_pos[0]) == expected
    if vlm.arch.spec.layout in TILED:  # countlens's own tile grid (which its token map checked the count by)
        assert batch.tile_grids[0] == grid
    elif grid is not None:  # one grid of tokens: countlens's geometry for the image
        assert batch.geometry[0].token_grid == grid == vlm.geometry_for(*size).token_grid


@pytest.mark.parametrize("name", sorted(DROPPED_384))
def test_a_384_px_processor_counts_are_its_own_and_countlens_s(name, plannable, planned_vlm):
    """The counts above are the processor's own (transformers, no countlens) and countlens's: the checkpoint's
    384 px tile (crop) is 27 whole 14 px patches and 6 px the tower drops (`Geometry.dropped`), 27 // merge
    tokens a side, covering the top-left 378 px."""
    path = str(plannable(name))
    processor = load_processor(path, read_config(path))
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    vlm, merge = planned_vlm(name, None), PUBLISHED[name]["merge"]
    assert vlm.geometry == Geometry.square(384, 14, merge, dropped=True) == vlm.geometry_for(1000, 700)
    assert vlm.geometry.token_grid == (27 // merge, 27 // merge) and vlm.geometry.seen == (378, 378)
    for size in TOKEN_SIZES:
        image = Image.new("RGB", size[::-1])
        ids = processor(text=[f"{processor.image_token} How many?"], images=[[image]])
        own = sum(t == image_token for t in ids["input_ids"][0])
        assert own == len(vlm.prepare([image], ["How many?"]).image_pos[0]) == IMAGE_TOKENS[name](name, *size)[1]


def test_onevision_s_384_px_cells_and_object_positions_by_hand(planned_vlm):
    """LLaVA-OneVision, a 384 px image: the base image's 27 × 27 tokens, then one 384 px crop's 27 rows of 27
    tokens and a newline. A square over pixels 140 … 168 × 42 … 70 covers the cells (3, 10), (3, 11), (4, 10),
    (4, 11) (14 px each, from 0: the patch convolution's own cells), so its tokens are those of the base grid
    and of the crop; a dot lying only in the last 6 px, which the tower drops, has no token."""
    vlm = planned_vlm("llava-hf__llava-onevision-qwen2-7b-ov-hf", None)
    square, dot = Obj("square", "red", 154.0, 56.0, 28.0), Obj("circle", "blue", 381.0, 200.0, 5.0)
    sample = SimpleNamespace(scene=Scene(384, 384, (square, dot)))
    batch = vlm.prepare([sample.scene.render()], ["How many?"])
    pos, cells = batch.image_pos[0], batch.image_cell[0]
    assert len(pos) == 27 * 27 + 27 * 28
    base = [27 * r + c for r in (3, 4) for c in (10, 11)]
    crop = [27 * 27 + 28 * r + c for r in (3, 4) for c in (10, 11)]
    assert cells[base + crop].tolist() == [[r, c] for r in (3, 4) for c in (10, 11)] * 2
    assert Objects(0).tokens(batch, 0, sample).tolist() == pos[base + crop].tolist()
    assert Objects(1, coverage=0).tokens(batch, 0, sample).tolist() == []
    # The square's cells cut on the seen 378 px (14 px each), not on all 384 px (14.2 px each).
    coverage = object_coverage(sample.scene, batch.geometry[0])
    assert coverage[0, 3:5, 10:12].min() == 1 and coverage[0].sum() == 4 and coverage[1].sum() == 0


@pytest.mark.parametrize("name", sorted(REMOTE_CODE))
def test_remote_code_checkpoint_is_refused(name):
    assert _raw(name)["model_type"] == REMOTE_CODE[name][0] and "auto_map" in _raw(name)
    with pytest.raises(UnsupportedArchitectureError):
        read_config(_dir(name))


@pytest.mark.parametrize("name", sorted(REMOTE_CODE))
def test_remote_code_refusal_names_the_converted_checkpoint(name):
    with pytest.raises(UnsupportedArchitectureError, match=REMOTE_CODE[name][1]):
        read_config(_dir(name))


# `countlens plan` on the real configs: every stage sized in bf16 on an 80 GiB and a 141 GiB device, at the
# processor's own image size and at 448 px, both devices from one planner (`plan.plans`). A small discover
# run (2 scenes per case, 4 pairs, 4 samples, batches of 2) keeps the test fast: each stage still prepares
# its first batch and sizes its forwards. The batch is 2, not discover's 16: the image processor's work
# (17 tiles of 512 px an image for SmolVLM-256M) grows with it, and no check below depends on it.
SMALL = DiscoverConfig(n_per_case=2, n_pairs=4, n_samples=4, batch_size=2)
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
        key = (name, side or _native(name)[0])
        if key not in made:
            made[key] = meta_vlm(str(plannable(name)), dtype="bfloat16", image_size=side)
        return made[key]

    return get


def _native(name: str) -> tuple[int, int, str]:
    """(side, patches per image, kind) of the image the plan should size, from the checkpoint's own files:
    a fixed processor's crop or size ("fixed"), a pixel budget's assumed 448 px ("budget"), Mistral 3's
    longest edge (pinnable to a square), Gemma 4's most pooled tokens of a square ("own budget"); tiled
    processors count every tile's patches (Llama-3.2: each tile's and its class token; SmolVLM: longest
    edge ÷ tile, squared, and the global image); LLaVA-OneVision's anyres its image tokens (the base grid,
    then the crop's rows and their newlines: the plan sizes the tower by image tokens × merge²)."""
    raw = _raw(name)
    vision = raw["vision_config"]
    patch = vision["patch_size"][0] if isinstance(vision["patch_size"], list) else vision["patch_size"]
    path = CHECKPOINTS / name / "preprocessor_config.json"
    pre = json.loads(path.read_text()) if path.exists() else {}
    if "image_grid_pinpoints" in pre:  # LLaVA-OneVision's anyres: a square image of its size is one crop
        side = pre["size"]["height"]
        return side, _onevision_tokens(name, side, side)[1], "fixed"
    if raw["model_type"] == "mllama":  # no processor file: the config's tile side and tile count
        side = vision["image_size"]
        return side, vision["max_num_tiles"] * ((side // patch) ** 2 + 1), "fixed"
    if raw["model_type"] == "gemma4":  # no processor file: the config's default budget of pooled tokens
        per_side = math.isqrt(vision["default_output_length"])
        side = per_side * patch * vision["pooling_kernel_size"]
        return side, (side // patch) ** 2, "own budget"
    if "longest_edge" in pre.get("size", {}) and "max_image_size" in pre:  # Idefics3 / SmolVLM tiles
        tile = pre["max_image_size"]["longest_edge"]
        return tile, ((pre["size"]["longest_edge"] // tile) ** 2 + 1) * (tile // patch) ** 2, "fixed"
    if list(pre.get("size", {})) == ["longest_edge"]:  # Mistral 3
        side = pre["size"]["longest_edge"]
        return side, (side // patch) ** 2, "longest edge"
    crop = pre.get("crop_size")
    if pre.get("do_center_crop") and crop:
        side = crop["height"] if isinstance(crop, dict) else crop
    elif "height" in pre.get("size", {}):
        side = pre["size"]["height"]
    else:
        return 448, (448 // patch) ** 2, "budget"
    return side, (side // patch) ** 2, "fixed"


#: Planned at their native size only in `make test` (-m slow): SmolVLM-256M / 500M's 17 tiles of 512 px per
#: image take about 8 s per plan on one core, SmolVLM-Instruct's and SmolVLM2-2.2B's 17 tiles of 384 px about
#: 6.5 s (Mistral 3's 1540 px images, 3 s, run in both).
SLOW_PLANS = {
    "HuggingFaceTB__SmolVLM-256M-Instruct",
    "HuggingFaceTB__SmolVLM-500M-Instruct",
    "HuggingFaceTB__SmolVLM-Instruct",
    "HuggingFaceTB__SmolVLM2-2.2B-Instruct",
}


def _plan_cases():
    for name in sorted(TOKENIZER_FROM):
        for side in (None, 448):
            marks = [pytest.mark.slow] if name in SLOW_PLANS and side is None else []
            yield pytest.param(name, side, marks=marks)


@pytest.mark.matrix
@pytest.mark.parametrize("name, side", list(_plan_cases()))
def test_plan_sizes_every_stage_in_bf16_on_80_and_141_gib(name, side, plannable, planned_vlm):
    native, patches, kind = _native(name)
    if side is not None and side != native and kind not in ("budget", "longest edge"):
        # A fixed processor takes its own size only; a budget of its own cannot be pinned to a square.
        said = f"resizes every image to {native}×{native}" if kind == "fixed" else "by its own token budget"
        with pytest.raises(ConfigError, match=f"{said}.*leave --image-size unset"):
            meta_vlm(str(plannable(name)), dtype="bfloat16", image_size=side)
        return
    vlm = planned_vlm(name, side)
    arch_patch = vlm.arch.patch_size
    params = sum(t.numel() for t in vlm.hf.parameters())
    stages = [s.name for s in STAGES if s.plan is not None and s.enabled(SMALL)]
    rows = {}
    sizes = (80, 141)
    for gib, p in zip(sizes, plan.plans(vlm, SMALL, memories=[g * GIB for g in sizes], device="cuda"), strict=True):
        assert p.memory == gib * GIB
        at_448 = side is not None and kind in ("budget", "longest edge")
        assert (p.image_size, p.patches) == ((448, (448 // arch_patch) ** 2) if at_448 else (native, patches))
        assert 2 * params <= p.widths.weight_bytes < 2.001 * params  # bf16 parameters (and a few buffers)
        assert [s.name for s in p.stages] == stages
        for s in p.stages:
            assert p.widths.weight_bytes < p.peak(s), s.name
            assert p.flops(s) > 0, s.name
        # Every stage printed; those over the device named as over, and only those.
        assert sorted(p.over()) == sorted(s.name for s in p.stages if p.peak(s) > p.memory)
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
