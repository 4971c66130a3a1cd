"""Every supported architecture, as a tiny random-init model saved to disk and loaded by countlens.

Checks: load and spec resolution; module paths exist; image-token positions agree with the
processor's own count; each image token's grid cell maps back to its image region (a bright
square lights up the expected token in the LM input); a trace equals the plain HF forward.
"""

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import TINY_IMAGE_SIZE, TINY_NAMES

from countlens.model.arch import SPECS
from countlens.model.layouts import TILED, token_cells
from countlens.model.processors import useful_grid

#: Every spec of the registry (`countlens.model.families`), each a tiny model (`countlens.toy.tiny_models`).
SUPPORTED = tuple(SPECS)
# Tiny models beside SUPPORTED's that load under a spec of another name: InternVL3.5 (Qwen3 text, a
# q-norm) under "internvl", SmolVLM (SmolLM2 text, its own processor) under "idefics3". The cheap
# checks of this file run on them too.
VARIANTS = {"internvl3_5": "internvl", "smolvlm": "idefics3"}
QUESTION = "how many circles are there?"


@pytest.fixture(scope="module", params=SUPPORTED + tuple(VARIANTS))
def vlm(request, loaded):
    model = loaded(request.param)
    model.tiny_name = request.param  # the tiny model's name (TINY_IMAGE_SIZE's key)
    return model


def images_of(name: str, n: int = 2, cell=None, geometry=None, size=None):
    h, w = size or TINY_IMAGE_SIZE[name]
    out = []
    for _ in range(n):
        a = np.zeros((h, w, 3), np.uint8)
        if cell is not None:
            rows, cols = geometry.token_grid
            sy, sx = h // rows, w // cols
            a[cell[0] * sy : (cell[0] + 1) * sy, cell[1] * sx : (cell[1] + 1) * sx] = 255
        out.append(Image.fromarray(a))
    return out


def test_every_spec_is_in_the_matrix():
    assert set(SPECS) == set(SUPPORTED)
    missing = sorted(set(SUPPORTED) - set(TINY_NAMES))
    assert not missing, f"specs without a tiny model in countlens/toy/tiny_models/ (a family's BUILDERS): {missing}"


def test_every_family_module_has_its_tiny_builder_module():
    """The tiny models mirror the house: `countlens/model/families/<family>.py` has
    `countlens/toy/tiny_models/<family>.py`,
    whose builders are named after that family's specs, model types or VARIANTS."""
    import importlib
    from pathlib import Path

    import countlens.model.families
    import countlens.toy.tiny_models as tiny_models

    def modules(package) -> set[str]:
        return {p.stem for p in Path(package.__file__).parent.glob("*.py")} - {"__init__", "spec", "common", "vocab"}

    listed = {family.__name__.rsplit(".", 1)[1]: family for family in tiny_models.FAMILIES}
    assert modules(countlens.model.families) == modules(tiny_models) == set(listed)
    for name, builders in listed.items():
        specs = importlib.import_module(f"countlens.model.families.{name}").FAMILY.specs
        names = {s.name for s in specs} | {t for s in specs for t in s.model_types}
        assert set(builders.BUILDERS) <= names | set(VARIANTS), (name, sorted(builders.BUILDERS))


