"""Attention probabilities, read only where they are needed.

Fast attention kernels (SDPA, flash) never materialise the probabilities, so `eager_attention`
switches the language model to eager attention for the duration of a ``with`` block and restores the
previous implementation afterwards; everything else in countlens keeps the fast kernel. Under
eager attention each decoder layer's self-attention returns (output, probabilities); countlens
keeps only the rows it asks for (the last prompt position), not the full seq × seq matrices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.arch import text_config
from countlens.circuits.sites import group_mask
from countlens.errors import InputError

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.vlm import VLM, Batch


@contextmanager
def eager_attention(vlm: VLM) -> Iterator[None]:
    """Switch the language model to eager attention inside the block (the vision tower is untouched)."""
    text = text_config(vlm.hf.config, vlm.arch.spec)
    previous = text._attn_implementation
    if previous == "eager":
        yield
        return
    vlm.hf.set_attn_implementation({vlm.arch.spec.text_config: "eager"})
    try:
        yield
    finally:
        vlm.hf.set_attn_implementation({vlm.arch.spec.text_config: previous})


@torch.no_grad()
def last_token_attention(
    vlm: VLM, batch: Batch, layers: Sequence[int] | None = None
) -> Float[Tensor, "layer batch head seq"]:
    """Attention from the last prompt position, per head."""
    layers = list(range(vlm.arch.n_layers)) if layers is None else sorted(int(x) for x in layers)
    rows = []
    with eager_attention(vlm), vlm.read(batch):
        for layer in layers:
            probs = vlm.module(vlm.arch.self_attn(layer)).output[1]
            rows.append(probs[torch.arange(len(batch)), :, batch.last.to(probs.device)].float().save())
    return torch.stack([r.cpu() for r in rows])


def image_attention_share(
    vlm: VLM, samples: Sequence, layers: Sequence[int] | None = None, batch_size: int = 16
) -> xr.DataArray:
    """Share of the last position's attention that lands on image tokens: (layer, head, sample)."""
    if len(samples) == 0:
        raise InputError("no samples given")
    layers = list(range(vlm.arch.n_layers)) if layers is None else sorted(int(x) for x in layers)
    parts = []
    for _, batch in vlm.batches(samples, batch_size):
        att = last_token_attention(vlm, batch, layers)  # layer batch head seq
        image = group_mask(batch, "image").float()
        parts.append(torch.einsum("lbhs,bs->lhb", att, image))
    return xr.DataArray(
        torch.cat(parts, -1).numpy(),
        dims=("layer", "head", "sample"),
        name="image_attention",
        coords={"layer": layers, "head": np.arange(vlm.arch.n_heads), "sample": np.arange(len(samples))},
    )
