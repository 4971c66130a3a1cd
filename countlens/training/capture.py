"""Differentiable attention probabilities at chosen layers only.

Fast kernels (SDPA) never form the probabilities. Inside `attention_at(vlm, layers)` the language
model builds its masks for eager attention (additive float masks, which SDPA also accepts), the
chosen layers run eager attention and return their probabilities — kept, with their graph, in the
yielded dict — and every other layer keeps running SDPA on its own copy of the config (a model on
flash attention runs eager everywhere inside the block: flash kernels take no additive masks).
So a loss on two layers' attention materialises two layers' probabilities, not all of them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.errors import InputError
from countlens.model.arch import text_config

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


@contextmanager
def attention_at(vlm: VLM, layers: Sequence[int]) -> Iterator[dict[int, object]]:
    """``with attention_at(vlm, [3, 4]) as attn: model(...)`` → ``attn[l]``: Float[Tensor, "batch heads seq seq"]."""
    arch = vlm.arch
    for layer in layers:
        arch.require_softmax(layer, "an attention loss")
    if not layers:
        raise InputError("attention_at needs at least one layer")
    text = text_config(vlm.hf.config, arch.spec)
    fast = text._attn_implementation
    captured: dict[int, object] = {}
    hooks, swapped = [], []
    vlm.hf.set_attn_implementation({arch.spec.text_config: "eager"})
    try:
        for layer in arch.softmax_layers:  # a linear-attention layer (Qwen3.5) has no probabilities to keep
            if layer in layers:
                hooks.append(Hook(arch.attention(layer), "weights", lambda w, layer=layer: captured.update({layer: w})))
            elif fast == "sdpa":  # SDPA takes eager's additive masks; flash attention does not
                attn = module_of(vlm.hf, arch.attention(layer))
                own = copy.copy(attn.config)
                own._attn_implementation = fast
                swapped.append((attn, attn.config))
                attn.config = own
        with hooked(vlm.hf, hooks):
            yield captured
    finally:
        for attn, config in swapped:
            attn.config = config
        vlm.hf.set_attn_implementation({arch.spec.text_config: fast})
