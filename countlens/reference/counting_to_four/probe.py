"""Detection probes as the MAS paper's code trains them (``models_probing/train_compare.py --head yolo``).

The same question as `countlens.analysis.probes` — how much localised object evidence a tap still
holds — answered with the paper's recipe instead of countlens's, written from its description:

- **Bottleneck** (``probes/bottleneck.py``), only when the tap is wider than 512 channels: a 1×1
  convolution to 512 (no bias), GroupNorm(32, eps 1e-3), SiLU — **never trained** (the code builds it
  with a random initialisation and applies it under ``no_grad``; here it is seeded, the code's is not).
- **Head** (``probes/yolo_head.py``): 3×3 conv to 256 (no bias), BatchNorm (eps 1e-3, momentum 0.03),
  SiLU, the same again, then a 1×1 conv to 5 + classes outputs per cell — (tx, ty, tw, th, objectness,
  classes…), objectness bias −1, class biases −2.19. A box is centred at ((gx + σ(tx)) / W,
  (gy + σ(ty)) / H) with width σ(tw) and height σ(th) of the image, clamped to it.
- **Targets**: every cell of the 3 × 3 block around an object's centre cell is a positive for it; a
  cell keeps the first object that claims it (the code's nearer-object test compares a distance with
  itself, so the first in order always wins).
- **Loss**: CIoU loss over the positive cells (mean) + BCE of objectness against the predicted box's
  IoU with its target (detached; 0 off the positives), positive weight 3, mean over every cell + class
  BCE over the positive cells (mean).
- **Training**: 10 epochs, batch 4 (shuffled, the last short batch dropped), AdamW lr 2e-3, weight
  decay 1e-3, created anew each epoch, with a cosine from lr to 0.1·lr over that epoch's steps,
  gradients clipped to norm 0.5.
- **Evaluation**: score σ(objectness)·max σ(class) > 0.25, class-aware NMS at IoU 0.5, then a
  class-agnostic AP@50 with 101-point interpolation (`reference_ap50`): within an image each detection
  takes the ground-truth box it overlaps most — a hit if IoU ≥ 0.5 and that box is not yet taken,
  else a false positive (no second choice) — then all images pooled by score.

Departures, countlens's: the bottleneck's initialisation and the batch order are seeded; a tap's
tokens are laid out on its grid in raster order (`countlens.circuits.lenses.taps`) and not z-scored (the
code standardises its vision tap over the whole tensor of each image), where the code reshapes
Qwen2.5-VL's window-ordered tokens as they come (scrambled within bands of 4 token rows) and pads
its LLM tap with zeros; the last epoch's AP is reported, as the code's ``final_ap``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from countlens.datasets.scene import SHAPES
from countlens.errors import InputError
from countlens.model.adapt import module_of

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM


@dataclass(frozen=True)
class ReferenceProbeConfig:
    """The code's values (``train_compare.py``); ``seed`` is countlens's."""

    width: int = 512  # bottleneck channels, for taps wider than this
    hidden: int = 256  # the head's 3×3 conv channels
    epochs: int = 10
    batch_size: int = 4
    lr: float = 2e-3
    weight_decay: float = 1e-3
    lr_floor: float = 0.1  # the per-epoch cosine ends at lr_floor · lr
    clip: float = 0.5
    obj_pos_weight: float = 3.0
    score_threshold: float = 0.25
    nms_iou: float = 0.5
    seed: int = 0


class ReferenceProbe(nn.Module):
    """The code's frozen bottleneck (taps wider than ``width``) and its BatchNorm YOLO head."""

    def __init__(self, in_channels: int, n_classes: int, config: ReferenceProbeConfig = ReferenceProbeConfig()):
        super().__init__()
        self.n_classes = n_classes
        if in_channels > config.width:
            self.bottleneck = nn.Sequential(
                nn.Conv2d(in_channels, config.width, 1, bias=False),
                nn.GroupNorm(min(32, config.width), config.width, eps=1e-3),
                nn.SiLU(),
            )
            self.bottleneck.requires_grad_(False)
            width = config.width
        else:
            self.bottleneck, width = nn.Identity(), in_channels
        h = config.hidden

        def block(a: int, b: int) -> list[nn.Module]:
            return [nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b, eps=1e-3, momentum=0.03), nn.SiLU()]

        self.head = nn.Sequential(*block(width, h), *block(h, h), nn.Conv2d(h, 5 + n_classes, 1))
        with torch.no_grad():
            self.head[-1].bias[4] = -1.0
            self.head[-1].bias[5:] = -2.19

    def forward(self, x: Float[Tensor, "batch d rows cols"]) -> Float[Tensor, "batch out rows cols"]:
        with torch.no_grad():
            x = self.bottleneck(x.float())
        return self.head(x)

    @property
    def n_params(self) -> int:
        """Trained parameters (the frozen bottleneck is not counted)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def decode(out: Float[Tensor, "batch out rows cols"]) -> tuple[Tensor, Tensor, Tensor]:
    """(boxes Float[batch rows cols 4] xyxy in image fractions, objectness logits, class logits)."""
    b, _, rows, cols = out.shape
    gy, gx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    cx = (gx + torch.sigmoid(out[:, 0])) / cols
    cy = (gy + torch.sigmoid(out[:, 1])) / rows
    w, h = torch.sigmoid(out[:, 2]), torch.sigmoid(out[:, 3])
    boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1).clamp(0, 1)
    return boxes, out[:, 4], out[:, 5:].permute(0, 2, 3, 1)


def targets(
    boxes: Sequence[np.ndarray], labels: Sequence[np.ndarray], rows: int, cols: int, n_classes: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(positive Bool[batch rows cols], box Float[batch rows cols 4], one-hot Float[batch rows cols classes]);
    ``boxes[i]`` (n, 4) xyxy in image fractions, ``labels[i]`` (n,) class indices."""
    n = len(boxes)
    pos = torch.zeros(n, rows, cols, dtype=torch.bool)
    box = torch.zeros(n, rows, cols, 4)
    onehot = torch.zeros(n, rows, cols, n_classes)
    for i, (bx, lb) in enumerate(zip(boxes, labels)):
        for (x0, y0, x1, y1), c in zip(np.asarray(bx, dtype=float).reshape(-1, 4), np.asarray(lb).reshape(-1)):
            gx = min(int((x0 + x1) / 2 * cols), cols - 1)
            gy = min(int((y0 + y1) / 2 * rows), rows - 1)
            for r in range(max(0, gy - 1), min(rows, gy + 2)):
                for q in range(max(0, gx - 1), min(cols, gx + 2)):
                    if not pos[i, r, q]:  # the first object to claim a cell keeps it
                        pos[i, r, q] = True
                        box[i, r, q] = torch.tensor([x0, y0, x1, y1])
                        onehot[i, r, q, int(c)] = 1.0
    return pos, box, onehot


