"""Which vision tower can learn to tell circles from squares: patch size and crop pretraining.

    HF_HUB_OFFLINE=1 .venv/bin/python docs/organism/organism_vision.py     # writes docs/organism/organism_vision.json
    HF_HUB_OFFLINE=1 .venv/bin/python docs/organism/organism_vision.py vit_8px_crops_recipe   # rerun some learners

The shipped organism (16 px patches) counts one shape at 96 % but named shapes among others at
16 %: its tower never learned circle from square. Every learner below gets the same single-object
scenes (the `shape` task's one-object scenes: sizes 12–22 px at 192 px, random colour and
rotation) and the same seeds (32 per step, AdamW lr 1e-3, torch seed 0), and must say the
object's shape from the whole image. Held-out accuracy on 256 scenes of another seed (always
192 px scenes) is recorded along the way, with the final confusion matrix.

- ``vit_16px``: a fresh vision tower and merger of the shipped organism (16 px patches, dim 64,
  depth 2), max-pooled over its image tokens, then a linear read-out: what the language model reads.
- ``patch_mlp_16px``: an MLP on each 16 px patch alone (no patch sees its neighbours), max-pooled.
- ``patchify_cnn_16px``: a 16 px stride-16 convolution (256 filters) and a 2×2 stride-2 one, the
  tower's patchify-and-merge without attention: whether wider patch features alone would do.
- ``cnn``: three 3×3 convolutions at full resolution, max-pooled: a reference that sees across
  patch borders from its first layer.
- ``vit_16px_large_objects``: the 16 px tower on objects 30–40 px (about two patches wide).
- ``patch_mlp_8px`` / ``vit_8px``: the same with 8 px patches (same dim and depth).
- ``vit_8px_crops`` / ``vit_16px_crops``: trained on 64 px one-object crops instead of 192 px
  scenes (the recipe's `vision_pretrain` does this): a ninth of the pixels per object, so the
  same steps cost far less; evaluated on the same 192 px scenes. ``vit_8px_crops_recipe``: the
  recipe's setting, 1,000 steps of 64 crops.

Two threads (the organism's training setting). About 20 minutes on 2 cores, 7 of them the CNN.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from countlens.datasets.scene import SHAPES, Scene
from countlens.datasets.tasks import TRAIN_SEED_BASE, task_sample
from countlens.toy.recipe import ToyConfig, TrainConfig, build_model
from countlens.toy.train import Collator, pretraining_crops

STEPS, BATCH, LR, EVAL_EVERY = 600, 32, 1e-3, 150


def single_object_scenes(seed: int, n: int, size_range: tuple[float, float] | None = None) -> list[Scene]:
    """The first ``n`` one-object scenes of the `shape` task under ``seed`` (the task also draws 2–3)."""
    out, i = [], 0
    while len(out) < n:
        s = task_sample("shape", seed, i, size_range=size_range)
        out += [s.scene] if len(s.scene.objects) == 1 else []
        i += 1
    return out


def labels(scenes) -> torch.Tensor:
    return torch.tensor([SHAPES.index(s.objects[0].shape) for s in scenes])


class ViT(torch.nn.Module):
    """A vision tower and merger of the organism's recipe, max-pooled over image tokens, then a linear read-out."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg, self.visual = cfg, build_model(cfg, seed=0).model.visual
        self.out = torch.nn.Linear(cfg.hidden, len(SHAPES))
        self.patchify = Collator(cfg).pixel_values  # any image size: the layout depends only on patch and merge

    def forward(self, scenes) -> torch.Tensor:
        side = scenes[0].width // self.cfg.patch_size
        grid = torch.tensor([[1, side, side]] * len(scenes))
        tokens = self.visual(self.patchify(np.stack([s.render_array() for s in scenes])), grid_thw=grid).pooler_output
        return self.out(tokens.view(len(scenes), -1, self.cfg.hidden).max(1).values)


