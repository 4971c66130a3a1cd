"""Losses of the circuit-guided fine-tune, all differentiable through attention probabilities.

- `answer_ce`: next-token cross-entropy on the answer tokens only (labels −100 elsewhere).
- `focus_loss` (Counting Circuits): the head-mean attention of each target position over the
  image tokens, renormalised to a distribution, is pulled toward a Gaussian prior around the object
  centres on the token grid (σ = 1 cell by default), by cross-entropy −Σ prior·log attention. It is
  smallest — equal to the prior's entropy — when the attention equals the prior.
- `mas_loss` (Counting to Four): the modality attention share MAS = Σ attention on image tokens
  (head-mean) per target position and layer; the loss is the hinge max(0, τ − MAS), τ = 0.4, mean
  over target tokens (``reduce="token"``) or first over each sample's answer tokens then over samples
  (``reduce="sample"``, the length-normalised variant: long answers weigh as much as short ones).

Attention tensors are Float[Tensor, "batch heads seq seq"] per target layer (a list), as captured
by `countlens.training.capture.attention_at`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from countlens.errors import InputError
from countlens.training.collate import IGNORE

if TYPE_CHECKING:
    from countlens.vlm import Batch


def answer_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of the answer tokens: logits Float[Tensor, "batch seq vocab"]."""
    shifted = logits[:, :-1].float()
    target = labels[:, 1:].to(logits.device)
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), ignore_index=IGNORE)


def gaussian_prior(centres: Sequence[tuple[float, float]], grid: tuple[int, int], sigma: float = 1.0) -> Tensor:
    """Float[Tensor, "rows cols"], summing to 1: Gaussians (σ in cells) around (row, col) centres in cell units.

    With no objects the prior is uniform (nothing to focus on)."""
    rows, cols = grid
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
    losses = []
    for a in attn:
        mean = a.mean(1)  # batch seq seq: head-mean
        for b, (pos, prior) in enumerate(zip(image_pos, priors)):
            q = targets[b].nonzero(as_tuple=True)[0].to(mean.device)
            vis = mean[b][q][:, pos.to(mean.device)]  # targets × image tokens
            dist = vis / vis.sum(-1, keepdim=True).clamp(min=eps)
            losses.append(-(prior.to(dist.device, dist.dtype)[None] * (dist + eps).log()).sum(-1))
    return torch.cat(losses).mean()


def modality_share(attn: Sequence[Tensor], targets: Tensor, image_mask: Tensor) -> Tensor:
    """Float[Tensor, "layer batch seq"]: MAS at every position (meaningful at the targets)."""
    return torch.stack([(a.mean(1) * image_mask[:, None, :].to(a.device, a.dtype)).sum(-1) for a in attn])


#: How `mas_loss` averages its hinge: over target tokens, or per sample first.
MAS_REDUCE: tuple[str, ...] = ("token", "sample")


def mas_loss(
    attn: Sequence[Tensor], targets: Tensor, image_mask: Tensor, tau: float = 0.4, reduce: str = "token"
) -> Tensor:
    """Hinge max(0, τ − MAS) at the target positions of each target layer."""
    mas = modality_share(attn, targets, image_mask)
    hinge = (tau - mas).clamp(min=0)
    t = targets.to(hinge.device)
    if reduce == "token":
        return hinge[:, t].mean()
    if reduce == "sample":
        per_sample = (hinge * t).sum(-1) / t.sum(-1).clamp(min=1)
        return per_sample.mean()
    raise InputError(f"reduce must be one of {MAS_REDUCE}, got {reduce!r}")