def iou_aligned(a: Float[Tensor, "n 4"], b: Float[Tensor, "n 4"], eps: float = 1e-7) -> Float[Tensor, " n"]:
    """IoU of box i of ``a`` with box i of ``b`` (xyxy)."""
    inter = (torch.minimum(a[:, 2:], b[:, 2:]) - torch.maximum(a[:, :2], b[:, :2])).clamp(min=0).prod(-1)
    area = lambda x: (x[:, 2:] - x[:, :2]).clamp(min=0).prod(-1)  # noqa: E731
    return inter / (area(a) + area(b) - inter + eps)


def ciou_loss(p: Float[Tensor, "n 4"], t: Float[Tensor, "n 4"], eps: float = 1e-7) -> Float[Tensor, " n"]:
    """1 − CIoU: IoU minus the centre distance over the enclosing box's diagonal², minus α·v (aspect)."""
    pw, ph = (p[:, 2] - p[:, 0]).clamp(min=eps), (p[:, 3] - p[:, 1]).clamp(min=eps)
    tw, th = (t[:, 2] - t[:, 0]).clamp(min=eps), (t[:, 3] - t[:, 1]).clamp(min=eps)
    inter = (torch.minimum(p[:, 2:], t[:, 2:]) - torch.maximum(p[:, :2], t[:, :2])).clamp(min=0).prod(-1)
    iou = inter / (pw * ph + tw * th - inter + eps)
    cw = torch.maximum(p[:, 2], t[:, 2]) - torch.minimum(p[:, 0], t[:, 0])
    ch = torch.maximum(p[:, 3], t[:, 3]) - torch.minimum(p[:, 1], t[:, 1])
    rho2 = ((p[:, 0] + p[:, 2] - t[:, 0] - t[:, 2]) ** 2 + (p[:, 1] + p[:, 3] - t[:, 1] - t[:, 3]) ** 2) / 4
    v = 4 / math.pi**2 * (torch.atan(tw / th) - torch.atan(pw / ph)) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return 1 - (iou - rho2 / (cw**2 + ch**2 + eps) - alpha * v)


