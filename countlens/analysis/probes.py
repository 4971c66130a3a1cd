"""Detection probes: how well can a tiny YOLO head find the objects in one tap of the model?

Following "Counting to Four is still a Chore for VLMs", a frozen model's activations at a tap
(`countlens.circuits.lenses.taps`: a vision block, the projector output, or a decoder layer at the image
tokens) are laid out as a feature map Float[Tensor, "sample d rows cols"], and the *same* small
detector is trained on every tap: a 1×1 convolution down to ``config.hidden`` channels (the only
part whose size depends on the tap's width d), GroupNorm, SiLU, then a YOLO-style head (3×3 conv
to ``config.head_hidden`` channels → GroupNorm → SiLU → 1×1 conv to 5 outputs per cell; the
paper's capacity, 1.7–2.2 M parameters, is `presets.probe_config("counting-to-four")`). Each grid
cell makes one anchor-free prediction: an objectness logit and a box (dx, dy, log w, log h)
relative to the cell — the centre is
``cell + 2·sigmoid(dx) − 0.5`` cells (YOLOv5's range, −0.5…1.5, so a box may sit just outside its
cell) and the size ``exp(log w)`` cells. An object is the target of the cell containing its centre;
when two objects' centres fall in one cell, the one nearer the cell centre keeps it and the other
moves to the free edge-neighbour on its nearer side (its centre stays within reach of the offset
range); an object with no free such neighbour is dropped from the targets (its ground-truth box
stays in the evaluation, so it counts as a miss). Training minimises BCE on objectness over all
cells plus (1 − GIoU) over the target cells, with AdamW. Inputs are standardised per channel with
the training set's mean and standard deviation (stored in the probe), so residual-stream taps with
large outlier channels train like the others. Detections are decoded, filtered by score and
de-duplicated with greedy NMS, and scored by class-agnostic AP@50 with COCO's 101-point
interpolation (`countlens.analysis.detection`). Because the probe's capacity is the same everywhere and tiny
next to the model, a difference in AP between taps measures how much *localised* object evidence the
representation still holds — the paper finds it high at the projector and lower in the LLM.

    from countlens.analysis.probes import ProbeConfig, probe_taps
    ds = probe_taps(vlm, train, test, taps=[("vision", 1), ("projector", None), ("llm", 2)])
    ds.ap50.to_series()
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor, nn
from torch.nn import functional as F

from countlens.analysis.detection import average_precision, giou, nms
from countlens.circuits.lenses.taps import tap as read_tap
from countlens.errors import ConfigError, InputError
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_samples
from countlens.reference.counting_to_four import probe as reference_probe
from countlens.results import provenance
from countlens.validate import (
    require_count,
    require_nonnegative,
    require_positive,
    require_seed,
    require_sequence,
    require_share,
)

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM

#: A tap: (kind, index), as `countlens.circuits.lenses.taps.tap` takes them.
Tap = tuple[str, int | None]
DEFAULT_TAPS: tuple[Tap, ...] = (("vision", 0), ("vision", 1), ("projector", None), ("llm", 0), ("llm", 2), ("llm", 5))


@dataclass(frozen=True)
class ProbeConfig:
    """Hyper-parameters of the probe and its training; one config is used for every tap."""

    hidden: int = (
        64  # bottleneck channels: countlens's own (the paper's width: presets.probe_config("counting-to-four"))
    )
    head_hidden: int | None = None  # the YOLO head's 3×3 conv channels; None: hidden
    groups: int = 8  # GroupNorm groups; must divide hidden and head_hidden
    epochs: int = 40
    lr: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 32
    box_weight: float = 2.0  # weight of the (1 − GIoU) term against objectness BCE
    prior: float = 0.1  # initial objectness probability (bias init, as in YOLO / RetinaNet)
    score_threshold: float = 0.01  # detections kept for AP (low: AP needs the whole ranking)
    nms_iou: float = 0.5
    seed: int = 0
    threads: int | None = 1  # torch threads while training: tiny convs run fastest on one; None = leave as is

    def __post_init__(self) -> None:
        require_count(self.groups, "ProbeConfig.groups", ConfigError)
        for name in ("hidden", "head_hidden"):
            width = getattr(self, name)
            if width is not None or name == "hidden":
                require_count(width, f"ProbeConfig.{name}", ConfigError)
            if width is not None and width % self.groups:
                raise ConfigError(f"ProbeConfig.{name}={width} must be a positive multiple of groups={self.groups}")
        for name in ("epochs", "batch_size"):
            require_count(getattr(self, name), f"ProbeConfig.{name}", ConfigError)
        require_positive(self.lr, "ProbeConfig.lr", ConfigError)
        require_nonnegative(self.weight_decay, "ProbeConfig.weight_decay", ConfigError)
        require_nonnegative(self.box_weight, "ProbeConfig.box_weight", ConfigError)
        require_share(self.prior, "ProbeConfig.prior", ConfigError, below_one=True, above_zero=True)  # log-odds
        for name in ("score_threshold", "nms_iou"):
            require_share(getattr(self, name), f"ProbeConfig.{name}", ConfigError)
        require_seed(self.seed, "ProbeConfig.seed", ConfigError)
        if self.threads is not None:
            require_count(self.threads, "ProbeConfig.threads", ConfigError)


class DetectionProbe(nn.Module):
    """1×1 bottleneck → GroupNorm → SiLU → YOLO head; one (objectness, dx, dy, log w, log h) per cell."""

    def __init__(self, in_channels: int, config: ProbeConfig = ProbeConfig()):
        super().__init__()
        h, g = config.hidden, config.groups
        k = config.head_hidden or h
        self.bottleneck = nn.Sequential(nn.Conv2d(in_channels, h, 1), nn.GroupNorm(g, h), nn.SiLU())
        self.head = nn.Sequential(nn.Conv2d(h, k, 3, padding=1), nn.GroupNorm(g, k), nn.SiLU(), nn.Conv2d(k, 5, 1))
        self.register_buffer("mean", torch.zeros(in_channels, 1, 1))
        self.register_buffer("std", torch.ones(in_channels, 1, 1))
        with torch.no_grad():
            self.head[-1].bias.zero_()
            self.head[-1].bias[0] = math.log(config.prior / (1 - config.prior))

    def forward(self, x: Float[Tensor, "batch d rows cols"]) -> Float[Tensor, "batch 5 rows cols"]:
        """Raw outputs (objectness, dx, dy, log w, log h) per cell of a feature map."""
        return self.head(self.bottleneck((x - self.mean) / self.std))

    @property
    def n_params(self) -> int:
        """Trainable parameters (the standardisation buffers are not counted)."""
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------- targets


def _normalised_boxes(sample) -> np.ndarray:
    """(n, 4) xyxy boxes of a sample's objects as fractions of the image width and height."""
    scene = sample.scene
    return scene.boxes() / np.array([scene.width, scene.height, scene.width, scene.height], dtype=float)