def test_spec_resolves_and_paths_exist(vlm):
    arch = vlm.arch
    assert arch.name == VARIANTS.get(vlm.tiny_name, vlm.tiny_name)
    # Llama-3.2-Vision: cross-attention at layers 1 and 3; Qwen3.5: linear attention at 0 and 2.
    n_layers = 4 if arch.spec.cross_attention or arch.spec.linear_attention else 2
    assert arch.n_layers == n_layers
    if arch.name == "gemma4":  # a sliding layer's heads of 16, a global layer's of 32 (real 256 / 512)
        assert arch.kinds == ("sliding", "full") and arch.head_dims == (16, 32) and arch.d_head == 32
    else:
        assert arch.d_head == 16
    if arch.spec.linear_attention:  # 8 value heads of 8 on linear layers, 4 attention heads of 16 on softmax ones
        assert arch.kinds == ("linear", "full", "linear", "full") and arch.n_heads == 8
        assert arch.head_counts == (8, 4, 8, 4) and arch.head_dims == (8, 16, 8, 16)
    else:
        assert arch.n_heads == 4 and arch.uniform_heads == (arch.name != "gemma4")
    assert arch.n_kv_heads in (2, 4)
    assert arch.cross_layers == ((1, 3) if arch.spec.cross_attention else ())
    spec = arch.spec
    for layer in range(n_layers):
        softmax = (arch.q_site(layer),) if arch.softmax(layer) else ()
        for path in (arch.layer(layer), *softmax, arch.o_proj(layer), arch.attention(layer)):
            vlm.hf.get_submodule(path)  # raises AttributeError when a path is wrong
        assert vlm.hf.get_submodule(arch.o_proj(layer)).in_features == arch.heads(layer) * arch.head_dim(layer)
    for path in [spec.final_norm, spec.lm_head, spec.layers, spec.vision_blocks, spec.projector]:
        vlm.hf.get_submodule(path)
    vlm.hf.get_submodule(f"{arch.layer(arch.softmax_layers[0])}.{spec.k_proj}")
    assert len(vlm.hf.get_submodule(spec.layers)) == arch.n_layers
    with pytest.raises(IndexError, match=f"layers 0..{n_layers - 1}"):  # a LayerError, also a CountlensError
        arch.layer(n_layers)


def test_the_spec_names_every_module_a_method_touches(vlm):
    """Every layer's norms, q / k / v / o, MLP, and the embeddings, final norm, unembedding, vision blocks
    and projector: each path the spec gives exists. A decoder layer's own norms (its children whose class
    says Norm) are the spec's `norms`, no more (Gemma 4's per-layer-input and MoE norms aside)."""
    arch = vlm.arch
    for path in (arch.embed, arch.final_norm, arch.lm_head, arch.vision_block(0), arch.spec.projector):
        vlm.hf.get_submodule(path)
    for layer in range(arch.n_layers):
        paths = [*arch.norms(layer), arch.mlp(layer), arch.o_proj(layer)]
        if arch.kind(layer) in ("full", "sliding"):
            paths += [arch.q_proj(layer), arch.k_proj(layer), arch.v_proj(layer)]
        for path in paths:
            vlm.hf.get_submodule(path)
        module = vlm.hf.get_submodule(arch.layer(layer))
        own = {f"{arch.layer(layer)}.{n}" for n, m in module.named_children() if "norm" in type(m).__name__.lower()}
        if arch.name == "gemma4":
            assert set(arch.norms(layer)) <= own
        else:
            assert set(arch.norms(layer)) == own, (arch.name, layer, sorted(own))
    assert arch.sandwiched == (arch.name in ("gemma3", "gemma4", "glm4v", "paligemma"))  # tiny PaliGemma: Gemma 2


# Tiny models whose vocabulary splits digits (the real Qwen one, or a trained digit BPE): tiny_models/vocab.py.
# Phi-4's real o200k vocabulary groups digits by three ("12" is one token): its answers need no end token.
SPLITS_DIGITS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "llava",
    "llava_onevision",
    "gemma3",
    "gemma4",
    "paligemma",
    "mistral3",
    "smolvlm",
    "internvl",
    "internvl3_5",
    "ovis2",
)


