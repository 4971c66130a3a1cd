"""Sites: where circuits read and write, each a small frozen type, and the token groups they act on.

Every site has a **location** (`Location`: the module, its input or output, and the site's view of that
tensor, from the family spec), a **width** (the last axis of a value written there) and a **label**. The
engine (`countlens.circuits.engine`) reads, writes, records and freezes a site through its location; a
site also says how it is **read** from a `countlens.circuits.engine.edits.cache_run` result (the value a patch
copies).

- `Residual` — the residual stream after decoder layer ``l`` (the layer's output tensor); layer −1 is
  the input of layer 0 (the token embeddings with the projected image tokens).
- `HeadZ` — one head's output before o_proj: its columns of o_proj's input, (batch, seq,
  n_heads·d_head) viewed as (batch, seq, n_heads, d_head), with the layer's own heads and head size
  (`Arch.heads`, `Arch.head_dim`: Gemma 4's full and sliding layers differ; a linear-attention
  layer's heads are its value heads, whose gated outputs enter its ``out_proj`` side by side).
  Per-head quantities live here: slicing o_proj's *output* mixes every head, since o_proj is a
  dense map from all heads.
- `Expert` — mixture-of-experts layers: expert e's share of the experts module's output at token t,
  w_e(t)·E_e(x_t) (zero where the router did not choose e); a token's chosen experts' contributions
  sum to that output. Where that share can be seen depends on the layer's rule
  (`countlens.circuits.sites.expert_rules`).
- `ImageStates` — cross-attention VLMs (Llama-3.2-Vision) only: the image states, which never enter
  the residual stream. At "layer −1" the projector's output, which every cross-attention layer
  reads; at a cross-attention layer ``l`` the states that layer alone reads (its k and v input). An
  edit's mask there is Bool[Tensor, "batch n_states"]: the states are its positions.

Sites of one kind at one layer are written together (`countlens.circuits.engine.writes.write`), and the
kinds in the order the forward reaches them (``stage``: image states, z, experts, the layer's
output), because nnsight enters each module once, in execution order.

Two more quantities read at these sites: the **head contribution** ĥ_i·W_O, head i's z times its
columns of o_proj's weight (the heads' contributions, plus any o_proj bias, sum to the o_proj
output), and **q**, after any q-norm (Qwen3, Gemma3) or else the q_proj output: head temperature
scales it.

Token groups (boolean masks over the padded batch): ``image`` (image tokens), ``last`` (where the
answer is read: the last prompt token, and any answer tokens teacher-forced after it up to the read
position — see `countlens.model.answers`), ``text`` (every other real token), ``all`` (all real tokens).
A cross-attention model has no image tokens; its image is the ``image_states`` group of
`countlens.circuits.methods.patching.patch_layers` (a site, not positions in the sequence).
"""

from countlens.circuits.sites.attention import AttnIn, K, Pattern, Q, V
from countlens.circuits.sites.groups import GROUPS, STATES, check_group, checked_heads, group_mask
from countlens.circuits.sites.location import (
    Location,
    check_indices,
    check_site,
    columns,
    first_arg,
    first_output,
    head_axis,
    replace_first,
    whole,
)
from countlens.circuits.sites.mlp import MlpIn, MlpOut
from countlens.circuits.sites.stacking import (
    head_contributions,
    heads_view,
    o_proj_weight,
    repeat_inputs,
    repeat_output,
    skip_tower,
    tower_output,
)
from countlens.circuits.sites.stream import INPUTS, Embed, Expert, HeadZ, ImageStates, Logits, Residual
from countlens.circuits.sites.vision import VisionBlock

#: Every site kind: the one vocabulary of components.
Site = Residual | HeadZ | Expert | ImageStates | Embed | Q | K | V | Pattern | AttnIn | MlpIn | MlpOut | Logits

__all__ = [
    "GROUPS",
    "INPUTS",
    "AttnIn",
    "Embed",
    "Logits",
    "STATES",
    "Expert",
    "HeadZ",
    "ImageStates",
    "K",
    "Location",
    "MlpIn",
    "MlpOut",
    "Pattern",
    "Q",
    "Residual",
    "Site",
    "V",
    "VisionBlock",
    "check_group",
    "check_indices",
    "check_site",
    "checked_heads",
    "columns",
    "first_arg",
    "first_output",
    "group_mask",
    "head_axis",
    "head_contributions",
    "heads_view",
    "o_proj_weight",
    "repeat_inputs",
    "repeat_output",
    "replace_first",
    "skip_tower",
    "tower_output",
    "whole",
]
