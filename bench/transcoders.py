"""Per-layer transcoders of the organism under AuxK's two normalisations (``aux_norm``): fidelity per
layer, counting accuracy of the original and of the replacement model, circuit-tracer's graph scores,
and the wall time, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/transcoders.py     # writes bench/transcoders.json

Two trainings with `countlens.features.train_transcoders`'s defaults (every layer, width 512, k 16,
1500 steps of 512 tokens, lr 2e-3, seed 0, `DEFAULT_MIX`), which differ only in how AuxK's loss is
normalised (`countlens.features.dead`), under the JSON keys **before**: ``aux_norm="variance"`` (like
the main loss, by the outputs' variance), and **after**: ``aux_norm="error"`` (the default: by the
error's energy, adapted from Gao et al.'s code, which divides by the error's variance). For each:
held-out FVU, L0 and dead features per layer; `replacement_accuracy` on 256 held-out counting scenes
(`task_samples("count", 256, seed=0)`: evaluation seeds, never training scenes);
`graph_scores(attribution_graph(vlm, tcs, s))` on the first scenes of ``task_samples("count", 64, seed=0)``
with 3 and 5 objects (the scenes of ``bench/attribution_graph.py``), and their mean over the first
`MEAN_SCENES` scenes of that list (one scene is one sample).
One torch thread (the CPUs are shared); ``others_load_cores`` records what other processes used meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import countlens
from countlens.datasets.tasks import task_samples
from countlens.features import attribution_graph, graph_scores, replacement_accuracy, train_transcoders

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Load  # noqa: E402

EVAL_SAMPLES = 256
#: The graph scores' mean is over the first this many scenes of ``task_samples("count", 64, seed=0)``.
MEAN_SCENES = 16
#: The two trainings compared: the keyword arguments that differ from the defaults.
RUNS = {"before": {"aux_norm": "variance"}, "after": {}}


def _r(x: float) -> float:
    return round(float(x), 4)


def run(vlm, kw: dict, scenes: dict, more: list) -> dict:
    """One training with ``kw``: its fidelity, counting accuracy, graph scores and times."""
    with Load() as load, tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        training = train_transcoders(vlm, out=out, progress=False, **kw)
        train_seconds = time.perf_counter() - start
        t = time.perf_counter()
        acc = replacement_accuracy(vlm, training.transcoders, task_samples("count", EVAL_SAMPLES, seed=0))
        eval_seconds = time.perf_counter() - t
        t = time.perf_counter()
        scores = {
            count: {key: _r(v) for key, v in graph_scores(attribution_graph(vlm, training.transcoders, s)).items()}
            for count, s in scenes.items()
        }
        each = [graph_scores(attribution_graph(vlm, training.transcoders, s)) for s in more]
        scores["mean"] = {key: _r(sum(x[key] for x in each) / len(each)) for key in ("replacement", "completeness")}
        scores["min"] = {key: _r(min(x[key] for x in each)) for key in ("replacement", "completeness")}
        graph_seconds = time.perf_counter() - t
    table, attrs = training.fidelity, training.fidelity.attrs
    return {
        "kwargs": kw,
        "auxk": attrs["auxk"],
        "layers": {
            int(layer): {
                "fvu": _r(table.fvu.sel(layer=layer)),
                "l0": _r(table.l0.sel(layer=layer)),
                "dead": int(table.dead.sel(layer=layer)),
                "dead_share": _r(table.dead_share.sel(layer=layer)),
            }
            for layer in table.layer.values
        },
        "counting_accuracy": {
            "samples": EVAL_SAMPLES,
            "original": _r(acc.accuracy.sel(model="original")),
            "replacement": _r(acc.accuracy.sel(model="replacement")),
            "agreement": _r(acc.agreement),
        },
        "graph_scores": scores,
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "graph_seconds": round(graph_seconds, 1),
        "others_load_cores": load.others,
        "_attrs": attrs,
    }


def main() -> dict:
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    samples = task_samples("count", 64, seed=0)
    first = {str(c): next(i for i, s in enumerate(samples) if s.meta["count"] == c) for c in (3, 5)}
    scenes = {c: samples[i] for c, i in first.items()}
    runs = {name: run(vlm, kw, scenes, samples[:MEAN_SCENES]) for name, kw in RUNS.items()}
    attrs = runs["after"].pop("_attrs")
    runs["before"].pop("_attrs")
    return {
        "model": "toy",
        "threads": 1,
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python bench/transcoders.py",
        "settings": {key: attrs[key] for key in ("width", "k", "steps", "batch_tokens", "lr", "seed", "held_out")},
        "dataset": json.loads(attrs["dataset"]),
        "held_out_tokens": int(attrs["n_tokens"]),
        "graph_scenes": {
            **{c: {"index": i, "count": int(c)} for c, i in first.items()},
            "mean": {"first": MEAN_SCENES, "counts": [s.meta["count"] for s in samples[:MEAN_SCENES]]},
        },
        **runs,
    }


def side_by_side(result: dict) -> str:
    """The before and after columns as a text table."""
    b, a = result["before"], result["after"]
    lines = [f"{'':28}{'before':>18}{'after':>18}"]
    for layer in a["layers"]:
        for key in ("fvu", "dead"):
            lines.append(f"layer {layer} {key:21}{b['layers'][layer][key]:>18}{a['layers'][layer][key]:>18}")
    for count in a["graph_scores"]:
        for key in ("replacement", "completeness"):
            name = f"{count} objects: {key}" if count.isdigit() else f"{count} of {MEAN_SCENES} scenes: {key}"
            lines.append(f"{name:28}{b['graph_scores'][count][key]:>18}{a['graph_scores'][count][key]:>18}")
    for key in ("replacement", "agreement"):
        name = f"counting {key}"
        lines.append(f"{name:28}{b['counting_accuracy'][key]:>18}{a['counting_accuracy'][key]:>18}")
    lines.append(f"{'train seconds':28}{b['train_seconds']:>18}{a['train_seconds']:>18}")
    return "\n".join(lines)


if __name__ == "__main__":
    result = main()
    text = json.dumps(result, indent=2)
    (Path(__file__).resolve().parent / "transcoders.json").write_text(text + "\n")
    print(text)
    print(side_by_side(result))