def processor_count(vlm, image) -> int:
    """The image tokens the processor itself says one image takes."""
    proc = vlm.processor
    if vlm.arch.name == "ovis2":  # image_seq_length per tile, and a thumbnail beside several tiles
        rows, cols = proc.image_processor(images=[image])["grids"][0]
        return proc.image_seq_length * (rows * cols + (rows * cols > 1))
    if vlm.arch.name == "phi4_multimodal":
        return proc.image_processor(images=[image])["num_img_tokens"][0]
    if vlm.arch.name in ("mistral3", "llama4"):  # the image token only (their counts add separators): run it
        ids = proc(text=[proc.image_token], images=[image], return_tensors="pt")["input_ids"]
        return int((ids == vlm.arch.image_token_id).sum())
    if vlm.arch.name == "idefics3":  # image_seq_len per frame: the tiles and the whole image, or one frame
        frames, _, _ = proc.image_processor.get_number_of_image_patches(image.height, image.width)
        return proc.image_seq_len * max(frames, 1)
    if vlm.arch.name == "mllama":  # image states, not tokens: every tile slot, patches and a class token
        pixels = proc.image_processor(images=[[image]])["pixel_values"]
        patches = (pixels.shape[-1] // vlm.arch.patch_size) ** 2
        return pixels.shape[1] * pixels.shape[2] * (patches + 1)
    counted = proc._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])["num_image_tokens"][0]
    return counted - 2 * (vlm.arch.name == "internvl")  # InternVL counts its <img> and </img> tokens too


def test_prepare_positions_agree_with_the_processor(vlm):
    name = vlm.tiny_name
    imgs = images_of(name)
    batch = vlm.prepare(imgs, [QUESTION, "what color is the square?"], ["3", "red"])
    ids = batch.inputs["input_ids"]
    h, w = TINY_IMAGE_SIZE[name]
    counted = processor_count(vlm, imgs[0])
    if vlm.arch.spec.cross_attention is not None:
        # No image tokens: the <|image|> marker only; the image is its states, each with a cell.
        assert all(len(p) == 0 for p in batch.image_pos)
        assert (ids == vlm.arch.image_token_id).sum(1).tolist() == [1, 1]
        for b in range(2):
            cells = batch.state_cells[b]
            rows, cols = batch.geometry[b].token_grid
            assert cells.shape == (counted, 2) and cells.max(0).values.tolist() == [rows - 1, cols - 1]
    for b in range(2 if vlm.arch.spec.cross_attention is None else 0):
        pos = batch.image_pos[b]
        assert len(pos) == counted
        assert (ids[b, pos] == vlm.arch.image_token_id).all()
        assert int((ids[b] == vlm.arch.image_token_id).sum()) == len(pos)
        assert batch.inputs["attention_mask"][b, batch.last[b]] == 1 and pos.max() < batch.last[b]
        rows, cols = batch.geometry[b].token_grid
        cells = batch.image_cell[b]
        assert cells.shape == (len(pos), 2)
        valid = cells[cells[:, 0] >= 0]
        assert valid[:, 0].max() == rows - 1 and valid[:, 1].max() == cols - 1
    # The last prompt token is the generation prompt's end: the same token in both samples.
    assert ids[0, batch.last[0]] == ids[1, batch.last[1]]
    # Answers as the model writes them: with a digit-splitting vocabulary, ended by its end-of-answer token.
    end = [] if vlm.answer_end is None else [vlm.answer_end]
    assert batch.answer_ids == [vlm.tokenizer(a, add_special_tokens=False)["input_ids"] + end for a in ("3", "red")]
    assert (vlm.answer_end is not None) == (name in SPLITS_DIGITS)
    if name == "phi4_multimodal":
        assert (
            vlm.answer_ids("12") == vlm.tokenizer("12", add_special_tokens=False)["input_ids"]
            and len(vlm.answer_ids("12")) == 1
        )


def image_features(vlm, batch) -> torch.Tensor:
    """What the language model receives of sample 0's image: its image tokens' input embeddings, or a
    cross-attention model's image states (the projector's output), in `image_cell` / `state_cells` order."""
    if vlm.arch.spec.cross_attention is None:
        return lm_input(vlm, batch)[0, batch.image_pos[0]]
    seen = {}
    projector = vlm.hf.get_submodule(vlm.arch.spec.cross_attention.states)
    handle = projector.register_forward_hook(lambda m, a, out: seen.setdefault("s", out.detach().clone()))
    try:
        vlm.forward(batch)
    finally:
        handle.remove()
    return seen["s"][0].reshape(-1, seen["s"].shape[-1])


