"""Token groups: which positions of a prepared batch a site is read or written at, and heads by name.

``image`` (image tokens), ``last`` (where the answer is read: the last prompt token, and any answer
tokens teacher-forced after it up to the read position — see `countlens.model.answers`), ``text`` (every
other real token), ``all`` (all real tokens). A cross-attention model has no image tokens; its image
is the ``image_states`` group of `countlens.circuits.methods.patching.patch_layers` (a site, not positions).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.errors import InputError
from countlens.labels import head_keys

if TYPE_CHECKING:
    from jaxtyping import Bool

    from countlens.model.arch import Arch
    from countlens.model.vlm import Batch


GROUPS: tuple[str, ...] = ("image", "last", "text", "all")
#: The image states of a cross-attention model, patched as a group of `patch_layers`.
STATES = "image_states"


def checked_heads(arch: Arch, heads: Iterable) -> list[tuple[int, int]]:
    """``heads`` as (layer, head) pairs, read by the one parser of heads (`countlens.labels.head_keys`:
    pairs, labels such as "L3H2", numpy integers; one head alone or a collection; no head twice) and
    checked against the model's layers and heads. An empty collection is no heads: what ablating none
    means (the self-check's baseline), never "every head"."""
    if isinstance(heads, (list, tuple)) and not heads:
        return []
    out = list(head_keys(heads, "heads"))
    for layer, h in out:
        arch.layer(layer)
        if not 0 <= h < arch.heads(layer):
            raise InputError(
                f"head {h} out of range: layer {layer} of {arch.name} has heads 0..{arch.heads(layer) - 1}"
            )
    return out


def check_group(group: str) -> str:
    """``group`` if it names a token group (`GROUPS`), else an `InputError` listing them. Sweeps call
    it before they open their store, so a misspelt group leaves no spec.json to block the rerun."""
    if not isinstance(group, str) or group not in GROUPS:
        raise InputError(f"unknown token group {group!r}; use one of {GROUPS}")
    return group


def group_mask(batch: Batch, group: str) -> Bool[Tensor, "batch seq"]:
    """The positions of ``group`` in each row of a prepared `Batch`."""
    check_group(group)
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
