"""Which objects does the token at an object's centre misread? Linear and MLP probes, broken down.

    # any checkpoint or cell_shape setting:
    HF_HUB_OFFLINE=1 .venv/bin/python docs/organism/centre_token_errors.py runs/toy-8px-centre

`docs/organism/cell_shape.py` scores a *linear* probe for shape on the merged token whose cell holds an
object's centre, fitted on 384 scenes. The language model reads that token through nonlinear
layers and sees far more scenes, so this bench fits both a linear and a one-hidden-layer MLP probe
(256 GELU units) on 1,536 training-seed counting scenes (about 10,000 objects) and scores them on
256 held-out ones (seed 7), by object size, by the gap to the object's nearest neighbour (px
between their enclosing discs) and by shape. Objects that share a centre cell with another are
left out (their cell has two labels). The per-object accuracy is what
`docs/organism/shape_accuracy_needed.py` turns into the counting accuracy of a perfect counter that
reads shape as well as the probe. A probe bounds from below what the token holds (the MLP can
overfit: on the shipped tower it scores under the linear probe). Writes
docs/organism/centre_token_errors.json (merging into earlier results). About 30 s per checkpoint on 2 cores.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from cell_shape import features, tower

from countlens.datasets.scene import SHAPES
from countlens.datasets.tasks import TRAIN_SEED_BASE, task_sample
from countlens.toy.recipe import ToyConfig
from countlens.toy.train import token_index

SIZE_BINS = ((12, 14), (14, 16), (16, 18), (18, 20), (20, 22.01))
GAP_BINS = ((-math.inf, 3), (3, 8), (8, math.inf))  # an object alone in its scene has gap inf


def centre_objects(visual, cfg: ToyConfig, seed: int, n: int) -> dict[str, np.ndarray | torch.Tensor]:
    """Per object alone in its centre cell: that token's features, its shape, size and nearest-neighbour gap."""
    samples = [task_sample("count", seed, i, image_size=cfg.image_size) for i in range(n)]
    feats = features(visual, cfg, [s.scene for s in samples], merged=True)
    rows, shapes, sizes, gaps = [], [], [], []
    for b, s in enumerate(samples):
        objs = s.scene.objects
        cells = [token_index(o, cfg) for o in objs]
        for o, cell in zip(objs, cells):
            if cells.count(cell) > 1:
                continue
            others = [np.hypot(o.cx - p.cx, o.cy - p.cy) - o.radius - p.radius for p in objs if p is not o]
            rows.append(feats[b, cell])
            shapes.append(SHAPES.index(o.shape))
            sizes.append(o.size)
            gaps.append(min(others, default=math.inf))
    return {"x": torch.stack(rows), "y": torch.tensor(shapes), "size": np.array(sizes), "gap": np.array(gaps)}


def fit(kind: str, x: torch.Tensor, y: torch.Tensor, steps: int = 1500) -> torch.nn.Module:
    torch.manual_seed(0)
    d = x.shape[1]
    if kind == "linear":
        head, lr = torch.nn.Linear(d, len(SHAPES)), 1e-2
    else:
        head, lr = (
            torch.nn.Sequential(torch.nn.Linear(d, 256), torch.nn.GELU(), torch.nn.Linear(256, len(SHAPES))),
            3e-3,
        )
    opt = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=1e-4)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(head(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head


def breakdown(right: np.ndarray, held: dict) -> dict:
    out = {"all": round(float(right.mean()), 4), "n": int(len(right))}
    for lo, hi in SIZE_BINS:
        m = (held["size"] >= lo) & (held["size"] < hi)
        out[f"size_{lo}-{int(hi)}px"] = [round(float(right[m].mean()), 3), int(m.sum())]
    for lo, hi in GAP_BINS:
        m = (held["gap"] >= lo) & ((held["gap"] < hi) | math.isinf(hi))
        name = f"gap_<{hi}px" if math.isinf(lo) else f"gap_>={lo}px" if math.isinf(hi) else f"gap_{lo}-{hi}px"
        out[name] = [round(float(right[m].mean()), 3), int(m.sum())]
    for k, shape in enumerate(SHAPES):
        m = held["y"].numpy() == k
        out[shape] = [round(float(right[m].mean()), 3), int(m.sum())]
    return out


def measure(name: str) -> dict:
    visual, cfg = tower(name)
    train, held = centre_objects(visual, cfg, TRAIN_SEED_BASE + 99, 1536), centre_objects(visual, cfg, 7, 256)
    mean, std = train["x"].mean(0), train["x"].std(0) + 1e-6
    out = {}
    for kind in ("linear", "mlp"):
        head = fit(kind, (train["x"] - mean) / std, train["y"])
        with torch.no_grad():
            right = (head((held["x"] - mean) / std).argmax(-1) == held["y"]).numpy()
        out[kind] = breakdown(right, held)
    out["n_train"] = int(len(train["y"]))
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    path = Path(__file__).with_suffix(".json")
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in sys.argv[1:] or ["toy"]:
        start = time.perf_counter()
        results[name] = {**measure(name), "seconds": round(time.perf_counter() - start, 1)}
        print(name, json.dumps(results[name]), flush=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
