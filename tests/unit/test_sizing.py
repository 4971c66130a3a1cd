"""Every sizing rule (`countlens.model.sizing`): the token grid countlens computes for an image of any size,
times the tiles it is shown in, equals the processor's own count of image tokens for it."""

from __future__ import annotations

import copy

import pytest
from PIL import Image
from test_arch_matrix import processor_count

from countlens.model.processors import tile_grid
from countlens.model.sizing import default_size, fixed_size, is_dynamic, pin_square, processed_size
from countlens.model.vlm import VLM

# (height, width): square, wide, tall, odd sizes, a thin strip, and one smaller than a token.
SIZES = [(64, 64), (64, 128), (96, 48), (50, 70), (30, 200), (12, 20)]
# Each rule once (and its processor at a second setting): (tiny model, image-processor settings).
RULES = {
    "pixel budget (Qwen2-VL)": ("qwen2_vl", {"size": {"shortest_edge": 16 * 16, "longest_edge": 128 * 128}}),
    "pixel budget, pinned": ("qwen2_vl", {}),
    "two-frame pixel budget (GLM-4.1V)": ("glm4v", {"size": {"shortest_edge": 2 * 16 * 16, "longest_edge": 2 * 96**2}}),
    "longest edge (Mistral 3)": ("mistral3", {}),
    "longest edge 48 (Mistral 3)": ("mistral3", {"size": {"longest_edge": 48}}),
    "token budget 70 (Gemma 4)": ("gemma4", {}),
    "token budget 140 (Gemma 4)": ("gemma4", {"max_soft_tokens": 140}),
    "tiles of a fixed longest edge (Idefics3)": ("idefics3", {}),
    "tiles of a fixed longest edge (SmolVLM)": ("smolvlm", {}),
    "closest-aspect tiles (InternVL)": ("internvl", {}),
    "a padded canvas of tiles (Llama 4)": ("llama4", {}),
    "a padded canvas of up to 9 tiles (Llama 4)": ("llama4", {"max_patches": 9}),
    "fixed size (Gemma 3)": ("gemma3", {}),
    "fixed size (PaliGemma)": ("paligemma", {}),
}


def _with_settings(vlm: VLM, settings: dict) -> VLM:
    """The model with a copy of its processor set otherwise (the shared processor stays as it is); only
    the image processor is copied deeply, the tokenizer is shared (copying it takes seconds)."""
    processor = copy.copy(vlm.processor)
    processor.image_processor = copy.deepcopy(vlm.processor.image_processor)
    for key, value in settings.items():
        setattr(processor.image_processor, key, value)
    return VLM(vlm.hf, processor, name=vlm.name, envoy=vlm.nn)


@pytest.mark.parametrize("rule", RULES)
def test_the_token_grid_equals_the_processors_count(rule, loaded):
    name, settings = RULES[rule]
    vlm = _with_settings(loaded(name), settings)
    ip = vlm.processor.image_processor
    counts = []
    for h, w in SIZES:
        image = Image.new("RGB", (w, h))
        rows, cols = vlm.geometry_for(h, w).token_grid
        tiles = tile_grid(vlm.processor, h, w) if vlm.arch.spec.layout != "grid" else (1, 1)
        n_tiles = tiles[0] * tiles[1]
        ours = rows * cols * (n_tiles + (n_tiles > 1))  # the tiles and, beside several, the whole image
        counts.append((h, w, ours, processor_count(vlm, image)))
    assert all(ours == theirs for _, _, ours, theirs in counts), counts
    # The dynamic rules see the sizes differ; the fixed ones give one grid.
    assert len({c[2] for c in counts}) > 1 or fixed_size(ip) is not None or not is_dynamic(ip)


def test_pinning_a_square_keeps_that_side():
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    for ip in (Qwen2VLImageProcessorPil(), Glm4vImageProcessorPil(), PixtralImageProcessorPil()):
        assert pin_square(ip, 448)
        assert processed_size(ip, 448, 448, 28) == (448, 448) == default_size(ip, 28), type(ip).__name__