def _nearer_sides(off: np.ndarray) -> list[tuple[int, int]]:
    """The (drow, dcol) steps to the edge-neighbours on a centre's nearer sides, the nearest first."""
    down, right = (int(np.sign(o) or 1) for o in off)
    return [(down, 0), (0, right)] if abs(off[0]) >= abs(off[1]) else [(0, right), (down, 0)]


def _assign(boxes: np.ndarray, rows: int, cols: int) -> list[tuple[int, int, int]]:
    """(object, row, col) targets: the centre's cell, or on a collision the nearer free edge-neighbour."""
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2 * cols, (boxes[:, 1] + boxes[:, 3]) / 2 * rows
    cell = np.stack([np.clip(np.floor(cy), 0, rows - 1), np.clip(np.floor(cx), 0, cols - 1)], 1).astype(int)
    off = np.stack([cy - cell[:, 0] - 0.5, cx - cell[:, 1] - 0.5], 1)  # centre offset from the cell centre
    order = np.argsort(np.hypot(off[:, 0], off[:, 1]), kind="stable")  # nearest the cell centre first
    taken: set[tuple[int, int]] = set()
    out = []
    for i in order:
        r, c = cell[i]
        for rc in [(r, c)] + [(r + dr, c + dc) for dr, dc in _nearer_sides(off[i])]:
            if 0 <= rc[0] < rows and 0 <= rc[1] < cols and rc not in taken:
                taken.add(rc)
                out.append((int(i), int(rc[0]), int(rc[1])))
                break
    return out


