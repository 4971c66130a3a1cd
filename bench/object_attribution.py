"""Object attribution, cheap, against exact per-object patching: agreement and cost.

    .venv/bin/python bench/object_attribution.py        # writes bench/object_attribution.json

On the organism (``countlens.load("toy")``), 48 COUNTINGTRICKS scenes: the position cases 1A–4A, 12
each, on the organism's geometry (``countingtricks(["1A", "2A", "3A", "4A"], 12, grid=vlm.geometry,
seed=0, prompt="short")``: counts 3–12). Each object's score by `countlens.circuits.object_attribution`
(AtP; EAP-IG at the registry's 5 steps and at 16) against its exact effect by
`countlens.circuits.objects.effects(reference="background")`: the object's image-token embeddings
patched from the scene's background, LD(clean) − LD(patched), the same metric (logit(n) −
logit(n − 1)), reference, tokens (coverage 0.25, peak) and sign as the estimates. Per scene, over its
objects with at least one token: Spearman ρ (the mean over scenes where both sides vary; also pooled over
every object of every scene) and whether
both name the same least object (the one that adds least to the count; a tie on the exact side counts
as agreement when the estimate's least is among the tied). EAP-IG's completeness error is summarised
as its median |error| over |m(clean) − m(background)|.

Cost: wall seconds (one run each after a warm-up on 4 scenes, in one process, the machine's other
load recorded), and those seconds in forward-equivalents as bench/attribution.py counts them: over
one plain forward of the 48 clean scenes in the same batches of 16. Beside it the planned count
(`countlens.circuits.methods.registry.Cost`'s convention, a backward two forwards): AtP 1 + 3 per chunk, EAP-IG
2 + 3·steps, exact patching one clean, one background and one patched run per object, in rows.
One torch thread: the machine is shared.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _timing import Load  # noqa: E402

import countlens  # noqa: E402
from countlens.circuits import object_attribution, object_effects  # noqa: E402
from countlens.circuits.methods.patching import spearman  # noqa: E402
from countlens.datasets import countingtricks  # noqa: E402

OUT = Path(__file__).with_suffix(".json")
BATCH = 16
CASES = ["1A", "2A", "3A", "4A"]


def agreement(score: np.ndarray, exact: np.ndarray, tokens: np.ndarray) -> dict:
    """Per scene ρ and least-object agreement over the objects that own a token."""
    rhos, least = [], []
    for s in range(len(score)):
        live = (tokens[s] > 0) & np.isfinite(exact[s]) & np.isfinite(score[s])
        a, b = score[s][live], exact[s][live]
        if len(a) < 2:
            continue
        rho = spearman(a, b)
        if np.isfinite(rho):
            rhos.append(rho)
        least.append(bool(b[np.argmin(a)] == b.min()))
    live = (tokens > 0) & np.isfinite(exact) & np.isfinite(score)
    return {
        "spearman_pooled": round(spearman(score[live], exact[live]), 3),
        "spearman_mean": round(float(np.mean(rhos)), 3),
        "spearman_median": round(float(np.median(rhos)), 3),
        "scenes_with_rho": len(rhos),
        "least_object_agrees": round(float(np.mean(least)), 3),
        "scenes": len(least),
    }


def main() -> None:
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    scenes = countingtricks(CASES, 12, grid=vlm.geometry, seed=0, prompt="short")
    object_attribution(vlm, scenes[:4], batch_size=4)  # warm-up: first-call costs out of the figures
    object_effects(vlm, scenes[:4], reference="background", batch_size=4)

    def plain() -> None:
        with torch.no_grad():
            for start in range(0, len(scenes), BATCH):
                vlm.hf(**vlm.prepare_samples(scenes[start : start + BATCH]).inputs)

    methods = {
        "plain forward (clean scenes)": plain,
        "exact patching (object_effects, background)": lambda: object_effects(
            vlm, scenes, reference="background", batch_size=BATCH
        ),
        "AtP": lambda: object_attribution(vlm, scenes, method="atp", batch_size=BATCH),
        "EAP-IG, 5 steps": lambda: object_attribution(vlm, scenes, method="eap-ig", batch_size=BATCH),
        "EAP-IG, 16 steps": lambda: object_attribution(vlm, scenes, method="eap-ig", steps=16, batch_size=BATCH),
    }
    results, rows = {}, {}
    for name, fn in methods.items():
        with Load() as load:
            t = time.perf_counter()
            results[name] = fn()
            seconds = time.perf_counter() - t
        rows[name] = {"seconds": round(seconds, 2), "others_load_cores": load.others}
    unit = rows["plain forward (clean scenes)"]["seconds"]
    exact = results["exact patching (object_effects, background)"]
    objects = int(exact.exists.sum())
    effect = exact.effect.values
    spread = np.nanstd(effect, axis=1) / np.maximum(np.abs(np.nanmean(effect, axis=1)), 1e-9)
    chunks = -(-len(scenes) // BATCH)
    rows["exact patching (object_effects, background)"]["planned_forward_equivalents_per_scene"] = round(
        (2 * len(scenes) + objects) / len(scenes), 2
    )
    for name, row in rows.items():
        row["forward_equivalents"] = round(row["seconds"] / unit, 1)
        ds = results[name]
        if name.startswith(("AtP", "EAP-IG")):
            row["planned_forward_equivalents_per_scene"] = round(ds.attrs["forward_equivalents"] / len(scenes), 2)
            row["planned_forward_equivalents_per_chunk"] = ds.attrs["forward_equivalents"] // chunks
            row["score_mean"] = round(float(np.nanmean(ds.score.values)), 3)
            row.update(agreement(ds.score.values, exact.effect.values, exact.n_tokens.values))
            for case in CASES:
                mine = exact.case.values == case
                got = agreement(ds.score.values[mine], exact.effect.values[mine], exact.n_tokens.values[mine])
                row[f"case_{case}"] = {k: got[k] for k in ("spearman_mean", "least_object_agrees")}
        if ds is not None and "completeness_error" in ds:
            rel = np.abs(ds.completeness_error.values) / np.maximum(np.abs(ds.image_total.values), 1e-9)
            row["completeness_error_median_relative"] = round(float(np.median(rel)), 4)
            row["completeness_error_max_abs"] = round(float(np.abs(ds.completeness_error.values).max()), 4)
    record = {
        "machine": platform.processor() or platform.machine(),
        "torch_threads": 1,
        "scenes": len(scenes),
        "objects": objects,
        "exact_effect_mean": round(float(np.nanmean(effect)), 3),
        "exact_within_scene_std_over_mean_median": round(float(np.median(spread)), 3),
        "cases": CASES,
        "batch_size": BATCH,
        "methods": rows,
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:45s} {row}")


if __name__ == "__main__":
    main()
