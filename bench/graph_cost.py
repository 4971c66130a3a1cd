"""`graph_cost`'s plan against `attribution_graph` measured on the organism, and the plan at 7B.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/graph_cost.py [--transcoders FOLDER]
    # writes bench/graph_cost.json
    flock /tmp/countlens-heavy.lock .venv/bin/python bench/graph_cost.py --rankings
    # step 3 alone (about 3 GiB, a minute): rewrites ranking_calibration in bench/graph_cost.json

Organism: transcoders from ``--transcoders`` (a circuit-tracer folder, e.g. the ``transcoders/`` a
``train_transcoders(vlm, out=…)`` run wrote) or `train_transcoders(vlm)` with its defaults; the
3-object scene ``countlens features graph`` draws (`count_task_sample(3, 0)`). One torch thread.

1. **Calibration**: in the ``max_features=None`` graph, every backward pass's start is timed (a
   wrapper round ``torch.autograd.grad``); the median interval between two full feature passes is one
   pass (backward and the edge products): its FLOP rate at the organism's widths, and what it takes
   beyond its FLOPs at `CPU_FLOPS` (7B widths' rate), per layer (`PASS_SECONDS`'s calibration).
2. For ``max_features`` None / 2000 / 500: the graph's wall time and the peak resident set above the
   resident set before it (``VmHWM`` reset through ``/proc/self/clear_refs``), beside the plan's
   nodes, adjacency bytes, host + device bytes less the weights (on the CPU they are one memory) and
   the plan's seconds; with ``max_features``, the time the FLOPs leave over the rankings'
   planned entries.
3. **Rankings**: `partial_influence` timed on random graph-shaped rows at the organism's and at
   7B's source counts (the median of three calls after a warm-up): seconds per planned entry
   (`SELECTION_SECONDS`'s calibration).
4. **7B**: the plan of Qwen2.5-VL-7B-Instruct's published config (tests/data/checkpoints, with the
   tests' stand-in Qwen tokenizer: `tests/real_checkpoints.planning_dir`) at 448 px, k 16, width
   16384, max_features 8192, in bf16 and fp32, timed at the calibrated CPU rate and at the assumed
   GPU rate (`GPU_FLOPS`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _rehearsal import read_peak, reset_peak

import countlens
from countlens.datasets.tasks import count_task_sample
from countlens.features import attribution_graph, load_transcoders, train_transcoders
from countlens.model.loading import meta_vlm
from countlens.model.memory import resident_bytes
from countlens.pipeline.graph_cost import CPU_FLOPS, GPU_FLOPS, SELECTION_SECONDS, graph_cost, prompt_length

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30


def timed_graph(vlm, tcs, sample, max_features):
    """(graph, seconds, peak bytes above the resident set before, start times of each backward)."""
    starts: list[float] = []
    grad = torch.autograd.grad

    def recording(*args, **kwargs):
        starts.append(time.perf_counter())
        return grad(*args, **kwargs)

    reset_peak()
    before = resident_bytes()
    torch.autograd.grad = recording
    try:
        t = time.perf_counter()
        graph = attribution_graph(vlm, tcs, sample, max_features=max_features)
        seconds = time.perf_counter() - t
    finally:
        torch.autograd.grad = grad
    return graph, seconds, read_peak() - before, starts


def ranking_calibration() -> dict:
    """Seconds per entry of one max_features ranking (`partial_influence`) on one thread: random known
    rows shaped like a graph's (``k`` rows: 10 logits, then features whose rows read only earlier
    layers' features), at the organism's and at 7B's source counts; an entry is one of the plan's
    (``k × S`` read once, ``(layers + 1) × k × features`` for the series)."""
    from countlens.features.influence import partial_influence

    out = {}
    for k, n_f, n_src, layers in [(2010, 4992, 5361, 6), (2048, 125000, 133000, 28), (4096, 125000, 133000, 28)]:
        gen = torch.Generator().manual_seed(0)
        rows = torch.randn(k, n_src, generator=gen)
        nodes = torch.cat([torch.arange(n_src, n_src + 10), torch.randperm(n_f, generator=gen)[: k - 10]])
        layer = lambda j: torch.where(j < n_f, j * layers // n_f, layers)  # noqa: B023, E731
        block = rows[:, nodes[10:]]
        block[layer(nodes[10:])[None, :] >= layer(nodes)[:, None]] = 0
        rows[:, nodes[10:]] = block
        sums, probs = rows.abs().sum(1), torch.rand(10, generator=gen).softmax(0)
        partial_influence(rows, nodes, probs, n_f, sums)  # warm-up
        times = []
        for _ in range(3):
            t = time.perf_counter()
            partial_influence(rows, nodes, probs, n_f, sums)
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times)
        entries = k * n_src + (layers + 1) * k * (k - 10)
        out[f"k{k}_S{n_src}"] = {"seconds": round(seconds, 3), "seconds_per_entry": seconds / entries}
    return out


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
                for key in ("nodes", "adjacency_bytes", "host_bytes", "device_bytes", "flops")
            }
            out[dtype] = c
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transcoders", help="a circuit-tracer transcoder folder (default: train with defaults)")
    parser.add_argument("--out", default=str(HERE / "graph_cost.json"))
    parser.add_argument("--rankings", action="store_true", help="step 3 alone, into --out's ranking_calibration")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rankings:
        result = json.loads(Path(args.out).read_text())
        result["ranking_calibration"] = ranking_calibration()
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["ranking_calibration"]), f"written {args.out}")
        return
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

    runs = {}
    for max_features in (None, 2000, 500):
        graph, seconds, peak, starts = timed_graph(vlm, tcs, sample, max_features)
        c = graph_cost(vlm, seq, k, max_features, n_logits=graph.n_logits, transcoder_width=width, patches=patches)
        if max_features is None:  # calibrate: the full feature passes (not the logits', not the last)
            per_pass = statistics.median(b - a for a, b in zip(starts[1:-1], starts[2:]))
            rows, L, d = 64, c["n_layers"], c["d_model"]
            flops_per_pass = c["backward_flops"] + rows * (2 * c["active_features"] * d + 2 * (L + 1) * seq * d)
            overhead = (per_pass - flops_per_pass / CPU_FLOPS) / L
            calibration = {
                "seconds_per_pass": per_pass,
                "flops_per_pass": flops_per_pass,
                "flops_per_second_at_organism_widths": flops_per_pass / per_pass,
                "pass_seconds_per_layer_beyond_CPU_FLOPS": overhead,
            }
        entries = c["selection_seconds"] / SELECTION_SECONDS
        ranking = seconds - c["flops"] / CPU_FLOPS - c["pass_seconds"]  # what is left: rankings, assembly, forwards
        predicted = c["seconds"]
        transient = c["peak_bytes"] - c["weights_bytes"]  # on the CPU: host and device, less what was resident
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
            "ranking_entries": int(entries),
            "seconds_per_ranking_entry": ranking / entries if entries else None,
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
        "ranking_calibration": ranking_calibration(),
        "organism": runs,
        "qwen2_5_vl_7b": plan_7b(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["calibration"]), f"written {args.out}")


if __name__ == "__main__":
    main()