def build_targets(
    samples: Sequence, rows: int, cols: int
) -> tuple[Float[Tensor, "sample rows cols"], Float[Tensor, "sample rows cols 4"]]:
    """(objectness, boxes): each cell's target.

    Boxes are normalised xyxy (fractions of the image); zero where a cell has no target.
    """
    obj = torch.zeros(len(samples), rows, cols)
    box = torch.zeros(len(samples), rows, cols, 4)
    for s, sample in enumerate(samples):
        boxes = _normalised_boxes(sample)
        for i, r, c in _assign(boxes, rows, cols):
            obj[s, r, c] = 1.0
            box[s, r, c] = torch.from_numpy(boxes[i]).float()
    return obj, box


# ----------------------------------------------------------------------------- training


def decode(
    out: Float[Tensor, "batch 5 rows cols"],
) -> tuple[Float[Tensor, "batch rows cols"], Float[Tensor, "batch rows cols 4"]]:
    """Raw outputs → (objectness logits, boxes).

    Boxes are normalised xyxy: centre ``(col + 2σ(dx) − 0.5) / cols``, width ``exp(log w) / cols``.
    """
    _, _, rows, cols = out.shape
    r = torch.arange(rows, dtype=out.dtype)[:, None]
    c = torch.arange(cols, dtype=out.dtype)[None, :]
    cx = (c + 2 * torch.sigmoid(out[:, 1]) - 0.5) / cols
    cy = (r + 2 * torch.sigmoid(out[:, 2]) - 0.5) / rows
    w = torch.exp(out[:, 3].clamp(-6, 4)) / cols
    h = torch.exp(out[:, 4].clamp(-6, 4)) / rows
    return out[:, 0], torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def probe_loss(
    out: Float[Tensor, "batch 5 rows cols"],
    obj: Float[Tensor, "batch rows cols"],
    box: Float[Tensor, "batch rows cols 4"],
    box_weight: float,
) -> Float[Tensor, ""]:
    """BCE objectness (mean over cells) + box_weight · mean (1 − GIoU) over the target cells."""
    logits, pred = decode(out)
    loss = F.binary_cross_entropy_with_logits(logits, obj)
    pos = obj > 0.5
    if pos.any():
        loss = loss + box_weight * (1 - giou(pred[pos], box[pos])).mean()
    return loss


