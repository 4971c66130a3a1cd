"""Losses of the circuit-guided fine-tune, all differentiable through attention probabilities.

- `answer_ce`: next-token cross-entropy on the answer tokens only (labels −100 elsewhere).
- `focus_loss` (Counting Circuits): the head-mean attention of each target position over the
  image tokens, renormalised to a distribution, is pulled toward a Gaussian prior around the object
  centres on the token grid (σ = 1 cell by default), by cross-entropy −Σ prior·log attention. It is
  smallest — equal to the prior's entropy — when the attention equals the prior.
- `mas_loss` (Counting to Four): the modality attention share MAS = Σ attention on image tokens
  (head-mean) per target position and layer; the loss is the hinge max(0, τ − MAS), τ = 0.4, mean
  over target tokens (``reduce="token"``) or first over each sample's answer tokens then over samples
  (``reduce="sample"``, the length-normalised variant: long answers weigh as much as short ones) —
  both countlens's own — or as the paper's code computes it (``reduce="paper"``: the share averaged
  per sample over heads, answer positions and layers before the hinge, on wrong answers only,
  `wrong_answers`).

Attention tensors are Float[Tensor, "batch heads seq seq"] per target layer (a list), as captured
by `countlens.training.capture.attention_at`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from countlens.errors import InputError
from countlens.settings import MAS_REDUCE
from countlens.training.collate import IGNORE
from countlens.validate import (
    require_choice,
    require_count,
    require_nonnegative,
    require_positive,
    require_sequence,
    require_share,
    require_tensor,
)

if TYPE_CHECKING:
    from countlens.model.vlm import Batch


def answer_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of the answer tokens: logits Float[Tensor, "batch seq vocab"], labels
    Int[Tensor, "batch seq"] (`countlens.training.collate.IGNORE` where no answer token is)."""
    require_tensor(logits, "logits", 3)
    require_tensor(labels, "labels", 2)
    if labels.is_floating_point() or labels.shape != logits.shape[:2]:
        raise InputError(f"labels must be integer ids shaped like logits' (batch, seq) {tuple(logits.shape[:2])}")
    shifted = logits[:, :-1].float()
    target = labels[:, 1:].to(logits.device)
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), ignore_index=IGNORE)


def gaussian_prior(centres: Sequence[tuple[float, float]], grid: tuple[int, int], sigma: float = 1.0) -> Tensor:
    """Float[Tensor, "rows cols"], summing to 1: Gaussians (σ in cells) around (row, col) centres in cell units.

    With no objects the prior is uniform (nothing to focus on)."""
    if isinstance(grid, (str, bytes)) or not isinstance(grid, (tuple, list)) or len(grid) != 2:
        raise InputError(f"grid must be (rows, cols), e.g. vlm.geometry.token_grid; got {grid!r:.60}")
    rows, cols = (require_count(n, "each side of grid") for n in grid)
    require_positive(sigma, "sigma")
    empty = isinstance(centres, (list, tuple)) and not centres
    centres = [] if empty else require_sequence(centres, "centres", example="[(2.5, 3.0)]")
    for centre in centres:
        if isinstance(centre, (str, bytes)) or not isinstance(centre, (tuple, list)) or len(centre) != 2:
            raise InputError(f"each centre is a (row, col) pair in cell units; got {centre!r:.60}")
        for x in centre:
            require_nonnegative(x, "a centre's row or col")
    r = torch.arange(rows, dtype=torch.float32)[:, None] + 0.5
    c = torch.arange(cols, dtype=torch.float32)[None, :] + 0.5
    prior = torch.zeros(rows, cols)
    for cr, cc in centres:
        prior += torch.exp(-((r - cr) ** 2 + (c - cc) ** 2) / (2 * sigma**2))
    if not len(centres):
        prior += 1.0
    return prior / prior.sum()


def object_prior(batch: Batch, samples: Sequence, sigma: float = 1.0) -> list[Tensor]:
    """Per sample, the prior over its image tokens (in `Batch.image_pos` order), from scene objects."""
    priors = []
    for b, s in enumerate(samples):
        g = batch.geometry[b]
        unit = g.token_size
        centres = [(o.cy / unit, o.cx / unit) for o in s.scene.objects]
        grid_prior = gaussian_prior(centres, g.token_grid, sigma)
        cell = batch.image_cell[b]
        p = torch.zeros(len(cell))
        ok = cell[:, 0] >= 0
        p[ok] = grid_prior[cell[ok, 0], cell[ok, 1]]
        priors.append(p / p.sum().clamp(min=1e-12))
    return priors


def focus_loss(
    attn: Sequence[Tensor], targets: Tensor, image_pos: Sequence[Tensor], priors: Sequence[Tensor], eps: float = 1e-8
) -> Tensor:
    """Cross-entropy between each prior and the head-mean attention over image tokens, renormalised;
    mean over target layers, target positions and samples."""
    _check_attention(attn, targets)
    for name, items in (("image_pos", image_pos), ("priors", priors)):
        if isinstance(items, (str, bytes, Tensor)) or not isinstance(items, Sequence) or len(items) != len(targets):
            raise InputError(f"{name} must be a list of one tensor per sample ({len(targets)}); got {items!r:.60}")
        for item in items:
            require_tensor(item, f"each of {name}", 1)
    require_positive(eps, "eps")
    losses = []
    for a in attn:
        mean = a.mean(1)  # batch seq seq: head-mean
        for b, (pos, prior) in enumerate(zip(image_pos, priors)):
            q = targets[b].nonzero(as_tuple=True)[0].to(mean.device)
            vis = mean[b][q][:, pos.to(mean.device)]  # targets × image tokens
            dist = vis / vis.sum(-1, keepdim=True).clamp(min=eps)
            losses.append(-(prior.to(dist.device, dist.dtype)[None] * (dist + eps).log()).sum(-1))
    return torch.cat(losses).mean()