def lm_input(vlm, batch) -> torch.Tensor:
    """The first decoder layer's input hidden states (the LM's inputs_embeds), by a plain torch hook."""
    seen = {}

    def grab(module, args, kwargs):
        seen["h"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    handle = vlm.hf.get_submodule(vlm.arch.layer(0)).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        vlm.forward(batch)
    finally:
        handle.remove()
    return seen["h"]


# Tiny models that show the image once (the others add tiles, crops or a thumbnail: a second view).
ONE_VIEW = (
    *("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v"),
    *("llava", "gemma3", "gemma4", "paligemma", "mistral3", "mllama"),
)
# (height, width) multiples of the matrix's image size: bigger and non-square images for tiled layouts.
SCALES = {"1": (1, 1), "2": (2, 2), "3": (3, 3), "wide": (1, 2), "tall": (2, 1)}


@pytest.mark.matrix
@pytest.mark.parametrize("scale", SCALES)
def test_each_image_token_sees_its_own_cell(vlm, scale):
    """A bright square in one base cell changes most, in every view of the image (the base grid,
    LLaVA's high-resolution crops, the tiles and thumbnail or global image of the tiled models), a
    token that `image_cell` maps to that cell. Scale "1": the matrix's image size (2×2 tiles or crops
    where the model tiles); "2", "3", "wide", "tall": larger and non-square images on tiled layouts,
    whose tile grids are each processor's own (InternVL 3×3, 3×3, 1×2, 2×1; Ovis2 3×4, 3×3 and
    transposed halves; Phi-4 4×4, 6×6, 1×2, 2×1; Llama-3.2-Vision at most 4 tiles)."""
    name = vlm.tiny_name
    h, w = TINY_IMAGE_SIZE[name]
    sh, sw = SCALES[scale]
    if scale != "1" and vlm.arch.spec.layout not in TILED:
        pytest.skip("other sizes change only the tile grid, on tiled layouts")
    size = (h * sh, w * sw)
    dark = vlm.prepare(images_of(name, 1, size=size), [QUESTION])
    geom = dark.geometry[0]
    rows, cols = geom.token_grid
    base = image_features(vlm, dark)
    cells = dark.state_cells[0] if dark.state_cells else dark.image_cell[0]
    useful = useful_grid(vlm.processor, *size)
    views = token_cells(vlm.arch.spec.layout, geom, len(cells), 0, dark.tile_grids[0], useful).views
    assert len(set(views.tolist())) == (1 if name in ONE_VIEW else 2)
    for cell in [(0, 0), (rows - 1, cols - 1), (1, cols - 2), (rows - 2, 0)]:
        lit = vlm.prepare(images_of(name, 1, cell, geom, size=size), [QUESTION])
        change = (image_features(vlm, lit) - base).norm(dim=-1)
        for view in views.unique():
            idx = torch.nonzero(views == view).flatten()
            top = idx[int(change[idx].argmax())]
            assert tuple(cells[top].tolist()) == cell, (name, dark.tile_grids[0], cell, int(view))


@pytest.mark.matrix
def test_trace_equals_plain_forward(vlm):
    batch = vlm.prepare(images_of(vlm.tiny_name), [QUESTION, "what shape is the red object?"])
    with vlm.trace(batch):
        resid = vlm.module(vlm.arch.layer(0)).output.save()  # modules in execution order
        logits = vlm.nn.output.logits.save()
    seen = {}
    layer0 = vlm.hf.get_submodule(vlm.arch.layer(0))
    # A plain hook, not output_hidden_states: on Phi-4 that flag also reaches the vision tower, whose
    # own hidden-state selection it breaks (transformers 5.24).
    handle = layer0.register_forward_hook(
        lambda m, a, out: seen.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        ref = vlm.forward(batch)
    finally:
        handle.remove()
    assert torch.equal(logits, ref.logits)  # a trace without edits runs the model's own forward, bit for bit
    assert torch.equal(resid[0] if isinstance(resid, tuple) else resid, seen["h"])