def reference_loss(out: Tensor, pos: Tensor, box: Tensor, onehot: Tensor, pos_weight: float = 3.0) -> Tensor:
    """The code's loss: CIoU (positives) + IoU-aware objectness BCE (every cell) + class BCE (positives)."""
    pred, obj, cls = decode(out)
    target = torch.zeros_like(obj)
    if not pos.any():
        weight = torch.tensor(pos_weight)
        return F.binary_cross_entropy_with_logits(obj, target, pos_weight=weight)
    p, t = pred[pos], box[pos]
    target[pos] = iou_aligned(p, t).detach()
    l_box = ciou_loss(p, t).mean()
    l_obj = F.binary_cross_entropy_with_logits(obj, target, pos_weight=torch.tensor(pos_weight))
    l_cls = F.binary_cross_entropy_with_logits(cls[pos], onehot[pos])
    return l_box + l_obj + l_cls


def fit_reference_probe(
    features: Float[Tensor, "sample d rows cols"],
    boxes: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    n_classes: int,
    config: ReferenceProbeConfig = ReferenceProbeConfig(),
) -> ReferenceProbe:
    """Train a `ReferenceProbe` as the code does; deterministic for ``config.seed``."""
    if len(features) != len(boxes) or len(boxes) != len(labels):
        raise InputError(f"got {len(features)} feature maps, {len(boxes)} box sets and {len(labels)} label sets")
    if len(features) < config.batch_size:
        raise InputError(f"{len(features)} training images, fewer than one batch of {config.batch_size}")
    x = features.detach().float().cpu()
    pos, box, onehot = targets(boxes, labels, x.shape[2], x.shape[3], n_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        probe = ReferenceProbe(x.shape[1], n_classes, config)
    gen = torch.Generator().manual_seed(config.seed)
    trained = [p for p in probe.parameters() if p.requires_grad]
    steps = len(x) // config.batch_size  # the last short batch dropped
    for _ in range(config.epochs):
        opt = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)  # anew each epoch
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=config.lr_floor * config.lr)
        probe.train()
        order = torch.randperm(len(x), generator=gen)[: steps * config.batch_size]
        for idx in order.split(config.batch_size):
            loss = reference_loss(probe(x[idx]), pos[idx], box[idx], onehot[idx], config.obj_pos_weight)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(trained, config.clip)
            opt.step()
            sched.step()
        probe.train_loss = float(loss.detach())  # the last step's loss
    probe.eval()
    return probe


def class_aware_nms(boxes: Tensor, scores: Tensor, classes: Tensor, iou: float) -> Tensor:
    """Indices kept by NMS within each class, by falling score."""
    keep = []
    for c in classes.unique():
        idx = (classes == c).nonzero().flatten()
        order = idx[scores[idx].argsort(descending=True, stable=True)]
        while len(order):
            i = order[0]
            keep.append(int(i))
            if len(order) == 1:
                break
            rest = order[1:]
            overlap = iou_aligned(boxes[i].expand(len(rest), 4), boxes[rest])
            order = rest[overlap <= iou]
    keep = torch.tensor(keep, dtype=torch.long)
    return keep[scores[keep].argsort(descending=True, stable=True)] if len(keep) else keep


