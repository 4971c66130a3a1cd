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
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from countlens.datasets.pairs import count_table
from countlens.errors import InputError
from countlens.model.answers import divergence
from countlens.model.arguments import require_vlm
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
    forced: list = field(default_factory=list)  # each pair's shared answer prefix (token ids), teacher-forced
    clean_logits: Tensor | None = None  # the clean run's logits at the read positions, for a metric that reads them


def prepare_pairs(vlm: VLM, pairs: Sequence) -> PairBatch:
    """The pairs as a `PairBatch`, the batches `effect`, the patching grids and the attribution methods run:
    ``clean`` and ``corrupt`` (`countlens.model.vlm.Batch`, one row per pair, positions checked to line up:
    the same token count, image grid and tiles on both sides), ``clean_id`` / ``corrupt_id`` (per pair the
    clean and the corrupt answer's token where the two answers first differ: the metric reads the logits
    there) and ``forced`` (per pair the token ids of the shared answer prefix).

    The forced prefix: answers are compared as token sequences (`countlens.model.answers.divergence`), and
    the tokens the two answers share before they differ are teacher-forced after the prompt on both sides,
    so the next token is the first that tells them apart. "10" and "12" share "1" where digits split;
    "circle: 3" and "circle: 5" share "circle", ":" and a tokenizer's word mark ("▁" in a SentencePiece
    vocabulary such as Gemma's). Both batches are then longer than the prompt by that prefix: values
    recorded on ``vlm.prepare_samples(...)`` of the same samples are a donor of another layout (written by
    position name, and refused at ``"last"``, which holds the prefix here). Let a `Patch` without
    ``values=`` copy each pair's corrupt run, or record the donor on the prepared batch itself:
    ``Patch(site, values=record(vlm, pb.corrupt, [site])[site], into=[p.clean for p in pairs])`` with
    ``pb = prepare_pairs(vlm, pairs)``. Answers that tokenise identically, or one a prefix of the other,
    are refused (no token tells them apart). Nothing runs the model.
    """
    require_vlm(vlm, "prepare_pairs")
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
    clean_id, corrupt_id = torch.tensor([c for _, c, _ in split]), torch.tensor([d for _, _, d in split])
    return PairBatch(clean, corrupt, clean_id, corrupt_id, forced=[list(f) for f in forced])


def logit_diff(
    logits: Float[Tensor, "pairs vocab"], clean_id: Int[Tensor, " pairs"], corrupt_id: Int[Tensor, " pairs"]
) -> Float[Tensor, " pairs"]:
    """LD per pair: the clean answer's logit minus the corrupt answer's, at the read position."""
    rows = torch.arange(len(logits))
    return logits[rows, clean_id.to(logits.device)] - logits[rows, corrupt_id.to(logits.device)]


#: The noise rule's k: a normaliser Σ (M_corrupt − M_clean) smaller in magnitude than k standard errors of
#: that sum (√n · the per-pair differences' standard deviation) is noise, not a denominator.
NOISE_K = 2.0

_TOLERATE_NOISE: ContextVar[bool] = ContextVar("tolerate_noise", default=False)


@contextmanager
def tolerate_noise():
    """Inside, a normaliser below the noise rule is marked in the result (``attrs["normaliser_noisy"]``)
    instead of refused: what a report does, where one noisy stage should not stop the others."""
    token = _TOLERATE_NOISE.set(True)
    try:
        yield
    finally:
        _TOLERATE_NOISE.reset(token)


def normaliser(clean_sum: float, corrupt_sum: float, differences=None, metric: str = "logit_diff") -> float:
    """Σ M_corrupt − Σ M_clean, the denominator of every patching effect. Refused where it is zero or not
    finite (the pairs' two sides read alike, or a logit overflowed), and, given each pair's difference
    M_corrupt − M_clean (``differences``, two pairs or more), where its magnitude is below `NOISE_K`
    standard errors of the sum: the pairs' sides then differ by less than their own noise, and every effect
    would divide by noise (under `tolerate_noise`, `normaliser_stats` marks it instead)."""
    denom = float(corrupt_sum) - float(clean_sum)
    if not np.isfinite(denom) or denom == 0:
        raise InputError(
            f"the pairs' corrupt and clean runs give the same summed {metric} (Σ M_corrupt − Σ M_clean "
            f"= {denom}), so no effect can be normalised: the model reads the two sides of these pairs alike. "
            "Give pairs the model tells apart (e.g. counts further apart), or more pairs"
        )
    stats = normaliser_stats(denom, differences)
    if stats["normaliser_noisy"] and not _TOLERATE_NOISE.get():
        raise InputError(
            f"the normaliser Σ (M_corrupt − M_clean) of {metric} is {denom:.4g}, within {NOISE_K:g} standard "
            f"errors ({stats['normaliser_se']:.4g} each) of zero over {len(differences)} pairs: the two sides "
            "differ by less than the pairs' own noise, so every effect would be noise divided by noise. Give "
            "more pairs, pairs the model tells apart (counts further apart), or a model that reads the counts"
        )
    return denom


def normaliser_stats(denom: float, differences=None) -> dict:
    """The normaliser, the standard error of that sum from the per-pair ``differences`` (NaN under two
    pairs: no noise estimate), and whether it is below the noise rule: attrs for a result."""
    d = np.asarray([] if differences is None else differences, dtype=np.float64).ravel()
    se = float(np.std(d, ddof=1) * np.sqrt(len(d))) if len(d) >= 2 else float("nan")
    noisy = bool(np.isfinite(se) and abs(denom) < NOISE_K * se)
    return {"normaliser": float(denom), "normaliser_se": se, "normaliser_noisy": int(noisy)}


def pairs_provenance(vlm: VLM, pairs: Sequence, **extra) -> dict:
    """A result's provenance: the model, how many pairs of which kinds it read, and the counts they cover
    (``counts``: {"clean->corrupt": pairs}, from `countlens.datasets.pairs.count_table`, where the pairs
    carry their counts)."""
    kinds = sorted({getattr(p, "kind", "?") for p in pairs})
    dataset: dict = {"pairs": len(pairs), "kinds": kinds}
    try:
        table = count_table(pairs)
    except InputError:  # loaded pairs without counts: nothing to tabulate
        table = None
    if table is not None:
        cells = table.stack(cell=("clean", "corrupt"))
        dataset["counts"] = {f"{c}->{d}": int(n) for (c, d), n in zip(cells.cell.values, cells.values) if n}
    return provenance(vlm.name, vlm.arch.name, dataset=dataset, samples=pairs, **extra)
