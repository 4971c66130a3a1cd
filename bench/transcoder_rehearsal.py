"""Transcoders at 7B widths on this CPU, measured against their plan (`countlens.pipeline.transcoder_cost`),
and the plans of the papers' 7B models.

    flock /tmp/countlens-heavy.lock .venv/bin/python bench/transcoder_rehearsal.py  # writes its .json

1. **Rates.** `train_step` timed on one thread at width 4096 × d_model 512, 8192 × 1024 and 16384 × 3584
   (k 16, 512 tokens, half the features dead so AuxK runs): the step's planned FLOPs over its CPU
   seconds (process time: the machine is shared) — `CPU_STEP_FLOPS` is set from the last; and one
   forward of a counting scene through the rehearsal's model (``forward_rate``: `CPU_FORWARD_FLOPS`).
2. **Rehearsal.** `train_transcoders` on a random-init Qwen2.5-VL at 7B widths, depth 1, float32, 448 px
   (bench/wide_model.py's `build`), layer 0, width 16,384, k 16, a few steps of 512 tokens, with a
   ``max_memory`` small enough that both splits are collected to a store of several chunks and
   trained from disk. Measured: each step's seconds, the store's bytes, the resident set's peak above
   its level before training (a thread samples /proc/self/statm every 5 ms), against the plan's step
   time, store bytes and device + chunk bytes (on a CPU both live in host memory).
3. **Plans** of Qwen2.5-VL-7B (448 px) and LLaVA-1.5-7B for `train_transcoders`' defaults (DEFAULT_MIX,
   1,500 steps of 512 tokens, every layer, width 16,384, k 16), on a GPU (assumed rates) and this CPU.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _timing import Load  # noqa: E402

import countlens.features.train as train_module  # noqa: E402
from countlens.datasets.tasks import task_sample  # noqa: E402
from countlens.features import train_transcoders  # noqa: E402
from countlens.features.activation_store import ActivationStore  # noqa: E402
from countlens.features.transcoder import Transcoder  # noqa: E402
from countlens.model.memory import widths  # noqa: E402
from countlens.pipeline.costs import Forward, forward_flops  # noqa: E402
from countlens.pipeline.transcoder_cost import (  # noqa: E402
    AUXK_FLOPS_PER,
    CPU_FORWARD_FLOPS,
    CPU_STEP_FLOPS,
    STEP_FLOPS_PER,
    mix_forwards,
    training_plan_lines,
    transcoder_cost,
)

MIX = {"count": 3, "text": 2}
STEPS, WIDTH, K, BATCH = 4, 16384, 16, 512
MAX_MEMORY = 6 * 2**20  # about two hundred tokens of one layer: a chunk per scene


def rate() -> dict:
    out = {}
    for d, w in ((512, 4096), (1024, 8192), (3584, 16384)):
        tc = Transcoder(d, w, "topk", k=K)
        opt = torch.optim.Adam(tc.parameters(), lr=1e-3)
        x, y = torch.randn(BATCH, d), torch.randn(BATCH, d)
        dead = torch.zeros(w, dtype=torch.bool)
        dead[::2] = True
        train_module.train_step(tc, opt, x, y, 1.0, dead)
        t, c = time.perf_counter(), time.process_time()
        n = 2 if d > 1024 else 5
        for _ in range(n):
            train_module.train_step(tc, opt, x, y, 1.0, dead)
        wall, cpu = (time.perf_counter() - t) / n, (time.process_time() - c) / n
        flops = (STEP_FLOPS_PER + AUXK_FLOPS_PER) * BATCH * d * w  # AuxK on: half the features dead
        out[f"{w}x{d}"] = {
            "cpu_seconds": round(cpu, 4),
            "wall_seconds": round(wall, 4),
            "flops_per_cpu_second": flops / cpu,
        }
    return out


class Peak(threading.Thread):
    """The resident set's largest size while running, sampled every 5 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    @staticmethod
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)


