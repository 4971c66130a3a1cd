"""Per-layer transcoders of the organism: fidelity per layer, counting accuracy of the original and of
the replacement model, and the wall time, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/transcoders.py     # writes bench/transcoders.json

`countlens.features.train_transcoders` with its defaults (every layer, width 512, k 16, 1500 steps of
512 tokens, lr 2e-3, seed 0, `DEFAULT_MIX`), then `replacement_accuracy` on 256 held-out counting
scenes (`task_samples("count", 256, seed=0)`: evaluation seeds, never training scenes). One torch
thread (the CPUs are shared); ``others_load_cores`` records what other processes used meanwhile.
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
from countlens.features import replacement_accuracy, train_transcoders

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Load  # noqa: E402

EVAL_SAMPLES = 256


def _r(x: float) -> float:
    return round(float(x), 4)


def main() -> dict:
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    with Load() as load, tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        training = train_transcoders(vlm, out=out)
        train_seconds = time.perf_counter() - start
        t = time.perf_counter()
        acc = replacement_accuracy(vlm, training.transcoders, task_samples("count", EVAL_SAMPLES, seed=0))
        eval_seconds = time.perf_counter() - t
    table = training.fidelity
    attrs = table.attrs
    result = {
        "model": "toy",
        "threads": 1,
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python bench/transcoders.py",
        "settings": {key: attrs[key] for key in ("width", "k", "steps", "batch_tokens", "lr", "seed", "held_out")},
        "dataset": json.loads(attrs["dataset"]),
        "held_out_tokens": int(attrs["n_tokens"]),
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
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "others_load_cores": load.others,
    }
    return result


if __name__ == "__main__":
    result = main()
    text = json.dumps(result, indent=2)
    print(text)
    (Path(__file__).resolve().parent / "transcoders.json").write_text(text + "\n")
