"""An organism whose count is read from a designated part of the image: object-level ground truth.

The head organisms (`countlens.toy.planted`) know which heads carry the count; nothing tells an
object-level method which objects should matter. The **top-half** organism does: it is the shipped
organism trained further so that its answer to "how many <shape>?" is the number of those shapes whose
centre lies in the **top half** of the image. Objects in the bottom half are there to be ignored. By
design, not by prompt: the question is the organism's short one, unchanged.

Scenes (`top_half_sample`, a pure function of (seed, index)): one shape, 1–9 objects in the top half
(cycling by index) and 0–4 in the bottom half (drawn), each object wholly inside its half (its
enclosing disc does not cross the middle line, which is a token row boundary of the organism's 6 × 6
token grid), listed in a random order; ``meta["count"]`` is the top count (what `object_effects`
reads as the answer's count) and ``meta["top"]`` flags each object.

Training (`train_regions`): from the shipped organism's weights, vision tower frozen, the answer's
cross-entropy with AdamW, warmup and cosine decay (the organism's schedule), on training seeds
≥ `TRAIN_SEED_BASE`. `verify_regions` checks, on fresh samples (seed `FRESH_SEED`):
- ``accuracy`` (Wilson interval): the top count is answered;
- ``bottom_removed``: the same scenes drawn without their bottom objects — the answer must not move
  (paired drop and interval; bar: |drop| ≤ 2 points, either way);
- ``top_shifted``: one top object removed — the answer must follow (accuracy against count − 1);
- at object level (`countlens.circuits.graph.recovery.object_recovery`): exact object effects
  (`countlens.circuits.objects.effects`, reference "removed", at the input) must separate the top
  objects (the ground truth C, ``meta["top"]``) from the bottom ones: AUROC of |effect|.
`REGION_CHECKS` are countlens's bars, chosen here (no paper defines this organism).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from countlens.datasets.prompts import make_question
from countlens.datasets.recipe import recorded
from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Scene, place_objects
from countlens.datasets.tasks import SIZE_RANGE, TRAIN_SEED_BASE, TaskSample, sample_rng, without_objects
from countlens.files import claim_directory, directory_lock
from countlens.intervals import wilson
from countlens.model.shipped import TOY_DIR
from countlens.toy.plant import PlantConfig, save_organism
from countlens.toy.recipe import ToyConfig
from countlens.toy.resample import image_features_once
from countlens.toy.strictness import FRESH_SEED, paired_drop
from countlens.toy.train import Collator, lr_at
from countlens.validate import require_callback, require_count, require_path, require_seed

IMAGE = 192
TOP_COUNTS: tuple[int, ...] = tuple(range(1, 10))
MAX_BOTTOM = 4
RULE = "objects whose centre is in the top half"
REGION_CHECKS = {"accuracy_min": 0.90, "bottom_drop_max": 0.02, "follows_min": 0.80, "object_auroc_min": 0.95}


@recorded
def top_half_sample(seed: int, index: int) -> TaskSample:
    """The ``index``-th top-half scene under ``seed`` (module docstring): answer = the top count."""
    require_seed(seed)
    require_seed(index, "index")
    rng = sample_rng(seed, "regions/top-half", index)
    n_top = TOP_COUNTS[index % len(TOP_COUNTS)]
    n_bottom = int(rng.integers(0, MAX_BOTTOM + 1))
    shape = SHAPES[rng.integers(len(SHAPES))]

    def specs(n):
        return [
            (shape, OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))], float(rng.uniform(*SIZE_RANGE))) for _ in range(n)
        ]

    half = IMAGE // 2
    top = place_objects(rng, IMAGE, half, specs(n_top))
    bottom = [replace(o, cy=o.cy + half) for o in place_objects(rng, IMAGE, half, specs(n_bottom))]
    objects = list(top) + bottom
    order = rng.permutation(len(objects))
    objects = [objects[i] for i in order]
    flags = [bool(i < n_top) for i in order]
    question, _ = make_question("short", shape, n_top, rng)
    meta = {"count": n_top, "bottom": n_bottom, "top": flags, "rule": RULE}
    scene = Scene(IMAGE, IMAGE, tuple(objects), noise=0.0, noise_seed=int(rng.integers(2**31)))
    return TaskSample(scene, question, str(n_top), "count", meta)


def without(sample: TaskSample, keep) -> TaskSample:
    """``sample`` drawn again with only the objects ``keep(i, is_top)`` selects, its answer the new top count
    (`without_objects`)."""
    flags = sample.meta["top"]
    kept = [i for i, t in enumerate(flags) if keep(i, t)]
    n_top = sum(flags[i] for i in kept)
    removed = [i for i in range(len(flags)) if i not in kept]
    top = [flags[i] for i in kept]
    return without_objects(sample, removed, count=n_top, top=top, bottom=len(kept) - n_top)


def train_regions(model, steps: int = 300, seed: int = 0, batch: int = 32, lr: float = 1e-3, log=None) -> dict:
    """Train ``model`` (in place) to count the top half; returns the last log row."""
    require_count(steps, "steps")
    schedule = PlantConfig(seed=seed, steps=steps, lr=lr)  # the planting recipe's warmup and cosine decay
    torch.manual_seed(seed)
    torch.set_num_threads(schedule.threads)  # the shipped organism's (a rerun reproduces it with as many)
    collate = Collator(ToyConfig())
    model.train()
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    start, row = time.time(), {}
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule)
        samples = [top_half_sample(TRAIN_SEED_BASE + seed, step * batch + i) for i in range(batch)]
        inputs, answers = collate(samples)
        with image_features_once(model):
            loss = torch.nn.functional.cross_entropy(model(**inputs, logits_to_keep=1).logits[:, -1], answers)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            row = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - start, 1)}
            if log:
                log(row)
    return row


@torch.no_grad()
def _answers(model, collate, samples: list, batch: int = 64) -> torch.Tensor:
    out = []
    for i in range(0, len(samples), batch):
        inputs, _ = collate(samples[i : i + batch])
        out.append(model(**inputs, logits_to_keep=1).logits[:, -1].argmax(-1))
    return torch.cat(out)


def verify_regions(model, n_samples: int = 1024, seed: int = FRESH_SEED) -> dict:
    """The top-half organism's answer figures (module docstring) on fresh samples; the object-level
    figures are `countlens.circuits.graph.recovery.object_recovery`'s on `object_effects`."""
    collate = Collator(ToyConfig())
    model.eval()
    samples = [top_half_sample(seed, i) for i in range(n_samples)]
    tok = collate.tok
    ids = lambda ss: torch.tensor([tok.convert_tokens_to_ids(s.answer) for s in ss])  # noqa: E731
    clean = _answers(model, collate, samples) == ids(samples)
    no_bottom = [without(s, lambda i, t: t) for s in samples]
    moved = _answers(model, collate, no_bottom) == ids(no_bottom)
    shifted = [without(s, lambda i, t, s=s: not (t and i == s.meta["top"].index(True))) for s in samples]
    follows = _answers(model, collate, shifted) == ids(shifted)
    hits = int(clean.sum())
    out = {
        "seed": seed,
        "n_samples": n_samples,
        "accuracy": round(hits / n_samples, 4),
        "accuracy_ci95": [round(x, 4) for x in wilson(hits, n_samples)],
        "bottom_removed": {"accuracy": round(float(moved.float().mean()), 4), **paired_drop(clean, moved)},
        "top_one_removed_follows": round(float(follows.float().mean()), 4),
    }
    return out