class PatchMLP(torch.nn.Module):
    """An MLP on each 16 px patch by itself: whatever it knows comes from one patch's pixels."""

    def __init__(self, cfg: ToyConfig, width: int = 128):
        super().__init__()
        self.p = cfg.patch_size
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(3 * self.p * self.p, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU()
        )
        self.out = torch.nn.Linear(width, len(SHAPES))

    def forward(self, scenes) -> torch.Tensor:
        x = _pixels(scenes)
        b, c, h, w = x.shape
        patches = x.reshape(b, c, h // self.p, self.p, w // self.p, self.p).permute(0, 2, 4, 1, 3, 5)
        return self.out(self.mlp(patches.reshape(b, -1, c * self.p * self.p)).max(1).values)


class PatchifyCNN(torch.nn.Module):
    def __init__(self, cfg: ToyConfig, filters: int = 256):
        super().__init__()
        p, m, act = cfg.patch_size, cfg.merge_size, torch.nn.GELU
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, filters, p, stride=p),
            act(),
            torch.nn.Conv2d(filters, 128, m, stride=m),
            act(),
            torch.nn.Conv2d(128, 128, 1),
            act(),
            torch.nn.AdaptiveMaxPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(128, len(SHAPES)),
        )

    def forward(self, scenes) -> torch.Tensor:
        return self.net(_pixels(scenes))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        act, pool = torch.nn.GELU, torch.nn.MaxPool2d
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1),
            act(),
            pool(2),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            act(),
            pool(2),
            torch.nn.Conv2d(64, 64, 3, padding=1),
            act(),
            torch.nn.AdaptiveMaxPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(64, len(SHAPES)),
        )

    def forward(self, scenes) -> torch.Tensor:
        return self.net(_pixels(scenes))


def _pixels(scenes) -> torch.Tensor:
    x = torch.from_numpy(np.stack([s.render_array() for s in scenes])).permute(0, 3, 1, 2).float()
    return x / 255.0 - 0.5


def learn(
    make: Callable[[], torch.nn.Module],
    size_range: tuple[float, float] | None = None,
    crops: bool = False,
    steps: int = STEPS,
    batch_size: int = BATCH,
) -> dict:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    held = single_object_scenes(7, 256, size_range)
    held_y = labels(held)
    curve, start = {}, time.perf_counter()
    for step in range(steps + 1):
        if step % EVAL_EVERY == 0 or step == steps:
            with torch.no_grad():
                pred = model(held).argmax(-1)
            curve[step] = round(float((pred == held_y).float().mean()), 3)
        if step == steps:
            break
        if crops:  # the recipe's own `vision_pretrain` crops (64 px, one object), under seed 5
            batch = pretraining_crops(5, step, ToyConfig(), replace(TrainConfig(), crop_batch=batch_size))
        else:
            batch = single_object_scenes(TRAIN_SEED_BASE + 5 + step, batch_size, size_range)
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


def main(only: list[str]) -> dict:
    torch.set_num_threads(2)
    p16, p8 = ToyConfig(patch_size=16), ToyConfig(patch_size=8)
    learners = {
        "vit_16px": (lambda: ViT(p16), None, False),
        "patch_mlp_16px": (lambda: PatchMLP(p16), None, False),
        "patchify_cnn_16px": (lambda: PatchifyCNN(p16), None, False),
        "cnn": (CNN, None, False),
        "vit_16px_large_objects": (lambda: ViT(p16), (30.0, 40.0), False),
        "patch_mlp_8px": (lambda: PatchMLP(p8), None, False),
        "vit_8px": (lambda: ViT(p8), None, False),
        "vit_16px_crops": (lambda: ViT(p16), None, True),
        "vit_8px_crops": (lambda: ViT(p8), None, True),
        # The recipe's `vision_pretrain`: 1,000 crop steps of 64 (crop steps are cheap).
        "vit_8px_crops_recipe": (lambda: ViT(p8), None, True, 1000, 64),
    }
    unknown = set(only) - set(learners)
    if unknown:
        raise SystemExit(f"unknown learners {sorted(unknown)}; choose from {list(learners)}")
    path = Path(__file__).with_suffix(".json")
    # Rerunning some learners keeps the others' recorded results.
    results = json.loads(path.read_text()) if only and path.exists() else {}
    results.update({"shapes": list(SHAPES), "steps": STEPS, "batch": BATCH, "lr": LR})
    for name, (make, size_range, crops, *schedule) in learners.items():
        if only and name not in only:
            continue
        results[name] = learn(make, size_range, crops, *schedule)
        if schedule:
            results[name]["steps"], results[name]["batch"] = schedule
        print(name, results[name], flush=True)
    path.write_text(json.dumps(results, indent=2) + "\n")  # once, at the end: an interrupted run keeps the old file
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
