"""Does the image token at an object's centre know the object's shape? Linear probes on a tower's features.

    HF_HUB_OFFLINE=1 .venv/bin/python docs/organism/cell_shape.py                      # every setting below
    HF_HUB_OFFLINE=1 .venv/bin/python docs/organism/cell_shape.py toy runs/toy-12px    # or trained checkpoints

To count the circles among squares, the language model needs each object's shape on the image
token it counts the object at (the dense warmup teaches the merger to mark object centres per
token). `organism_vision.py` asks only whether shape is *somewhere* in the image's features
(max-pooled); this bench asks both, with fresh linear probes (standardised features, full-batch
Adam, 500 steps) fitted on training-seed scenes and scored on held-out ones:

- ``patches_pooled`` / ``tokens_pooled``: the shape of a one-object 192 px scene from the tower's
  patch features (before the merger) or its merged image tokens, max-pooled feature by feature;
- ``centre_token``: the shape of the object whose centre lies in a token's cell, from that one
  merged token, on counting scenes (what the language model must read).

Towers: ``crops_then_merger`` is the recipe with 12 px patches: 1,500 steps of crop pretraining
(`vision_pretrain` with ``pretrain_reads="patches"``: shape and colour, max-pooled patches), then
the tower frozen and the 300-step dense warmup training the merger alone; ``crops_then_merger_8px``
the same with 8 px patches (64 px crops). ``token_crops_then_merger`` / ``_8px``: the same, but the
crop pretraining reads the merged image tokens (shape only; tower and merger train);
``token_crops_then_tower_8px`` leaves the tower trainable in the dense warmup.
``centre_crops_then_merger_8px``: the crop pretraining reads the merged token at the object's
centre (``pretrain_reads="centre"``); ``centre_crops_3000_then_merger_8px`` the same with 3,000 crop
steps instead of 1,500, ``centre_crops_then_merger_8px_depth3`` with a 3-block tower. ``dense_crops_depth2``
/ ``_depth4`` train the whole tower and merger from scratch on the dense warmup's per-token
targets, but on 96 px crops of 1–2 objects (1,500 steps of 64). A name that is not a setting is
loaded as a checkpoint (`countlens.load`). Writes docs/organism/cell_shape.json (merging into earlier results), with
``centre_token_commonest``, the held-out share of the commonest shape (the guessing baseline).
About 33 minutes for the ten settings on 2 cores, 15–20 s per checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from organism_vision import labels, single_object_scenes

from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Scene, place_objects
from countlens.datasets.tasks import TRAIN_SEED_BASE, TaskSample, object_sizes, sample_rng, task_sample
from countlens.toy.recipe import ToyConfig, TrainConfig, build_model
from countlens.toy.train import (
    CELL_CLASSES,
    Collator,
    cell_loss,
    cell_targets,
    freeze_tower,
    vision_pretrain,
    vision_warmup,
)

CFG12 = ToyConfig(patch_size=12)
RECIPE12 = TrainConfig(vision_pretrain=1500, crop_size=72, freeze_vision=True, pretrain_reads="patches")


def features(visual, cfg: ToyConfig, scenes: list[Scene], merged: bool, batch: int = 64) -> torch.Tensor:
    """(B, tokens or patches, dim) in the processor's order."""
    patchify, out = Collator(cfg).pixel_values, []
    with torch.no_grad():
        for i in range(0, len(scenes), batch):
            chunk = scenes[i : i + batch]
            o = visual(
                patchify(np.stack([s.render_array() for s in chunk])),
                grid_thw=torch.tensor([[1, *cfg.geometry.patch_grid]] * len(chunk)),
            )
            t = o.pooler_output if merged else o.last_hidden_state
            out.append(t.view(len(chunk), -1, t.shape[-1]))
    return torch.cat(out)


