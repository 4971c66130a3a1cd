"""Stacked forwards and per-head views: a batch repeated k times, a module output likewise, z split
into heads, and each head's contribution through o_proj."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.model.adapt import module_of

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM


def repeat_inputs(inputs: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """The batch stacked k times along dim 0 (replica r = rows r·B … (r+1)·B − 1).

    Every processor output has the sample (or, for Qwen's flattened patches, the per-image patch
    block in sample order) first, so concatenating copies keeps each replica's images aligned.
    """
    return {name: torch.cat([t] * k, dim=0) if isinstance(t, Tensor) else t for name, t in inputs.items()}


def repeat_output(out, k: int, dim: int = 0):
    """A module output (tensor, tuple, HF ModelOutput) with every tensor stacked k times along ``dim``,
    matching what the module computes on `repeat_inputs` (dim 1 for a vision tower that packs the
    batch's images into one sequence: `countlens.model.arch.ArchSpec.packed_tower`)."""
    if isinstance(out, Tensor):
        return torch.cat([out] * k, dim=dim)
    if isinstance(out, dict):  # HF ModelOutput is an ordered dict of its non-None fields
        return type(out)(**{name: repeat_output(v, k, dim) for name, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(repeat_output(v, k, dim) for v in out)
    return out


def tower_output(vlm: VLM, batch):
    """A copy of the vision tower's output on ``batch`` (a copy: the model edits that object later).
    Every replica of a stacked forward shows the same images, so the tower runs once here and is
    skipped in the stacked forwards (`skip_tower`): exact by construction. Without it a tower that
    packs the batch's images into one sequence (Pixtral's) costs the square of the replicas."""
    kept: dict = {}
    with vlm.read(batch):
        kept["out"] = repeat_output(vlm.module(vlm.arch.spec.vision_tower).output, 1)
    return kept["out"]


def skip_tower(vlm: VLM, out, k: int) -> None:
    """Inside a trace of ``k`` stacked replicas: the vision tower skipped, ``out`` (`tower_output`)
    fed in once per replica."""
    vlm.module(vlm.arch.spec.vision_tower).skip(repeat_output(out, k, int(vlm.arch.spec.packed_tower)))


def heads_view(z: Float[Tensor, "batch seq n_heads*d_head"], n_heads: int) -> Float[Tensor, "batch seq n_heads d_head"]:
    """z with its last axis split into the heads."""
    return z.view(*z.shape[:-1], n_heads, z.shape[-1] // n_heads)


def o_proj_weight(vlm: VLM, layer: int) -> Float[Tensor, "d_model n_heads*d_head"]:
    """o_proj's weight at ``layer``."""
    return module_of(vlm.hf, vlm.arch.o_proj(layer)).weight


def head_contributions(
    vlm: VLM, layer: int, z: Float[Tensor, "... n_heads*d_head"]
) -> Float[Tensor, "... n_heads d_model"]:
    """ĥ_i·W_O per head, from z."""
    w = o_proj_weight(vlm, layer)
    h = vlm.arch.heads(layer)
    w_heads = w.view(w.shape[0], h, -1).to(z.device, z.dtype)  # d_model × heads × d_head (z may sit on the CPU)
    return torch.einsum("...hd,mhd->...hm", heads_view(z, h), w_heads)