def _check_features(features: Tensor, samples: Sequence, name: str = "features") -> None:
    if not isinstance(features, Tensor) or features.ndim != 4:
        shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise InputError(f"{name} must be a Float[Tensor, 'sample d rows cols'] map (e.g. from taps.tap); got {shape}")
    if len(features) != len(samples):
        raise InputError(
            f"{name} has {len(features)} maps but {len(samples)} samples were given; pass one map per sample"
        )


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (``None``: unchanged), then restore the setting."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fit_probe(
    features: Float[Tensor, "sample d rows cols"], samples: Sequence, config: ProbeConfig = ProbeConfig()
) -> DetectionProbe:
    """Train a `DetectionProbe` on the maps ``features`` of ``samples``' images.

    Deterministic for a given ``config.seed`` (initialisation and batch order draw from it; the
    global torch RNG is left untouched). The final epoch's mean loss is kept as ``probe.train_loss``.
    """
    _check_features(features, samples)
    x = features.detach().float().cpu()
    obj, box = build_targets(samples, x.shape[2], x.shape[3])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        probe = DetectionProbe(x.shape[1], config)
    probe.mean.copy_(x.mean((0, 2, 3))[:, None, None])
    probe.std.copy_(x.std((0, 2, 3))[:, None, None].clamp(min=1e-6))
    opt = torch.optim.AdamW(probe.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps = config.epochs * math.ceil(len(x) / config.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, config.lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(config.seed)
    probe.train()
    with _threads(config.threads):
        for _ in range(config.epochs):
            total = 0.0
            for idx in torch.randperm(len(x), generator=gen).split(config.batch_size):
                loss = probe_loss(probe(x[idx]), obj[idx], box[idx], config.box_weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += loss.item() * len(idx)
            probe.train_loss = total / len(x)
    probe.eval()
    return probe


@torch.no_grad()
def predict(
    probe: DetectionProbe,
    features: Float[Tensor, "sample d rows cols"],
    image_size: int | tuple[int, int],
    score_threshold: float = 0.01,
    nms_iou: float = 0.5,
) -> list[np.ndarray]:
    """Per image, an (n, 5) array of detections (x0, y0, x1, y1, score) in pixels, by falling score.

    ``image_size`` is the side of a square image or (height, width). Detections under
    ``score_threshold`` are dropped, then NMS at ``nms_iou`` removes duplicates.
    """
    if features.ndim != 4:
        raise InputError(f"features must be (sample, d, rows, cols); got shape {tuple(features.shape)}")
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    probe.eval()
    logits, boxes = decode(probe(features.float().cpu()))
    scale = torch.tensor([width, height, width, height], dtype=boxes.dtype)
    out = []
    for lg, bx in zip(logits.flatten(1), boxes.flatten(1, 2)):
        score = torch.sigmoid(lg)
        keep = score >= score_threshold
        bx = (bx[keep] * scale).clamp(min=0)
        bx = torch.minimum(bx, scale)
        score = score[keep]
        kept = nms(bx, score, nms_iou)
        out.append(torch.cat([bx[kept], score[kept, None]], 1).numpy().reshape(-1, 5))
    return out


def evaluate_probe(
    probe: DetectionProbe,
    features: Float[Tensor, "sample d rows cols"],
    samples: Sequence,
    config: ProbeConfig = ProbeConfig(),
    by: str | None = None,
) -> float | dict[str, float]:
    """AP@50 of ``probe`` on the maps ``features`` of ``samples`` (their scenes' boxes are the truth).

    With ``by`` (a meta key such as ``"case"``), a dict of AP@50 per value of ``sample.meta[by]``.
    """
    _check_features(features, samples)
    sizes = {(s.scene.height, s.scene.width) for s in samples}
    if len(sizes) != 1:
        raise InputError(f"samples have {len(sizes)} image sizes {sorted(sizes)}; evaluate one image size at a time")
    preds = predict(probe, features, sizes.pop(), config.score_threshold, config.nms_iou)
    gts = [s.scene.boxes() for s in samples]
    if by is None:
        return average_precision(preds, gts)
    keys = [str(s.meta.get(by)) for s in samples]
    return {
        k: average_precision([p for p, kk in zip(preds, keys) if kk == k], [g for g, kk in zip(gts, keys) if kk == k])
        for k in dict.fromkeys(keys)
    }


# ----------------------------------------------------------------------------- taps


def tap_name(kind: str, index: int | None) -> str:
    """``"vision.1"``, ``"projector"``, ``"llm.2"``: the label of a tap on the ``tap`` dim."""
    return kind if index is None else f"{kind}.{index}"


def _probe_one(
    vlm: VLM,
    train_samples: Sequence,
    test_samples: Sequence,
    tap: Tap,
    config: ProbeConfig,
    batch_size: int,
    by_case: bool,
) -> dict:
    """Extract one tap's features (train and test in one pass), fit a probe, score it; a row of results."""
    start = time.perf_counter()
    feats = read_tap(vlm, list(train_samples) + list(test_samples), tap[0], tap[1], batch_size=batch_size)
    tap_seconds = time.perf_counter() - start
    train, test = feats[: len(train_samples)], feats[len(train_samples) :]
    probe = fit_probe(train, train_samples, config)
    row = {
        "ap50": evaluate_probe(probe, test, test_samples, config),
        "ap50_case": evaluate_probe(probe, test, test_samples, config, by="case") if by_case else {},
        "n_params": probe.n_params,
        "train_loss": probe.train_loss,
        "tap_seconds": tap_seconds,
        "channels": feats.shape[1],
        "grid": feats.shape[2],
    }
    row["seconds"] = time.perf_counter() - start
    return row


def _reference_probe_one(
    vlm: VLM, train_samples: Sequence, test_samples: Sequence, tap: Tap, seed: int, batch_size: int
):
    """One tap under the code's recipe (`countlens.reference.counting_to_four.probe`): a results row."""
    start = time.perf_counter()
    feats = read_tap(vlm, list(train_samples) + list(test_samples), tap[0], tap[1], batch_size=batch_size)
    tap_seconds = time.perf_counter() - start
    train, test = feats[: len(train_samples)], feats[len(train_samples) :]
    boxes, labels, n_classes = reference_probe.sample_targets(train_samples)
    test_boxes, _, _ = reference_probe.sample_targets(test_samples)
    config = reference_probe.ReferenceProbeConfig(seed=seed)
    probe = reference_probe.fit_reference_probe(train, boxes, labels, n_classes, config)
    return {
        "ap50": reference_probe.reference_ap50(reference_probe.predict_reference(probe, test, config), test_boxes),
        "ap50_case": {},
        "n_params": probe.n_params,
        "train_loss": probe.train_loss,
        "tap_seconds": tap_seconds,
        "channels": feats.shape[1],
        "grid": feats.shape[2],
        "seconds": time.perf_counter() - start,
    }


#: How `probe_taps` trains and scores a probe: countlens's recipe, or the MAS paper's code's.
RECIPES: tuple[str, ...] = ("countlens", "counting-to-four")


def probe_taps(
    vlm: VLM,
    train_samples: Sequence,
    test_samples: Sequence,
    taps: Sequence[Tap] = DEFAULT_TAPS,
    config: ProbeConfig = ProbeConfig(),
    batch_size: int = 16,
    recipe: str = "countlens",
) -> xr.Dataset:
    """Train one probe per tap on ``train_samples`` and score AP@50 on ``test_samples``.

    Each tap's features are computed once (train and test in one pass) and dropped after its probe.
    Returns a Dataset over ``tap`` with ``ap50``, ``n_params``, ``train_loss``, ``seconds`` (tap
    extraction + training + evaluation), ``tap_seconds``, and coords ``kind``, ``index`` (−1 for
    none), ``channels`` (the tap's width d) and ``grid`` (its rows); when every test sample has a
    ``meta["case"]`` (COUNTINGTRICKS), also ``ap50_case`` over (tap, case).

    ``recipe="counting-to-four"``: each probe as the MAS paper's code trains and scores it
    (`countlens.reference.counting_to_four.probe`; ``config`` gives only the seed), on scenes (shapes as classes) or
    VOC2007 images (`countlens.datasets.loaders.load_voc2007`); `reference_taps` are the code's taps.
    """
    require_vlm(vlm, "probe_taps")
    if recipe not in RECIPES:
        raise InputError(f"unknown probe recipe {recipe!r}; use one of {RECIPES}")
    check_samples(train_samples, "probe_taps (train_samples)")
    check_samples(test_samples, "probe_taps (test_samples)")
    if not isinstance(config, ProbeConfig):
        raise InputError(f"config must be a ProbeConfig, got {type(config).__name__}")
    require_count(batch_size, "batch_size")
    taps = require_sequence(taps, "taps", example="[('projector', None), ('llm', 2)]")
    for t in taps:
        if isinstance(t, (str, bytes)) or not isinstance(t, (tuple, list)) or len(t) != 2:
            raise InputError(f"each tap is (kind, index), e.g. ('llm', 2) or ('projector', None); got {t!r:.60}")
    by_case = recipe == "countlens" and all("case" in getattr(s, "meta", {}) for s in test_samples)
    rows = [
        _probe_one(vlm, train_samples, test_samples, t, config, batch_size, by_case)
        if recipe == "countlens"
        else _reference_probe_one(vlm, train_samples, test_samples, t, config.seed, batch_size)
        for t in taps
    ]
    data = {v: ("tap", [r[v] for r in rows]) for v in ("ap50", "n_params", "train_loss", "seconds", "tap_seconds")}
    coords = {
        "tap": [tap_name(k, i) for k, i in taps],
        "kind": ("tap", [k for k, _ in taps]),
        "index": ("tap", [-1 if i is None else i for _, i in taps]),
        "channels": ("tap", [r["channels"] for r in rows]),
        "grid": ("tap", [r["grid"] for r in rows]),
    }
    if by_case:
        coords["case"] = list(rows[0]["ap50_case"])
        data["ap50_case"] = (("tap", "case"), [[r["ap50_case"][c] for c in coords["case"]] for r in rows])
    dataset = {"train": len(train_samples), "test": len(test_samples)}
    attrs = provenance(
        vlm.name,
        vlm.arch.name,
        dataset=dataset,
        seed=config.seed,
        samples=[*train_samples, *test_samples],
        method="probe_taps",
        config=asdict(config),
        recipe=recipe,
    )
    return xr.Dataset(data, coords=coords, attrs=attrs)
