"""Detections scored: box overlap (IoU, GIoU), greedy non-maximum suppression and class-agnostic
AP@50 with COCO's 101-point interpolation — what a detection probe's boxes are trained and judged by.

Boxes are xyxy (x0, y0, x1, y1); a detection is a row (x0, y0, x1, y1, score). `average_precision`
pools every image's detections by score and matches each, within its image, to the unclaimed
ground-truth box it overlaps most (`countlens.analysis.probes` trains and scores its probes with
these; the MAS paper's code matches otherwise: `countlens.reference.counting_to_four.probe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from countlens.errors import InputError

if TYPE_CHECKING:
    from jaxtyping import Float, Int


def box_iou(a: Float[Tensor, "n 4"], b: Float[Tensor, "m 4"]) -> Float[Tensor, "n m"]:
    """IoU of every xyxy box in ``a`` with every one in ``b``."""
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area = lambda x: (x[:, 2:] - x[:, :2]).clamp(min=0).prod(-1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter).clamp(min=1e-12)


def giou(a: Float[Tensor, "n 4"], b: Float[Tensor, "n 4"]) -> Float[Tensor, " n"]:
    """Generalised IoU of paired xyxy boxes ``a[i]``, ``b[i]`` (in [−1, 1])."""
    lt, rb = torch.maximum(a[:, :2], b[:, :2]), torch.minimum(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a, area_b = (a[:, 2:] - a[:, :2]).prod(-1), (b[:, 2:] - b[:, :2]).prod(-1)
    union = area_a + area_b - inter
    hull = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).prod(-1)
    return inter / union.clamp(min=1e-12) - (hull - union) / hull.clamp(min=1e-12)


def nms(boxes: Float[Tensor, "n 4"], scores: Float[Tensor, " n"], iou: float = 0.5) -> Int[Tensor, " kept"]:
    """Greedy non-maximum suppression: indices (int64) of kept boxes by falling score.

    Boxes are taken in order of score (ties: the earlier index first); a box is dropped when its IoU
    with an already kept box exceeds ``iou``.
    """
    if boxes.ndim != 2 or boxes.shape[-1] != 4 or scores.shape != boxes.shape[:1]:
        raise InputError(f"nms needs boxes (n, 4) and scores (n,); got {tuple(boxes.shape)} and {tuple(scores.shape)}")
    order = torch.from_numpy(np.argsort(-scores.detach().cpu().numpy(), kind="stable"))
    overlap = box_iou(boxes, boxes)
    suppressed = torch.zeros(len(boxes), dtype=torch.bool)
    keep = []
    for i in order.tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= overlap[i] > iou
    return torch.tensor(keep, dtype=torch.long)


def _match(pred: np.ndarray, gt: np.ndarray, iou: float) -> np.ndarray:
    """Bool (n_pred,): true positives of one image's detections, taken by falling score.

    Each detection claims the unclaimed ground-truth box it overlaps most, if that IoU ≥ ``iou``;
    a detection of an already claimed object (a duplicate) is a false positive.
    """
    tp = np.zeros(len(pred), dtype=bool)
    if len(pred) == 0 or len(gt) == 0:
        return tp
    overlap = box_iou(
        torch.as_tensor(pred[:, :4], dtype=torch.float64), torch.as_tensor(gt, dtype=torch.float64)
    ).numpy()
    claimed = np.zeros(len(gt), dtype=bool)
    for i in np.argsort(-pred[:, 4], kind="stable"):
        cand = np.where(claimed, -1.0, overlap[i])
        j = int(cand.argmax())
        if cand[j] >= iou:
            claimed[j] = tp[i] = True
    return tp


def average_precision(preds: Sequence[np.ndarray], gt_boxes: Sequence[np.ndarray], iou: float = 0.5) -> float:
    """Class-agnostic AP at IoU ``iou`` (AP@50 by default), COCO-style with 101-point interpolation.

    ``preds[i]`` is image i's (n, 5) detections (x0, y0, x1, y1, score), ``gt_boxes[i]`` its (m, 4)
    boxes. Detections of all images are pooled and ranked by score (ties keep input order); within an
    image each is matched greedily (`_match`). Precision is made monotone (each value replaced by the
    best precision at any higher recall) and read at recalls 0, 0.01, …, 1: at each, the precision of
    the first rank reaching that recall, or 0 if none does. AP is the mean of these 101 values.
    """
    if len(preds) != len(gt_boxes):
        raise InputError(
            f"got predictions for {len(preds)} images but ground truth for {len(gt_boxes)}; pass one of each per image"
        )
    n_gt = sum(len(g) for g in gt_boxes)
    if n_gt == 0:
        raise InputError("gt_boxes holds no objects, so AP is undefined; evaluate on images with objects")
    scores, hits = [], []
    for p, g in zip(preds, gt_boxes):
        p = np.asarray(p, dtype=float).reshape(-1, 5)
        scores.append(p[:, 4])
        hits.append(_match(p, np.asarray(g, dtype=float).reshape(-1, 4), iou))
    scores, hits = np.concatenate(scores), np.concatenate(hits)
    if len(scores) == 0:
        return 0.0
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(hits[order])
    recall = tp / n_gt
    precision = tp / np.arange(1, len(tp) + 1)
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    at = np.searchsorted(recall, np.linspace(0, 1, 101), side="left")
    return float(np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0).mean())
