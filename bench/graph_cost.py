"""`graph_cost`'s plan against `attribution_graph` measured on the organism, and the plan at 7B.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/graph_cost.py [--transcoders FOLDER]
    # writes bench/graph_cost.json

Organism: transcoders from ``--transcoders`` (a circuit-tracer folder, e.g. the ``transcoders/`` a
``train_transcoders(vlm, out=…)`` run wrote) or `train_transcoders(vlm)` with its defaults; the
3-object scene ``countlens features graph`` draws (`count_task_sample(3, 0)`). One torch thread.

1. **Calibration**: in the ``max_features=None`` graph, every backward pass's start is timed (a
   wrapper round ``torch.autograd.grad``); the median interval between two full feature passes is one
   pass (backward and the edge products), and its planned FLOPs over that interval is the CPU rate.
2. For ``max_features`` None / 2000 / 500: the graph's wall time and the peak resident set above the
   resident set before it (``VmHWM`` reset through ``/proc/self/clear_refs``), beside the plan's
   nodes, adjacency bytes, host + kept + backward bytes and seconds at the calibrated rate.
3. **7B**: the plan of Qwen2.5-VL-7B-Instruct's published config (tests/data/checkpoints, with the
   tests' stand-in Qwen tokenizer: `tests/real_checkpoints.planning_dir`) at 448 px, k 16, width
   16384, max_features 8192, in bf16 and fp32, timed at the calibrated CPU rate and at the assumed
   GPU rate (`GPU_FLOPS`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import countlens
from countlens.datasets.tasks import count_task_sample
from countlens.features import attribution_graph, load_transcoders, train_transcoders
from countlens.model.loading import meta_vlm
from countlens.model.memory import resident_bytes
from countlens.pipeline.graph_cost import GPU_FLOPS, graph_cost, prompt_length

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_hwm() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def timed_graph(vlm, tcs, sample, max_features):
    """(graph, seconds, peak bytes above the resident set before, start times of each backward)."""
    starts: list[float] = []
    grad = torch.autograd.grad

    def recording(*args, **kwargs):
        starts.append(time.perf_counter())
        return grad(*args, **kwargs)

    _reset_hwm()
    before = resident_bytes()
    torch.autograd.grad = recording
    try:
        t = time.perf_counter()
        graph = attribution_graph(vlm, tcs, sample, max_features=max_features)
        seconds = time.perf_counter() - t
    finally:
        torch.autograd.grad = grad
    return graph, seconds, _hwm() - before, starts


def plan_7b() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import _save_tiny
    from disk_cache import cached_dir, entry_key
    from real_checkpoints import planning_dir

    from countlens.pipeline.graph_cost import CPU_FLOPS

    name = "Qwen__Qwen2.5-VL-7B-Instruct"
    tiny = cached_dir(entry_key("tiny", "qwen2_5_vl"), lambda path: _save_tiny("qwen2_5_vl", {}, path))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = planning_dir(name, tiny, Path(tmp) / name)
        for dtype in ("bfloat16", "float32"):
            vlm = meta_vlm(str(folder), dtype=dtype, image_size=448)
            seq, patches = prompt_length(vlm)
            kw = dict(max_features=8192, transcoder_width=16384, patches=patches, dtype_bytes=vlm.hf.dtype.itemsize)
            c = graph_cost(vlm, seq, 16, flops_per_second=GPU_FLOPS, **kw)
            c["seconds_cpu_one_thread"] = c["flops"] / CPU_FLOPS
            c["no_max_features"] = {
                key: graph_cost(vlm, seq, 16, **{**kw, "max_features": None})[key]
                for key in ("nodes", "adjacency_bytes", "host_bytes", "flops")
            }
            out[dtype] = c
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transcoders", help="a circuit-tracer transcoder folder (default: train with defaults)")
    parser.add_argument("--out", default=str(HERE / "graph_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    if args.transcoders:
        tcs, source = load_transcoders(args.transcoders, vlm), args.transcoders
    else:
        tcs, source = train_transcoders(vlm, progress=False).transcoders, "train_transcoders(vlm) defaults"
    tc = tcs.layer(0)
    k, width = tc.k, tc.W_enc.shape[0]
    sample = count_task_sample(3, 0)
    seq, patches = prompt_length(vlm)
    attribution_graph(vlm, tcs, sample, max_features=500)  # warm-up: first-call allocations and caches

    runs, rate = {}, None
    for max_features in (None, 2000, 500):
        graph, seconds, peak, starts = timed_graph(vlm, tcs, sample, max_features)
        c = graph_cost(vlm, seq, k, max_features, n_logits=graph.n_logits, transcoder_width=width, patches=patches)
        if max_features is None:  # calibrate: the full feature passes (not the logits', not the last)
            per_pass = statistics.median(b - a for a, b in zip(starts[1:-1], starts[2:]))
            rows = 64
            flops_per_pass = c["backward_flops"] + rows * c["n_layers"] * seq * (2 * c["d_model"] * width)
            flops_per_pass += rows * c["n_layers"] * seq * 2 * c["d_model"] + rows * 2 * seq * c["d_model"]
            rate = flops_per_pass / per_pass
            calibration = {"seconds_per_pass": per_pass, "flops_per_pass": flops_per_pass, "flops_per_second": rate}
        predicted = c["flops"] / rate + c["selection_seconds"]
        transient = c["host_bytes"] + c["kept_bytes"] + c["backward_bytes"]
        runs[str(max_features)] = {
            "nodes": graph.n_nodes,
            "features": graph.n_features,
            "planned_nodes": c["nodes"],
            "adjacency_bytes": graph.adjacency.numel() * graph.adjacency.element_size(),
            "planned_adjacency_bytes": c["adjacency_bytes"],
            "backward_passes": len(starts),
            "planned_backward_passes": c["backward_passes"],
            "seconds": round(seconds, 2),
            "planned_seconds": round(predicted, 2),
            "planned_selection_seconds": round(c["selection_seconds"], 2),
            "time_ratio_measured_over_planned": round(seconds / predicted, 2),
            "peak_above_before_bytes": peak,
            "planned_transient_bytes": transient,
            "memory_ratio_measured_over_planned": round(peak / transient, 2),
        }
        print(max_features, runs[str(max_features)], flush=True)
    result = {
        "transcoders": source,
        "k": k,
        "width": width,
        "scene": sample.question,
        "seq": seq,
        "threads": 1,
        "calibration": calibration,
        "organism": runs,
        "qwen2_5_vl_7b": plan_7b(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["calibration"]), f"written {args.out}")


if __name__ == "__main__":
    main()
