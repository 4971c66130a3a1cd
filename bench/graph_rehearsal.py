"""The 7B-width rehearsal of the attribution graph's plan (`countlens.pipeline.graph_cost`) on CPU.

    flock /tmp/countlens-heavy.lock .venv/bin/python bench/graph_rehearsal.py   # → bench/graph_rehearsal.json
    .venv/bin/python bench/graph_rehearsal.py --depths 1 --max-features 32 --out /tmp/g.json   # quicker
    .venv/bin/python bench/graph_rehearsal.py --replan     # the recorded runs against the current plan

Each depth runs in a fresh process: a random-init Qwen2.5-VL at Qwen2.5-VL-7B's widths
(`bench/wide_model.py`'s `build`: text hidden 3,584, 28 heads, 4 KV heads, intermediate 18,944,
vocabulary 152,064; vision width 1,280), ``--depth`` text layers and as many vision blocks, fp32, the
real Qwen vocabulary, 448 px; random TopK transcoders on every layer (width 16,384, k 16; ``W_enc``
~ N(0, 1/d_model), ``W_dec`` rows of unit norm, so every token keeps 16 features), one torch thread
(the plan's `CPU_FLOPS` is one thread's). Then:

1. `graph_cost` of the 3-object counting scene (``countlens features graph``'s) with ``--max-features``,
   ``--batch-rows`` and 10 logit nodes, at `CPU_FLOPS`;
2. `attribution_graph` of that scene, timed, its peak resident set read from ``VmHWM`` (reset through
   ``/proc/self/clear_refs`` after ``malloc_trim``, the weights and transcoders already resident).

Written per depth: planned and measured seconds; the planned peak (the plan's host + device bytes, on
the CPU one memory, with the process's resident set before the graph in place of the weights and
transcoders the plan counts) and the measured ``VmHWM``; the transient (above the resident set before)
planned and measured; their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent


def one_depth(depth: int, args) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from _rehearsal import random_transcoders, read_peak, reset_peak
    from wide_model import build

    from countlens.datasets.tasks import count_task_sample
    from countlens.features import attribution_graph
    from countlens.model.memory import resident_bytes
    from countlens.pipeline.graph_cost import CPU_FLOPS, graph_cost, prompt_length

    torch.set_num_threads(1)
    vlm, _ = build(depth, args.image_size, torch.float32, "cpu", real_vocab=True, tiled_init=True)
    tcs = random_transcoders(vlm, args.width, args.k)
    sample = count_task_sample(3, 0)
    seq, patches = prompt_length(vlm)
    kw = dict(max_features=args.max_features, batch_rows=args.batch_rows, transcoder_width=args.width, patches=patches)
    c = graph_cost(vlm, seq, args.k, n_logits=10, dtype_bytes=4, flops_per_second=CPU_FLOPS, **kw)
    reset_peak()
    before = resident_bytes()
    t = time.perf_counter()
    graph = attribution_graph(vlm, tcs, sample, max_features=args.max_features, batch_size=args.batch_rows)
    seconds = time.perf_counter() - t
    peak = read_peak()
    if (graph.n_nodes, graph.n_logits) != (c["nodes"], c["logits"]):
        sys.exit(f"the plan has {c['nodes']} nodes, {c['logits']} logits; the graph {graph.n_nodes}, {graph.n_logits}")
    measured = {"resident_before_bytes": before, "measured_peak_bytes": peak, "measured_seconds": round(seconds, 1)}
    return {"depth": depth, "seq": seq, "patches": patches, "nodes": graph.n_nodes} | compare(c, measured)


def compare(c: dict, m: dict) -> dict:
    """The plan ``c`` beside the measured ``m`` (resident set before, peak, seconds), with ratios. The
    plan's peak counts the weights and transcoders, already resident before the graph: they are
    replaced by the resident set before (the interpreter, the libraries and them)."""
    resident = c["weights_bytes"] + c["transcoder_bytes"]
    planned_peak = m["resident_before_bytes"] + c["peak_bytes"] - resident
    transient = m["measured_peak_bytes"] - m["resident_before_bytes"]
    return {
        "active_features": c["active_features"],
        "features": c["features"],
        "backward_passes": c["backward_passes"],
        "rankings": c["rankings"],
        "planned_host_bytes": c["host_bytes"],
        "planned_device_bytes": c["device_bytes"],
        **m,
        "planned_peak_bytes": planned_peak,
        "peak_ratio_measured_over_planned": round(m["measured_peak_bytes"] / planned_peak, 3),
        "planned_transient_bytes": c["peak_bytes"] - resident,
        "measured_transient_bytes": transient,
        "transient_ratio_measured_over_planned": round(transient / (c["peak_bytes"] - resident), 3),
        "planned_flops": c["flops"],
        "planned_seconds": round(c["seconds"], 1),
        "planned_selection_seconds": round(c["selection_seconds"], 2),
        "time_ratio_measured_over_planned": round(m["measured_seconds"] / c["seconds"], 3),
    }


def replan(result: dict) -> dict:
    """The recorded runs' planned side again, from the current `graph_cost` on meta models of the same
    depths (the measured side unchanged)."""
    import torch

    sys.path.insert(0, str(HERE))
    from wide_model import build

    from countlens.pipeline.graph_cost import CPU_FLOPS, graph_cost

    s = result["settings"]
    for i, run in enumerate(result["runs"]):
        vlm, _ = build(run["depth"], s["image_size"], torch.float32, "meta", real_vocab=True)
        kw = dict(max_features=s["max_features"], batch_rows=s["batch_rows"], transcoder_width=s["width"])
        c = graph_cost(vlm, run["seq"], s["k"], n_logits=10, patches=run["patches"], flops_per_second=CPU_FLOPS, **kw)
        keep = ("resident_before_bytes", "measured_peak_bytes", "measured_seconds")
        head = {k: run[k] for k in ("depth", "seq", "patches", "nodes")}
        result["runs"][i] = head | compare(c, {k: run[k] for k in keep})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--width", type=int, default=16384)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--max-features", type=int, default=64)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one depth, JSON on stdout
    ap.add_argument("--out", type=Path, default=HERE / "graph_rehearsal.json")
    ap.add_argument("--replan", action="store_true", help="recompute the planned side of --out's record")
    args = ap.parse_args()
    if args.replan:
        result = replan(json.loads(args.out.read_text()))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps([{k: v for k, v in r.items() if "ratio" in k} for r in result["runs"]]))
        return
    if args.one is not None:
        print("REHEARSAL " + json.dumps(one_depth(args.one, args)), flush=True)
        return
    runs = []
    for depth in args.depths:
        cmd = [sys.executable, __file__, "--one", str(depth)]
        cmd += [
            x
            for k in ("image_size", "width", "k", "max_features", "batch_rows")
            for x in (f"--{k}".replace("_", "-"), str(getattr(args, k)))
        ]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("REHEARSAL ")), None)
        if line is None:
            sys.exit(f"depth {depth} failed (its traceback is above)")
        runs.append(json.loads(line[len("REHEARSAL ") :]))
        print(json.dumps(runs[-1]), flush=True)
    settings = {k: getattr(args, k) for k in ("image_size", "width", "k", "max_features", "batch_rows")}
    result = {"settings": settings | {"dtype": "float32", "threads": 1, "n_logits": 10}, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
