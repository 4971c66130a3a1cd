"""Tracing overhead: an nnsight trace of the organism vs the plain HF forward, side by side.

    .venv/bin/python bench/trace_overhead.py            # writes bench/trace_overhead.json

Both run the same prepared batch; the trace saves one residual-stream tensor (the cheapest
useful intervention). Reported: median wall time of each over repeats, and their ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import countlens
from countlens.datasets.tasks import task_samples


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(batch_size: int = 32, repeats: int = 20) -> dict:
    torch.set_num_threads(2)
    vlm = countlens.load("toy")
    samples = task_samples("count", batch_size, seed=3)
    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples], [s.answer for s in samples])
    layer = vlm.arch.layer(vlm.arch.n_layers // 2)

    def plain():
        vlm.forward(batch)

    def traced():
        with torch.no_grad(), vlm.trace(batch):
            vlm.module(layer).output.save()

    t_plain, t_trace = median_time(plain, repeats), median_time(traced, repeats)
    result = {
        "model": "toy",
        "batch_size": batch_size,
        "repeats": repeats,
        "threads": 2,
        "plain_forward_ms": round(1000 * t_plain, 2),
        "nnsight_trace_ms": round(1000 * t_trace, 2),
        "ratio": round(t_trace / t_plain, 3),
        "torch": torch.__version__,
    }
    (Path(__file__).with_suffix(".json")).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
