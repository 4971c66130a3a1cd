"""Sites: where circuits read and write, as nnsight envoys plus the token groups they act on.

- **resid** — the residual stream after decoder layer ``l`` (the layer's output tensor).
- **z** — each head's output before o_proj: the input of o_proj, (batch, seq, n_heads·d_head),
  viewed as (batch, seq, n_heads, d_head), with the layer's own heads and head size (`Arch.heads`,
  `Arch.head_dim`: Gemma 4's full and sliding layers differ; a linear-attention layer's heads are
  its value heads, whose gated outputs enter its ``out_proj`` side by side). Per-head quantities
  live here: slicing o_proj's *output* mixes every head, since o_proj is a dense map from all heads.
- **head contribution** — ĥ_i·W_O: head i's z times its columns of o_proj's weight; the heads'
  contributions (plus any o_proj bias) sum to the o_proj output.
- **q** — after any q-norm (Qwen3, Gemma3) or else the q_proj output; head temperature scales it.

- **expert contribution** — mixture-of-experts layers: expert e's share of the experts module's
  output at token t, w_e(t)·E_e(x_t) (zero where the router did not choose e); a token's chosen
  experts' contributions sum to that output (`expert_contribution`).
- **states** — cross-attention VLMs (Llama-3.2-Vision) only: the image states, which never enter
  the residual stream. At "layer −1" the projector's output, which every cross-attention layer
  reads; at a cross-attention layer ``l`` the states that layer alone reads (its k and v input).

Token groups (boolean masks over the padded batch): ``image`` (image tokens), ``last`` (where the
answer is read: the last prompt token, and any answer tokens teacher-forced after it up to the read
position — see `countlens.answers`), ``text`` (every other real token), ``all`` (all real tokens).
A cross-attention model has no image tokens; its image is the ``image_states`` group of
`countlens.circuits.patching.patch_layers` (a site, not positions in the sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.errors import InputError
from countlens.results import head_key, is_head_pair

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.arch import Arch
    from countlens.vlm import VLM, Batch

GROUPS: tuple[str, ...] = ("image", "last", "text", "all")
#: The image states of a cross-attention model, patched as a group of `patch_layers`.
STATES = "image_states"


def checked_heads(arch: Arch, heads: Iterable) -> list[tuple[int, int]]:
    """``heads`` as (layer, head) pairs, each given as a pair or a label such as "L3H2"
    (`countlens.results.head_key`), checked against the model's layers and heads."""
    if isinstance(heads, str) or is_head_pair(heads):
        heads = [heads]  # one head given alone: "L0H0", (0, 0) or [0, 0]
    out = []
    for head in heads:
        layer, h = head_key(head)
        arch.layer(layer)
        if not 0 <= h < arch.heads(layer):
            raise InputError(
                f"head {h} out of range: layer {layer} of {arch.name} has heads 0..{arch.heads(layer) - 1}"
            )
        out.append((layer, h))
    return out


def group_mask(batch: Batch, group: str) -> Bool[Tensor, "batch seq"]:
    """The positions of ``group`` in each row of a prepared `Batch`."""
    if group not in GROUPS:
        raise InputError(f"unknown token group {group!r}; use one of {GROUPS}")
    ids = batch.inputs["input_ids"]
    real = batch.inputs["attention_mask"].bool()
    mask = torch.zeros_like(real)
    if group == "all":
        return real.clone()
    answer = _answer_span(batch, ids.shape[1]).to(real.device)
    if group == "last":
        return answer
    if group == "image" and batch.state_cells:
        raise InputError(
            "this model has no image tokens: its image reaches the text only through cross-attention, as "
            "image states — a site (patch_layers' group 'image_states'), not positions in the sequence"
        )
    for b, pos in enumerate(batch.image_pos):
        mask[b, pos] = True
    if group == "image":
        return mask
    return real & ~mask & ~answer  # text: real tokens outside the image and the answer span


def _answer_span(batch: Batch, width: int) -> Tensor:
    """Bool[Tensor, "batch seq"]: each row's positions from its last prompt token to its read position."""
    pos = torch.arange(width)[None]
    return (pos >= batch.prompt_last[:, None]) & (pos <= batch.last[:, None])


def repeat_inputs(inputs: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """The batch stacked k times along dim 0 (replica r = rows r·B … (r+1)·B − 1).

    Every processor output has the sample (or, for Qwen's flattened patches, the per-image patch
    block in sample order) first, so concatenating copies keeps each replica's images aligned.
    """
    return {name: torch.cat([t] * k, dim=0) if isinstance(t, Tensor) else t for name, t in inputs.items()}


def repeat_output(out, k: int, dim: int = 0):
    """A module output (tensor, tuple, HF ModelOutput) with every tensor stacked k times along ``dim``,
    matching what the module computes on `repeat_inputs` (dim 1 for a vision tower that packs the
    batch's images into one sequence: `countlens.arch.ArchSpec.packed_tower`)."""
    if isinstance(out, Tensor):
        return torch.cat([out] * k, dim=dim)
    if isinstance(out, dict):  # HF ModelOutput is an ordered dict of its non-None fields
        return type(out)(**{name: repeat_output(v, k, dim) for name, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(repeat_output(v, k, dim) for v in out)
    return out


def heads_view(z: Float[Tensor, "batch seq n_heads*d_head"], n_heads: int) -> Float[Tensor, "batch seq n_heads d_head"]:
    """z with its last axis split into the heads."""
    return z.view(*z.shape[:-1], n_heads, z.shape[-1] // n_heads)


def o_proj_weight(vlm: VLM, layer: int) -> Float[Tensor, "d_model n_heads*d_head"]:
    """o_proj's weight at ``layer``."""
    return vlm.hf.get_submodule(vlm.arch.o_proj(layer)).weight


def head_contributions(
    vlm: VLM, layer: int, z: Float[Tensor, "... n_heads*d_head"]
) -> Float[Tensor, "... n_heads d_model"]:
    """ĥ_i·W_O per head, from z."""
    w = o_proj_weight(vlm, layer)
    h = vlm.arch.heads(layer)
    w_heads = w.view(w.shape[0], h, -1).to(z.device, z.dtype)  # d_model × heads × d_head (z may sit on the CPU)
    return torch.einsum("...hd,mhd->...hm", heads_view(z, h), w_heads)


def expert_contribution(
    experts, x: Float[Tensor, "tokens d_model"], index: Tensor, weights: Tensor, expert: int
) -> Float[Tensor, "tokens d_model"]:
    """Expert ``expert``'s contribution to each token: its routing weight there (``weights`` where
    ``index`` chose it, Int and Float[Tensor, "tokens top_k"]; 0 elsewhere) times its output on x,
    computed from the experts module's own stacked weights (`countlens.arch.MoESpec`)."""
    weight = (weights * (index == expert)).sum(-1, keepdim=True)
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
    out = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
    return (out * weight.to(out.dtype)).to(x.dtype)
