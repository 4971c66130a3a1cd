"""Seconds per training step of the organism: batches built in the loop vs prefetched in a thread.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/train_step.py     # writes bench/train_step.json

`countlens.toy.train` builds each step's batch (render 32 scenes, patchify, tokenize) in the loop.
It used to prefetch the next batch in a thread while the current step trained; on 2 cores that
thread competes with torch's two threads. Both loops run here side by side on the same model, in
alternating blocks of steps, for the shipped organism (16 px patches, whole model trains) and an
8 px one with its tower frozen (`freeze_vision`). Also recorded: building a batch alone and a step
on a ready batch alone, so that the loops' figures can be read against their parts, and that step
under bf16 autocast (this CPU has AMX-BF16, but at the organism's widths bf16 is slower). About 2
minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _timing import measured

from countlens.toy.recipe import ToyConfig, TrainConfig, build_model
from countlens.toy.train import Collator, answer_step, freeze_tower, training_batch

SETTINGS = {
    "shipped_16px": (ToyConfig(), False),
    "8px_frozen_tower": (ToyConfig(patch_size=8), True),
}


def per_step(run_block, blocks: int) -> float:
    """Median seconds per step over ``blocks`` calls of ``run_block`` (each returns (seconds, steps))."""
    return statistics.median(s / n for s, n in (run_block() for _ in range(blocks)))


def measure(cfg: ToyConfig, frozen: bool, block: int = 8, blocks: int = 5) -> dict:
    tc = TrainConfig()
    model = build_model(cfg).train()
    if frozen:
        freeze_tower(model)
    collate = Collator(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr)
    counter = iter(range(10**9))

    def make_batch(step: int):
        return training_batch(collate, step, cfg, tc)

    def train_step(inputs, answers) -> None:
        answer_step(model, opt, inputs, answers)

    def inline():
        t = time.perf_counter()
        for _ in range(block):
            train_step(*make_batch(next(counter)))
        return time.perf_counter() - t, block

    def prefetch():
        t = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(make_batch, next(counter))
            for k in range(block):
                batch = pending.result()
                if k + 1 < block:
                    pending = pool.submit(make_batch, next(counter))
                train_step(*batch)
        return time.perf_counter() - t, block

    ready = make_batch(0)

    def build_only():
        t = time.perf_counter()
        make_batch(next(counter))
        return time.perf_counter() - t, 1

    def step_only():
        t = time.perf_counter()
        train_step(*ready)
        return time.perf_counter() - t, 1

    def step_only_bf16():
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            train_step(*ready)
        return time.perf_counter() - t, 1

    inline(), prefetch()  # warm-up

    def run():
        out: dict = {"inline": [], "prefetch_thread": []}
        for _ in range(blocks):  # alternate, so drift in machine load hits both loops alike
            out["inline"].append(per_step(inline, 1))
            out["prefetch_thread"].append(per_step(prefetch, 1))
        return {k: statistics.median(v) for k, v in out.items()} | {
            "build_batch_only": per_step(build_only, 5),
            "step_on_ready_batch": per_step(step_only, 5),
            "step_on_ready_batch_bf16_autocast": per_step(step_only_bf16, 5),
        }

    times, load = measured(run)
    return {k: round(v, 4) for k, v in times.items()} | {
        "prefetch_over_inline": round(times["prefetch_thread"] / times["inline"], 3),
        "bf16_autocast_over_fp32": round(times["step_on_ready_batch_bf16_autocast"] / times["step_on_ready_batch"], 3),
        "others_load_cores": load.others,
    }


def main() -> dict:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    result = {
        "unit": "seconds per step (median of alternating blocks of 8 steps)",
        "batch_size": TrainConfig().batch_size,
        "threads": 2,
        "torch": torch.__version__,
    }
    for name, (cfg, frozen) in SETTINGS.items():
        result[name] = measure(cfg, frozen)
        print(name, result[name], flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