def region_checks(figures: dict) -> dict[str, bool]:
    """Each of `REGION_CHECKS` passed or not on ``figures`` (from `verify_regions`)."""
    bars = REGION_CHECKS
    checks = {
        "accuracy": figures["accuracy"] >= bars["accuracy_min"],
        "bottom_ignored": abs(figures["bottom_removed"]["drop"]) <= bars["bottom_drop_max"],
        "follows_top": figures["top_one_removed_follows"] >= bars["follows_min"],
    }
    if "objects" in figures:  # object_recovery's figures on the exact effects
        checks["object_auroc"] = figures["objects"]["auroc"] >= bars["object_auroc_min"]
    return checks


#: The top-half organism's recipe (`plant_regions`'s defaults).
REGION_RECIPE = {"steps": 1200, "seed": 0, "batch": 32, "lr": 1e-3}


def plant_regions(out: Path, steps: int = 1200, seed: int = 0, progress=None) -> dict:
    """Train the top-half organism into ``out`` (weights, tokenizer, processor, training log and
    ``planted.json`` with the recipe and `verify_regions`'s figures on the saved weights); returns the
    record. The object-level figures are added by ``countlens toy plant`` (they need countlens's
    object effects, above this package)."""
    out, progress = require_path(out, "out", example="'organisms/top-half'"), require_callback(progress)
    recipe = {**REGION_RECIPE, "steps": steps, "seed": seed}
    PlantConfig(seed=seed, steps=steps, lr=recipe["lr"])  # its ranges checked before the folder is claimed
    from transformers import Qwen2VLForConditionalGeneration

    claim_directory(out, "countlens toy plant", {"circuit": "top-half", "recipe": recipe})
    with directory_lock(out, ".plant.lock", "plant", "plant into another directory"):
        model = Qwen2VLForConditionalGeneration.from_pretrained(TOY_DIR, dtype=torch.float32)
        rows: list[dict] = []

        def log(row):
            rows.append(row)
            if progress:
                progress(row)

        start = time.time()
        train_regions(model, steps=steps, seed=seed, batch=recipe["batch"], lr=recipe["lr"], log=log)
        seconds = round(time.time() - start, 1)
        saved = save_organism(model, out, rows)
        figures = verify_regions(saved)
        record = {
            "circuit": {
                "name": "top-half",
                "ground_truth": "objects",
                "rule": "objects whose centre is in the top half",
            },
            "recipe": recipe,
            "train_seconds": seconds,
            "fresh": figures,
            "fresh_checks": region_checks(figures),
            "bars": REGION_CHECKS,
        }
        (out / "planted.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