def linear_probe(x_train, y_train, x_held, y_held) -> float:
    torch.manual_seed(0)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_held = (x_train - mean) / std, (x_held - mean) / std
    head = torch.nn.Linear(x_train.shape[1], int(y_train.max()) + 1)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(500):
        loss = torch.nn.functional.cross_entropy(head(x_train), y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return round(float((head(x_held).argmax(-1) == y_held).float().mean()), 3)


def centre_tokens(visual, cfg: ToyConfig, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged tokens whose cell holds an object centre, and that object's shape (the warmup's target)."""
    samples = [task_sample("count", seed, i, image_size=cfg.image_size) for i in range(n)]
    feats = features(visual, cfg, [s.scene for s in samples], merged=True)
    target = cell_targets(samples, cfg)
    keep = target[:, 0] > 0
    return feats.reshape(-1, feats.shape[-1])[keep], target[keep, 2]


def probes(visual, cfg: ToyConfig) -> dict:
    train, held = single_object_scenes(TRAIN_SEED_BASE + 99, 1536), single_object_scenes(7, 256)
    out = {}
    for name, merged in (("patches_pooled", False), ("tokens_pooled", True)):
        pooled = [features(visual, cfg, s, merged).max(1).values for s in (train, held)]
        out[name] = linear_probe(pooled[0], labels(train), pooled[1], labels(held))
    held_tokens, held_shapes = centre_tokens(visual, cfg, 7, 128)
    out["centre_token"] = linear_probe(*centre_tokens(visual, cfg, TRAIN_SEED_BASE + 99, 384), held_tokens, held_shapes)
    out["centre_token_commonest"] = round(
        float(torch.bincount(held_shapes).max() / len(held_shapes)), 3
    )  # the guessing baseline
    return out


def crops_then_merger(cfg: ToyConfig, tc: TrainConfig, freeze: bool = True):
    model = build_model(cfg, seed=0).train()
    vision_pretrain(model, cfg, tc)
    if freeze:
        freeze_tower(model)
    vision_warmup(model, Collator(cfg), cfg, tc)
    return model.model.visual, cfg


def dense_crops(depth: int, steps: int = 1500, crop: int = 96, batch: int = 64):
    cfg = replace(CFG12, vision_depth=depth)
    crop_cfg = replace(cfg, image_size=crop)
    visual = build_model(cfg, seed=0).model.visual.train()
    head = torch.nn.Linear(cfg.hidden, sum(CELL_CLASSES))
    opt = torch.optim.AdamW(list(visual.parameters()) + list(head.parameters()), lr=1e-3)
    patchify, grid, (lo, hi) = (
        Collator(crop_cfg).pixel_values,
        torch.tensor([[1, *crop_cfg.geometry.patch_grid]] * batch),
        object_sizes(192),
    )
    for step in range(steps):
        scenes = []
        for i in range(step * batch, (step + 1) * batch):
            rng = sample_rng(TRAIN_SEED_BASE + 9, "dense-crop", i)
            specs = [
                (
                    SHAPES[rng.integers(len(SHAPES))],
                    OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))],
                    float(rng.uniform(lo, hi)),
                )
                for _ in range(int(rng.integers(1, 3)))
            ]
            scenes.append(Scene(crop, crop, place_objects(rng, crop, crop, specs)))
        target = cell_targets([TaskSample(s, "", "", "count") for s in scenes], crop_cfg)
        feats = visual(patchify(np.stack([s.render_array() for s in scenes])), grid_thw=grid).pooler_output
        loss = cell_loss(head, feats, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return visual.eval(), cfg


SETTINGS = {
    "crops_then_merger": lambda: crops_then_merger(CFG12, RECIPE12),
    "crops_then_merger_8px": lambda: crops_then_merger(ToyConfig(patch_size=8), replace(RECIPE12, crop_size=64)),
    "token_crops_then_merger": lambda: crops_then_merger(CFG12, replace(RECIPE12, pretrain_reads="tokens")),
    "token_crops_then_merger_8px": lambda: crops_then_merger(
        ToyConfig(patch_size=8), replace(RECIPE12, crop_size=64, pretrain_reads="tokens")
    ),
    "centre_crops_then_merger_8px": lambda: crops_then_merger(
        ToyConfig(patch_size=8), replace(RECIPE12, crop_size=64, pretrain_reads="centre")
    ),
    "centre_crops_3000_then_merger_8px": lambda: crops_then_merger(
        ToyConfig(patch_size=8), replace(RECIPE12, crop_size=64, pretrain_reads="centre", vision_pretrain=3000)
    ),
    "centre_crops_then_merger_8px_depth3": lambda: crops_then_merger(
        ToyConfig(patch_size=8, vision_depth=3), replace(RECIPE12, crop_size=64, pretrain_reads="centre")
    ),
    "token_crops_then_tower_8px": lambda: crops_then_merger(
        ToyConfig(patch_size=8), replace(RECIPE12, crop_size=64, pretrain_reads="tokens"), freeze=False
    ),
    "dense_crops_depth2": lambda: dense_crops(2),
    "dense_crops_depth4": lambda: dense_crops(4),
}


def tower(name: str):
    if name in SETTINGS:
        torch.manual_seed(0)
        return SETTINGS[name]()
    import countlens

    vlm = countlens.load(name)
    g = vlm.geometry
    return vlm.hf.model.visual, ToyConfig(image_size=g.image_height, patch_size=g.patch_size, merge_size=g.merge_size)


if __name__ == "__main__":
    torch.set_num_threads(2)
    path = Path(__file__).with_suffix(".json")
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in sys.argv[1:] or list(SETTINGS):
        start = time.perf_counter()
        visual, cfg = tower(name)
        results[name] = {
            **probes(visual, cfg),
            "patch_size": cfg.patch_size,
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(name, results[name], flush=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