def _check_attention(attn: Sequence[Tensor], targets: Tensor) -> None:
    """Attention maps Float[Tensor, "batch heads seq seq"] per layer, and Bool / 0-1 targets (batch, seq)."""
    if isinstance(attn, (str, bytes, Tensor)) or not isinstance(attn, Sequence) or not len(attn):
        raise InputError(f"attn must be a non-empty list of one attention map per layer; got {attn!r:.60}")
    for a in attn:
        require_tensor(a, "each attention map", 4)
    require_tensor(targets, "targets", 2)
    if targets.shape[0] != attn[0].shape[0] or targets.shape[1] != attn[0].shape[-1]:
        raise InputError(f"targets {tuple(targets.shape)} must be (batch, seq) of the maps {tuple(attn[0].shape)}")


def modality_share(attn: Sequence[Tensor], targets: Tensor, image_mask: Tensor) -> Tensor:
    """Float[Tensor, "layer batch seq"]: MAS at every position (meaningful at the targets)."""
    return torch.stack([(a.mean(1) * image_mask[:, None, :].to(a.device, a.dtype)).sum(-1) for a in attn])


def mas_loss(
    attn: Sequence[Tensor],
    targets: Tensor,
    image_mask: Tensor,
    tau: float = 0.4,
    reduce: str = "token",
    wrong: Tensor | None = None,
) -> Tensor:
    """The MAS hinge max(0, τ − MAS) over the target positions of the target layers.

    ``reduce="token"`` / ``"sample"`` (**countlens's own**): the hinge at every (layer, target
    position), averaged over them (``token``) or per sample first (``sample``), on every sample.
    ``reduce="paper"``: as the paper's code computes it (`MAS_w_Ovis/ovis/model/mas_loss.py`,
    ``MASLoss``): per sample, each head's attention on image tokens ÷ its total, averaged over heads,
    target positions and layers, *then* the hinge; times ``wrong`` (Bool[Tensor, "batch"], the samples
    whose answer is wrong — see `wrong_answers`; None: every sample), and the batch mean with the right
    samples' zeros kept. The code's targets are the answer tokens' own positions (``labels != -100``);
    `countlens.training.finetune` passes those under this reduction. (The code takes the union of the
    batch's answer positions for every sample, an artefact of its padding; here each sample has its own.)
    """
    require_choice(reduce, "reduce", MAS_REDUCE)
    _check_attention(attn, targets)
    require_tensor(image_mask, "image_mask", 2)
    require_share(tau, "tau")
    if reduce == "paper":
        return _paper_mas_loss(attn, targets, image_mask, tau, wrong)
    if wrong is not None:
        raise InputError(
            "wrong= masks samples under reduce='paper' (the paper's code); 'token' and 'sample' hinge every one"
        )
    mas = modality_share(attn, targets, image_mask)
    hinge = (tau - mas).clamp(min=0)
    t = targets.to(hinge.device)
    if reduce == "token":
        return hinge[:, t].mean()
    per_sample = (hinge * t).sum(-1) / t.sum(-1).clamp(min=1)
    return per_sample.mean()


def _paper_mas_loss(
    attn: Sequence[Tensor], targets: Tensor, image_mask: Tensor, tau: float, wrong: Tensor | None
) -> Tensor:
    per_layer = []
    for a in attn:  # Float[Tensor, "batch heads seq seq"]
        t = targets.to(a.device, a.dtype)
        image = image_mask[:, None, None, :].to(a.device, a.dtype)
        share = (a * image).sum(-1) / (a.sum(-1) + 1e-8)  # batch heads seq: per head and query row
        on_targets = (share * t[:, None, :]).sum(-1) / t.sum(-1).clamp(min=1)[:, None]  # batch heads
        per_layer.append(on_targets.mean(1).to(attn[0].device))  # layers may sit on several devices
    mas = torch.stack(per_layer).mean(0)  # Float[Tensor, "batch"]
    hinge = (tau - mas).clamp(min=0)
    if wrong is not None:
        hinge = hinge * wrong.to(hinge.device, hinge.dtype)
    return hinge.mean()


def wrong_answers(logits: Tensor, labels: Tensor, tokenizer) -> Tensor:
    """Bool[Tensor, "batch"]: the samples whose teacher-forced answer is wrong, as the paper's code
    tests it (``_validate_counting_batch``): the last number in the decoded arg-max answer against the
    last number of the gold answer; no number on either side is wrong.

    Read at the positions that *predict* the answer tokens (logits p for label p + 1). The code reads
    the arg-max at the answer tokens' own positions, one token late (its first answer token is never
    read); countlens reads the intended, shifted one. The code's text-quality checks (length > 10, no
    repeated words …), which a short answer passes at its 70 % threshold, are left out."""
    pred = logits[:, :-1].detach().argmax(-1).cpu()
    gold = labels[:, 1:].cpu()
    out = []
    for p, g in zip(pred, gold):
        keep = g != IGNORE
        said = re.findall(r"\d+", tokenizer.decode(p[keep].tolist(), skip_special_tokens=True))
        meant = re.findall(r"\d+", tokenizer.decode(g[keep].tolist(), skip_special_tokens=True))
        out.append(not (said and meant and int(said[-1]) == int(meant[-1])))
    return torch.tensor(out, dtype=torch.bool)
