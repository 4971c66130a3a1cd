"""How well a trained organism's vision tower separates shapes: a linear probe on its pooled image tokens.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/tower_shape_probe.py toy runs/toy-8px   # any checkpoints

For each checkpoint: the tower and merger (frozen) encode the one-object scenes of
`organism_vision.py`, the image tokens are max-pooled feature by feature (what that bench's
learners read out), standardised, and a linear probe is fitted on 1,536 training scenes (full-batch
Adam, 500 steps) and scored on the same 256 held-out scenes as the bench. It says whether shape is
in the tower's output at all, apart from whether the language model learned to read it.
Writes bench/tower_shape_probe.json. About a minute per checkpoint on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from organism_vision import labels, single_object_scenes

import countlens
from countlens.datasets.scene import SHAPES
from countlens.datasets.tasks import TRAIN_SEED_BASE
from countlens.toy.recipe import ToyConfig
from countlens.toy.train import Collator


@torch.no_grad()
def pooled_tokens(vlm, scenes, batch: int = 64) -> torch.Tensor:
    g = vlm.geometry
    patchify = Collator(ToyConfig(image_size=g.image_height, patch_size=g.patch_size, merge_size=g.merge_size)).pixel_values
    out = []
    for i in range(0, len(scenes), batch):
        chunk = scenes[i : i + batch]
        grid = torch.tensor([[1, *g.patch_grid]] * len(chunk))
        tokens = vlm.hf.model.visual(patchify(np.stack([s.render_array() for s in chunk])), grid_thw=grid).pooler_output
        out.append(tokens.view(len(chunk), -1, tokens.shape[-1]).max(1).values)
    return torch.cat(out)


def probe(model: str) -> dict:
    torch.manual_seed(0)
    vlm = countlens.load(model)
    train, held = single_object_scenes(TRAIN_SEED_BASE + 99, 1536), single_object_scenes(7, 256)
    x_train, x_held = pooled_tokens(vlm, train), pooled_tokens(vlm, held)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_held = (x_train - mean) / std, (x_held - mean) / std
    y_train, y_held = labels(train), labels(held)
    head = torch.nn.Linear(x_train.shape[1], len(SHAPES))
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(500):
        loss = torch.nn.functional.cross_entropy(head(x_train), y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = lambda x, y: round(float((head(x).argmax(-1) == y).float().mean()), 3)  # noqa: E731
        return {"patch_size": vlm.geometry.patch_size, "train_accuracy": acc(x_train, y_train),
                "held_out_accuracy": acc(x_held, y_held)}


if __name__ == "__main__":
    torch.set_num_threads(2)
    results = {}
    for name in sys.argv[1:] or ["toy"]:
        results[name] = probe(name)
        print(name, results[name], flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