@torch.no_grad()
def predict_reference(
    probe: ReferenceProbe, features: Tensor, config: ReferenceProbeConfig = ReferenceProbeConfig()
) -> list[np.ndarray]:
    """Per image, (n, 5) detections (x0, y0, x1, y1 in image fractions, score): the code's threshold and
    class-aware NMS."""
    probe.eval()
    boxes, obj, cls = decode(probe(features.float().cpu()))
    prob = torch.sigmoid(cls)
    best, label = prob.max(-1)
    score = torch.sigmoid(obj) * best
    out = []
    for b in range(len(boxes)):
        keep = score[b] > config.score_threshold
        bx, sc, lb = boxes[b][keep], score[b][keep], label[b][keep]
        kept = class_aware_nms(bx, sc, lb, config.nms_iou)
        out.append(torch.cat([bx[kept], sc[kept, None]], 1).numpy().reshape(-1, 5))
    return out


def reference_ap50(preds: Sequence[np.ndarray], gt_boxes: Sequence[np.ndarray], iou: float = 0.5) -> float:
    """The code's class-agnostic AP@50: per image, detections by falling score each take the ground-truth
    box they overlap most (a hit when IoU ≥ ``iou`` and it is not yet taken; else a false positive, with
    no second choice); all images pooled by score; AP = the mean over recalls 0, 0.01 … 1 of the best
    precision at a recall at least that (0 where none reaches it)."""
    n_gt = sum(len(np.asarray(g).reshape(-1, 4)) for g in gt_boxes)
    if n_gt == 0:
        raise InputError("no ground-truth boxes: AP is undefined")
    scores, hits = [], []
    for p, g in zip(preds, gt_boxes):
        p, g = np.asarray(p, dtype=float).reshape(-1, 5), np.asarray(g, dtype=float).reshape(-1, 4)
        taken = np.zeros(len(g), dtype=bool)
        for i in np.argsort(-p[:, 4], kind="stable"):
            scores.append(p[i, 4])
            if not len(g):
                hits.append(False)
                continue
            overlap = iou_aligned(torch.as_tensor(p[i : i + 1, :4]).expand(len(g), 4), torch.as_tensor(g)).numpy()
            j = int(overlap.argmax())
            hit = overlap[j] >= iou and not taken[j]
            taken[j] |= hit
            hits.append(bool(hit))
    if not scores:
        return 0.0
    order = np.argsort(-np.array(scores), kind="stable")
    tp = np.cumsum(np.array(hits)[order])
    recall = tp / n_gt
    precision = tp / np.arange(1, len(tp) + 1)
    return float(
        np.mean([precision[recall >= r].max() if (recall >= r).any() else 0.0 for r in np.linspace(0, 1, 101)])
    )


def sample_targets(samples: Sequence) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Boxes (image fractions), class indices and the number of classes of the samples: a VOC
    `DetectionSample`'s own (20 classes), or a scene's objects with their shapes as classes (`SHAPES`)."""
    boxes, labels, classes = [], [], set()
    for s in samples:
        if hasattr(s, "labels"):  # a DetectionSample: boxes in its letterboxed pixels
            boxes.append(np.asarray(s.boxes, dtype=float).reshape(-1, 4) / s.side)
            labels.append(np.asarray(s.labels, dtype=int))
            classes.add(len(s.classes))
        elif getattr(s, "scene", None) is not None:
            scale = np.array([s.scene.width, s.scene.height] * 2, dtype=float)
            boxes.append(s.scene.boxes().reshape(-1, 4) / scale)
            labels.append(np.array([SHAPES.index(o.shape) for o in s.scene.objects], dtype=int))
            classes.add(len(SHAPES))
        else:
            raise InputError("probe samples need boxes: scene samples (COUNTINGTRICKS) or VOC DetectionSamples")
    if len(classes) != 1:
        raise InputError("probe samples mix VOC images and scenes; train and test on one kind")
    return boxes, labels, classes.pop()


def reference_taps(vlm: VLM) -> tuple[tuple[str, int | None], ...]:
    """The MAS paper's code's three taps (``models_probing/adapters/qwen25vl.py``), as (kind, index) for
    `countlens.circuits.lenses.taps.tap`: the vision encoder's second-to-last block, the projector's output
    and the decoder's second-to-last layer (which the code reads after the final norm; countlens reads
    the residual stream)."""
    blocks = len(module_of(vlm.hf, vlm.arch.spec.vision_blocks))
    return (("vision", blocks - 2), ("projector", None), ("llm", vlm.arch.n_layers - 2))
