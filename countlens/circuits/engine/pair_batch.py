"""Clean/corrupt count pairs prepared for patching: two batches whose positions line up.

A pair's two images differ only in how many objects they show (`countlens.datasets.count_pairs`);
patching copies the corrupt run's activations into the clean run position by position, so
`prepare_pairs` refuses pairs whose token (or image state) positions do not cover the same cells
on both sides. Each pair is read where its two answers' tokens first differ
(`countlens.model.answers.divergence`), and `logit_diff` is the logit of the clean answer's token minus
the corrupt answer's there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from countlens.errors import InputError
from countlens.model.answers import divergence
from countlens.model.vlm import check_pairs
from countlens.results import provenance

if TYPE_CHECKING:
    from jaxtyping import Float, Int

    from countlens.model.vlm import VLM, Batch


@dataclass
class PairBatch:
    """A chunk of pairs prepared for patching: the two batches and each pair's two answer tokens."""

    clean: Batch
    corrupt: Batch
    clean_id: Int[Tensor, " pairs"]  # a leading space: one named dim (jaxtyping's spelling that linters accept)
    corrupt_id: Int[Tensor, " pairs"]


def prepare_pairs(vlm: VLM, pairs: Sequence) -> PairBatch:
    """Prepare clean and corrupt batches and check that their token positions line up.

    Each pair's answers are compared where their token sequences first differ
    (`countlens.model.answers.divergence`): the shared prefix (e.g. "1" of 10 and 12) is teacher-forced on
    both sides, and ``clean_id`` / ``corrupt_id`` are the two tokens read at the position after it.
    """
    check_pairs(pairs, "prepare_pairs")
    return batch_pairs(vlm, pairs)


def batch_pairs(vlm: VLM, pairs: Sequence) -> PairBatch:
    """`prepare_pairs` of pairs a public function already checked at its door (a sweep's chunks)."""
    split = [
        divergence(vlm.answer_ids(p.clean.answer), vlm.answer_ids(p.corrupt.answer), (p.clean.answer, p.corrupt.answer))
        for p in pairs
    ]
    forced = [prefix for prefix, _, _ in split]

    images = {side: [getattr(p, side).image for p in pairs] for side in ("clean", "corrupt")}
    for k, (a, b) in enumerate(zip(images["clean"], images["corrupt"])):
        if np.array_equal(np.asarray(a), np.asarray(b)):
            raise InputError(
                f"pair {k}: the clean and corrupt images are the same picture, so patching has nothing to carry "
                "and every effect would divide by zero; give pairs whose images differ (count_pairs draws them)"
            )

    def prep(side: str) -> Batch:
        samples = [getattr(p, side) for p in pairs]
        batch = vlm.prepare(images[side], [s.question for s in samples], [s.answer for s in samples], forced=forced)
        batch.samples = samples  # object positions read each side's scene
        return batch

    clean = prep("clean")
    corrupt = prep("corrupt")
    a, b = clean.inputs["input_ids"], corrupt.inputs["input_ids"]
    aligned = a.shape == b.shape and all(torch.equal(x, y) for x, y in zip(clean.image_pos, corrupt.image_pos))
    if not aligned or not torch.equal(clean.last, corrupt.last):
        raise InputError(
            f"clean and corrupt inputs do not line up (token shapes {tuple(a.shape)} vs {tuple(b.shape)}): "
            f"{vlm.arch.name} gives these images different numbers of image tokens. Patching needs the same "
            "positions on both sides: use images of one size and the same question in each pair"
        )
    for k, (g, h) in enumerate(zip(clean.geometry, corrupt.geometry)):
        if g.token_grid != h.token_grid:  # equal token counts on different grids would pass the check above
            raise InputError(
                f"pair {k}: the clean image gives a {g.token_grid} token grid and the corrupt one "
                f"{h.token_grid}, so image token i covers different cells; give both images one size"
            )
    # Tiles: equal token (or state) counts can come from different tile grids (1×2 and 2×1), and then
    # token i covers different cells; a cross-attention model's states must line up the same way.
    sides = zip(
        clean.tile_grids,
        corrupt.tile_grids,
        clean.state_cells or [None] * len(pairs),
        corrupt.state_cells or [None] * len(pairs),
    )
    for k, (g, h, sg, sh) in enumerate(sides):
        if g != h or (sg is not None and not torch.equal(sg, sh)):
            raise InputError(
                f"pair {k}: the clean image is cut into {g} tiles and the corrupt one into {h}, so image token "
                "(or state) i covers different cells; give both images one size"
            )
    for k, p in enumerate(pairs):
        # With the image layouts equal, image tokens (and any layout tokens) match: only the text can differ.
        if p.clean.question != p.corrupt.question or not torch.equal(a[k], b[k]):
            raise InputError(
                f"pair {k}: the clean and corrupt prompts differ outside the image ({p.clean.question!r} "
                f"vs {p.corrupt.question!r}); patching measures what the image changes, so each pair "
                "must share its question: build both sides with one prompt (count_pairs does)"
            )
    return PairBatch(clean, corrupt, torch.tensor([c for _, c, _ in split]), torch.tensor([d for _, _, d in split]))


def logit_diff(
    logits: Float[Tensor, "pairs vocab"], clean_id: Int[Tensor, " pairs"], corrupt_id: Int[Tensor, " pairs"]
) -> Float[Tensor, " pairs"]:
    """LD per pair: the clean answer's logit minus the corrupt answer's, at the read position."""
    rows = torch.arange(len(logits))
    return logits[rows, clean_id.to(logits.device)] - logits[rows, corrupt_id.to(logits.device)]


def normaliser(clean_sum: float, corrupt_sum: float) -> float:
    """Σ LD_corrupt − Σ LD_clean, the denominator of every patching effect; refused where it is zero or
    not finite (the pairs' two sides read alike, or a logit overflowed), so no effect is NaN or ±inf."""
    denom = float(corrupt_sum) - float(clean_sum)
    if not np.isfinite(denom) or denom == 0:
        raise InputError(
            f"the pairs' corrupt and clean runs give the same summed logit difference (Σ LD_corrupt − Σ LD_clean "
            f"= {denom}), so no effect can be normalised: the model reads the two sides of these pairs alike. "
            "Give pairs the model tells apart (e.g. counts further apart), or more pairs"
        )
    return denom


def pairs_provenance(vlm: VLM, pairs: Sequence, **extra) -> dict:
    """A result's provenance: the model, and how many pairs of which kinds it read."""
    kinds = sorted({getattr(p, "kind", "?") for p in pairs})
    return provenance(vlm.name, vlm.arch.name, dataset={"pairs": len(pairs), "kinds": kinds}, samples=pairs, **extra)