def rehearse() -> dict:
    from wide_model import build

    t = time.perf_counter()
    vlm, _ = build(1, 448, torch.float32, "cpu", tiled_init=True)
    built = time.perf_counter() - t
    batch = vlm.prepare_samples([task_sample("count", 0, 0)])
    seq, patches = batch.inputs["input_ids"].shape[1], batch.patches(vlm.arch.merge_size)
    with torch.no_grad():
        for _ in range(2):  # the second one timed
            c = time.process_time()
            vlm.hf(**batch.inputs)
            forward = time.process_time() - c
    forward_rate = forward_flops(widths(vlm), Forward(1, seq, keep=seq), patches) / forward
    steps, phases = [], {}
    step = train_module.train_step
    peak = Peak()

    def timed(*args):
        if not steps:  # the first step: collection and the stats pass are over
            phases["before_steps"] = time.perf_counter() - phases["start"]
            phases["cpu_before_steps"] = time.process_time() - phases["cpu_start"]
            peak.base = Peak.rss()
            peak.start()
        c = time.process_time()
        out = step(*args)
        steps.append(time.process_time() - c)
        return out

    reads, read_bytes, read = [], [0], ActivationStore.read

    def timed_read(self, layer, index):
        t = time.perf_counter()
        pair = read(self, layer, index)
        reads.append(time.perf_counter() - t)
        read_bytes[0] += sum(x.nbytes for x in pair)
        return pair

    train_module.train_step, ActivationStore.read = timed, timed_read
    try:
        with tempfile.TemporaryDirectory() as out:
            phases["start"], phases["cpu_start"] = time.perf_counter(), time.process_time()
            run = train_transcoders(
                vlm, [0], WIDTH, K, STEPS, BATCH, mix=MIX, out=out, progress=False, max_memory=MAX_MEMORY, batch_size=1
            )
            total = time.perf_counter() - phases.pop("start")
            peak.running = False
            store = Path(out) / "activations"
            chunks = {
                s: len(json.loads((store / s / "manifest.json").read_text())["chunks"]) for s in ("train", "held_out")
            }
            store_bytes = sum(p.stat().st_size for p in store.rglob("*.safetensors"))
    finally:
        train_module.train_step, ActivationStore.read = step, read
    tokens = json.loads(run.fidelity.attrs["dataset"])["tokens"]
    n_train = sum(tokens["train"].values())
    data = mix_forwards(vlm, MIX)
    plan = transcoder_cost(
        vlm,
        n_train,
        WIDTH,
        K,
        STEPS,
        BATCH,
        layers=1,
        max_memory=MAX_MEMORY,
        collection_flops=data["flops"],
        seq=data["seq"],
        collect_batch=1,
        held_out_tokens=data["held_out_tokens"],
    )
    measured_step = sorted(steps)[len(steps) // 2]
    measured_peak = peak.peak - peak.base
    planned_peak = plan["device_bytes"] + plan["chunk_bytes"]
    return {
        "model": vlm.name,
        "build_seconds": round(built, 1),
        "forward_rate": {
            "seq": seq,
            "patches": patches,
            "cpu_seconds": round(forward, 3),
            "flops_per_cpu_second": forward_rate,
        },
        "settings": {
            "mix": MIX,
            "layers": [0],
            "width": WIDTH,
            "k": K,
            "steps": STEPS,
            "batch_tokens": BATCH,
            "max_memory": MAX_MEMORY,
        },
        "tokens": tokens,
        "chunks": chunks,
        "step_cpu_seconds": [round(s, 3) for s in steps],
        "seconds_before_steps": round(phases["before_steps"], 1),
        "cpu_seconds_before_steps": round(phases["cpu_before_steps"], 1),
        "chunk_reads": {"count": len(reads), "seconds": round(sum(reads), 3), "bytes": read_bytes[0]},
        "total_seconds": round(total, 1),
        "measured": {
            "step_cpu_seconds": round(measured_step, 3),
            "store_bytes": store_bytes,
            "training_peak_bytes": measured_peak,
        },
        "planned": {
            "step_seconds": plan["train_flops"] / STEPS / CPU_STEP_FLOPS,
            "store_bytes": plan["store_bytes"],
            "training_peak_bytes": planned_peak,
            "collection_seconds_one_thread": plan["collection_seconds"],
            "tokens": {"train": data["tokens"], "held_out": data["held_out_tokens"]},
        },
        "ratio_measured_over_planned": {
            "step_seconds": round(measured_step / (plan["train_flops"] / STEPS / CPU_STEP_FLOPS), 3),
            "store_bytes": round(store_bytes / plan["store_bytes"], 3),
            "training_peak_bytes": round(measured_peak / planned_peak, 3),
            "collection_cpu_seconds (with the token estimate, the writes and the stats pass)": round(
                phases["cpu_before_steps"] / plan["collection_seconds"], 3
            ),
        },
        "fvu": [round(float(v), 4) for v in run.fidelity.fvu.values],
    }


def plans() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from disk_cache import cached_dir, entry_key
    from real_checkpoints import TOKENIZER_FROM, planning_dir

    from countlens.model.loading import meta_vlm
    from countlens.toy.tiny_models import save

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in (("Qwen__Qwen2.5-VL-7B-Instruct", 448), ("llava-hf__llava-1.5-7b-hf", None)):
            family = TOKENIZER_FROM[name]
            tiny = cached_dir(entry_key("tiny", family), lambda path, f=family: save(f, path))
            vlm = meta_vlm(str(planning_dir(name, tiny, Path(tmp) / name)), dtype="bfloat16", image_size=size)
            data = mix_forwards(vlm)
            out[name] = {
                "image_size": size,
                "widths": {"d_model": widths(vlm).d_model, "n_layers": widths(vlm).n_layers},
                **{device: training_plan_lines(vlm, device=device) for device in ("cuda", "cpu")},
                "cost_cuda": transcoder_cost(
                    vlm, data["tokens"], collection_flops=data["flops"], device="cuda", seq=data["seq"]
                ),
            }
    return out


def main() -> dict:
    torch.set_num_threads(1)
    with Load() as load:
        result = {
            "rates_in_the_plan": {"CPU_STEP_FLOPS": CPU_STEP_FLOPS, "CPU_FORWARD_FLOPS": CPU_FORWARD_FLOPS},
            "command": "flock /tmp/countlens-heavy.lock .venv/bin/python bench/transcoder_rehearsal.py",
            "threads": 1,
            "rate": rate(),
            "plans": plans(),
            "rehearsal": rehearse(),
        }
    result["others_load_cores"] = load.others
    return result


if __name__ == "__main__":
    result = main()
    text = json.dumps(result, indent=2, default=float)
    print(text)
    (Path(__file__).resolve().parent / "transcoder_rehearsal.json").write_text(text + "\n")
