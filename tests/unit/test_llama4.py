"""Llama 4's pieces countlens provides: the PIL image processor's canvas rule (transformers' own
examples), the padded tile layout, and head temperature through the norm q and k share."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tolerance import assert_close, bound, scale_of

from countlens import circuits
from countlens.model.families.llama4 import llama4_canvas, llama4_resized
from countlens.model.processors import useful_grid


def test_the_canvas_rule_gives_transformers_own_examples():
    # get_best_fit's docstring: a 200 × 300 image among 224-px canvases of at most 3 tiles → 224 × 448.
    assert llama4_canvas(200, 300, 224, 3) == (224, 448)
    # get_max_res_without_distortion's examples, through the cap on enlarging (max(side, S)).
    assert llama4_resized(200, 300, 224, 3) == (200, 300)  # fits: not enlarged past its own size
    assert llama4_resized(800, 600, 224, 16)[0] == 800 * llama4_resized(800, 600, 224, 16)[1] // 600
    assert llama4_canvas(32, 32, 32, 4) == (32, 32) and llama4_canvas(64, 64, 32, 4) == (64, 64)


def test_padding_tokens_cover_no_cell(loaded):
    vlm = loaded("llama4")
    image = Image.new("RGB", (70, 50))  # 50 × 70: resized into a 64 × 64 canvas, bottom rows padding
    batch = vlm.prepare([image], ["how many circles?"])
    new_h, new_w = useful_grid(vlm.processor, 50, 70)
    assert batch.tile_grids[0] == (2, 2) and (new_h, new_w) == (45, 64)
    cells = batch.image_cell[0][:64]  # the four tiles' tokens (then the global tile's 16)
    token = 32 // 4  # px per token
    rows_of_padding = sum(1 for y in range(8) if (y + 0.5) * token >= new_h)
    assert int((cells[:, 0] < 0).sum()) == rows_of_padding * 8
    assert (batch.image_cell[0][64:] >= 0).all()  # the global tile shows the whole image


@pytest.mark.numeric
def test_temperature_scales_q_not_k_through_their_shared_norm(loaded):
    """An independent hook tells q from k by shape (4 heads against 2 kv heads), not by call order."""
    vlm = loaded("llama4")
    batch = vlm.prepare([Image.fromarray(np.full((64, 64, 3), 90, np.uint8))], ["how many circles?"])
    norm = vlm.hf.get_submodule(vlm.arch.q_site(0))
    assert vlm.arch.q_site(0).endswith("qk_norm") and vlm.arch.q_site(1).endswith("q_proj")  # layer 1: no RoPE

    def by_shape(module, args, out):
        if out.shape[-2] != vlm.arch.n_heads:  # k (2 kv heads)
            return out
        scale = torch.ones(vlm.arch.n_heads)
        scale[1] = 3.0
        return out * scale[:, None]

    handle = norm.register_forward_hook(by_shape)
    try:
        want = vlm.forward(batch).logits
    finally:
        handle.remove()
    with circuits.head_temperature(vlm, {(0, 1): 3.0}):
        got = vlm.forward(batch).logits
    # q × 3 after the norm by a hook vs by head_temperature: two float32 forwards, rounding of the logits' size.
    assert_close(got, want, what="β on q vs a hook on the norm's q")
    assert (got - vlm.forward(batch).logits).abs().max() > 10 * bound(scale_of(got))  # the edit did something
