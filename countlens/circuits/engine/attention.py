"""Attention probabilities, read only where they are needed.

Fast attention kernels (SDPA, flash) never materialise the probabilities, so `eager_attention`
switches the language model to eager attention for the duration of a ``with`` block and restores the
previous implementation afterwards; everything else in countlens keeps the fast kernel. Under
eager attention each decoder layer's self-attention returns (output, probabilities); countlens
keeps only the rows it asks for (the last prompt position), not the full seq × seq matrices.

A cross-attention model's keys (`image_keys`) are the sequence positions, then its image states: a
self-attention layer puts no weight on the states, a cross-attention layer none on the sequence. Its
image share is therefore 0 at self-attention layers and 1 at cross-attention layers, by construction
(countlens's definition; the papers define none for this architecture): where the model looks *on*
the image (VRA, Attn-IoU over the states' cells) is the informative part there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.model.arch import text_config
from countlens.model.arguments import require_batch, require_layers, require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance

if TYPE_CHECKING:
    from jaxtyping import Float, Int

    from countlens.model.vlm import VLM, Batch


@contextmanager
def eager_attention(vlm: VLM) -> Iterator[None]:
    """Switch the language model to eager attention inside the block (the vision tower is untouched)."""
    require_vlm(vlm, "eager_attention")
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
) -> Float[Tensor, "layer batch head key"]:
    """Attention from the last prompt position, per head, over the keys (`image_keys`). Asked for
    explicitly, a linear-attention layer (no probabilities) is an error; by default (``layers`` None)
    such layers, and heads beyond a layer's own, are NaN."""
    require_vlm(vlm, "last_token_attention")
    require_batch(batch, "last_token_attention")
    arch = vlm.arch
    if layers is None:
        layers = list(range(arch.n_layers))
    else:
        layers = sorted(require_layers(vlm, layers, "last_token_attention"))
        for layer in layers:
            arch.require_softmax(layer, "reading attention")
    rows = {}
    with eager_attention(vlm), vlm.read(batch):
        for layer in layers:
            if arch.softmax(layer):
                probs = vlm.module(arch.attention(layer)).output[1]
                rows[layer] = probs[torch.arange(len(batch)), :, batch.last.to(probs.device)].float().save()
    seq = batch.inputs["input_ids"].shape[1]
    n_states = len(batch.state_cells[0]) if batch.state_cells else 0
    out = torch.full((len(layers), len(batch), arch.n_heads, seq + n_states), float("nan"))
    for i, layer in enumerate(layers):
        if layer not in rows:
            continue
        r = rows[layer].cpu()
        out[i, :, : r.shape[1]] = 0.0
        if arch.kind(layer) == "cross":  # its keys are the states, which follow the sequence
            out[i, :, : r.shape[1], seq:] = r
        else:
            out[i, :, : r.shape[1], : r.shape[-1]] = r
    return out


def image_keys(batch: Batch, b: int) -> tuple[Int[Tensor, " n"], Int[Tensor, "n 2"]]:
    """Sample ``b``'s image keys in `last_token_attention`'s key axis and their cells: its image tokens'
    positions (`Batch.image_pos`, `Batch.image_cell`), or a cross-attention model's image states,
    which follow the sequence (`Batch.state_cells`)."""
    if not batch.state_cells:
        return batch.image_pos[b], batch.image_cell[b]
    seq = batch.inputs["input_ids"].shape[1]
    return seq + torch.arange(len(batch.state_cells[b])), batch.state_cells[b]


def image_attention_share(
    vlm: VLM, samples: Sequence, layers: Sequence[int] | None = None, batch_size: int = 16
) -> xr.DataArray:
    """Share of the last position's attention that lands on image tokens: (layer, head, sample)."""
    require_vlm(vlm, "image_attention_share")
    check_samples(samples, "image_attention_share")
    asked = layers  # None: every layer, NaN where there are no probabilities
    layers = sorted(require_layers(vlm, layers, "image_attention_share") or range(vlm.arch.n_layers))
    parts = []
    for _, batch in vlm.batches(samples, batch_size):
        att = last_token_attention(vlm, batch, asked)  # layer batch head key
        image = torch.zeros(att.shape[1], att.shape[-1])
        for b in range(len(batch)):
            image[b, image_keys(batch, b)[0]] = 1.0
        parts.append(torch.einsum("lbhs,bs->lhb", att, image))
    return xr.DataArray(
        torch.cat(parts, -1).numpy(),
        dims=("layer", "head", "sample"),
        name="image_attention",
        coords={"layer": layers, "head": np.arange(vlm.arch.n_heads), "sample": np.arange(len(samples))},
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "method": "image_attention_share",
        },
    )
