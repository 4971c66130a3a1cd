"""Why the organism cannot tell circles from squares: shape learning of its vision tower vs references.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/organism_vision.py     # writes bench/organism_vision.json

The organism counts one shape at 96 % but named shapes among others at 16 % (`countlens eval`),
and answers "what shape is the red object?" at 54 %. This isolates the vision half of that
failure: every learner below gets the same single-object scenes (the `shape` task's one-object
scenes: sizes 12–22 px at 192 px, random colour and rotation) and the same batches (32 per step,
AdamW lr 1e-3, seed 0), and must say the object's shape from the whole image. Held-out accuracy
on 256 scenes of another seed is recorded along the way, with the final confusion matrix.

- ``vit``: a fresh organism vision tower and merger (`ToyConfig`: 16 px patches, dim 64, depth 2),
  max-pooled over its image tokens, then a linear read-out: exactly what the language model reads.
- ``patch_mlp``: an MLP on each 16 px patch alone (no patch sees its neighbours), max-pooled.
- ``patchify_cnn``: a 16 px stride-16 convolution (256 filters) and a 2×2 stride-2 one, the
  tower's patchify-and-merge without attention: whether wider patch features alone would do.
- ``cnn``: three 3×3 convolutions at full resolution, max-pooled: a reference that sees across
  patch borders from its first layer.
- ``vit_large_objects``: the organism's tower on objects 30–40 px (about two patches wide).

Two threads (the organism's training setting). About 13 minutes on 2 cores, 8 of them the CNN.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from countlens.datasets.scene import SHAPES
from countlens.datasets.tasks import TRAIN_SEED_BASE, task_sample
from countlens.toy.recipe import ToyConfig, build_model
from countlens.toy.train import Collator

STEPS, BATCH, LR, EVAL_EVERY = 600, 32, 1e-3, 150


def single_object_scenes(seed: int, n: int, size_range: tuple[float, float] | None = None) -> list:
    """The first ``n`` one-object scenes of the `shape` task under ``seed`` (the task also draws 2–3)."""
    out, i = [], 0
    while len(out) < n:
        s = task_sample("shape", seed, i, size_range=size_range)
        out += [s] if len(s.scene.objects) == 1 else []
        i += 1
    return out


def labels(samples) -> torch.Tensor:
    return torch.tensor([SHAPES.index(s.scene.objects[0].shape) for s in samples])


class ViT(torch.nn.Module):
    """The organism's vision tower and merger, max-pooled over image tokens, then a linear read-out."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg, self.visual = cfg, build_model(cfg, seed=0).model.visual
        self.out = torch.nn.Linear(cfg.hidden, len(SHAPES))
        self.collate = Collator(cfg)

    def forward(self, samples) -> torch.Tensor:
        inputs, _ = self.collate(samples)
        tokens = self.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        return self.out(tokens.view(len(samples), -1, self.cfg.hidden).max(1).values)


class PatchMLP(torch.nn.Module):
    """An MLP on each 16 px patch by itself: whatever it knows comes from one patch's pixels."""

    def __init__(self, cfg: ToyConfig, width: int = 128):
        super().__init__()
        self.p = cfg.patch_size
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(3 * self.p * self.p, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU()
        )
        self.out = torch.nn.Linear(width, len(SHAPES))

    def forward(self, samples) -> torch.Tensor:
        x = _pixels(samples)
        b, c, h, w = x.shape
        patches = x.reshape(b, c, h // self.p, self.p, w // self.p, self.p).permute(0, 2, 4, 1, 3, 5)
        return self.out(self.mlp(patches.reshape(b, -1, c * self.p * self.p)).max(1).values)


class PatchifyCNN(torch.nn.Module):
    def __init__(self, cfg: ToyConfig, filters: int = 256):
        super().__init__()
        p, m, act = cfg.patch_size, cfg.merge_size, torch.nn.GELU
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, filters, p, stride=p), act(), torch.nn.Conv2d(filters, 128, m, stride=m), act(),
            torch.nn.Conv2d(128, 128, 1), act(), torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(128, len(SHAPES)),
        )

    def forward(self, samples) -> torch.Tensor:
        return self.net(_pixels(samples))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        act, pool = torch.nn.GELU, torch.nn.MaxPool2d
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), act(), pool(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), act(), pool(2),
            torch.nn.Conv2d(64, 64, 3, padding=1), act(), torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(64, len(SHAPES)),
        )

    def forward(self, samples) -> torch.Tensor:
        return self.net(_pixels(samples))


def _pixels(samples) -> torch.Tensor:
    x = torch.from_numpy(np.stack([s.scene.render_array() for s in samples])).permute(0, 3, 1, 2).float()
    return x / 255.0 - 0.5


def learn(model: torch.nn.Module, size_range: tuple[float, float] | None = None) -> dict:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    held = single_object_scenes(7, 256, size_range)
    held_y = labels(held)
    curve, start = {}, time.perf_counter()
    for step in range(STEPS + 1):
        if step % EVAL_EVERY == 0:
            with torch.no_grad():
                pred = model(held).argmax(-1)
            curve[step] = round(float((pred == held_y).float().mean()), 3)
        if step == STEPS:
            break
        batch = single_object_scenes(TRAIN_SEED_BASE + 5 + step, BATCH, size_range)
        loss = torch.nn.functional.cross_entropy(model(batch), labels(batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    confusion = np.zeros((len(SHAPES), len(SHAPES)), dtype=int)
    np.add.at(confusion, (held_y.numpy(), pred.numpy()), 1)
    return {
        "held_out_accuracy_by_step": curve,
        "confusion_rows_true_cols_pred": confusion.tolist(),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> dict:
    torch.set_num_threads(2)
    cfg = ToyConfig()
    learners = {
        "vit": (lambda: ViT(cfg), None),
        "patch_mlp": (lambda: PatchMLP(cfg), None),
        "patchify_cnn": (lambda: PatchifyCNN(cfg), None),
        "cnn": (CNN, None),
        "vit_large_objects": (lambda: ViT(cfg), (30.0, 40.0)),
    }
    results = {"shapes": list(SHAPES), "steps": STEPS, "batch": BATCH, "lr": LR}
    for name, (make, size_range) in learners.items():
        results[name] = learn(make(), size_range)
        print(name, results[name], flush=True)
    return results


if __name__ == "__main__":
    out = main()
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
