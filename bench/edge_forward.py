"""One edge-ablated forward against a plain forward of the same rows, at 7B widths and on the organism.

    python bench/edge_forward.py                              # → bench/edge_forward.json
    python bench/edge_forward.py --depths 2 --repeats 1 --out /tmp/e.json   # a quicker look

At each depth (``--depths``, default 2, 4, 8): a random-init Qwen2.5-VL at Qwen2.5-VL-7B's widths
(`bench/gpu.py`'s `build`: text hidden 3,584, 28 heads, 4 KV heads, intermediate 18,944, vocabulary
152,064; as many vision blocks as text layers), fp32 on this CPU, ``--pairs`` dot-count pairs at
``--image-size`` px (a few short sequences). Then the organism (``toy``), 4 pairs of its own geometry.

On each model: the edge graph, the corrupt run recorded, and a circuit that ablates a random half of
every edge (so every node is live, the worst case for the masked sum), counterfactual patching. Timed,
interleaved and each the median of ``--repeats`` after one untimed call of each side:

- **plain**: ``vlm.hf`` on the clean batch (no KV cache, last-position logits);
- **ablated**: `edge_ablated_logits` of the same batch with that circuit (one stacked copy).

Reported per model: the seconds of each, their ratio, and the ratio the plan's cost model gives
(`countlens.pipeline.stages.edges.edge_forward_flops` over `countlens.pipeline.costs.forward_flops`).
The ratio must stay within 1.5 and not grow with depth (issue "Edges at a real model's scale").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from wide_model import build, interleaved  # noqa: E402


def measure(vlm, pairs, repeats: int, device: str = "cpu", warmup: bool = True) -> dict:
    """The plain and the edge-ablated forward of ``pairs``' clean batch, interleaved (module docstring)."""
    from countlens.circuits.engine.pair_batch import prepare_pairs
    from countlens.circuits.graph.edge_ablation import edge_ablated_logits
    from countlens.circuits.graph.edges import checked_graph
    from countlens.circuits.graph.nodes import image_positions, record_nodes
    from countlens.model.memory import widths
    from countlens.pipeline.costs import Forward, forward_flops
    from countlens.pipeline.stages.edges import edge_forward_flops

    pb = prepare_pairs(vlm, pairs)
    graph = checked_graph(vlm, pb.clean)
    values = record_nodes(vlm, pb.corrupt, graph.nodes)
    image = image_positions(vlm, pb.clean)
    n_edges = len(graph.edges)
    half = frozenset(np.random.default_rng(0).choice(n_edges, n_edges // 2, replace=False).tolist())

    @torch.no_grad()
    def plain():
        return vlm.hf(**pb.clean.inputs, use_cache=False, logits_to_keep=1).logits

    def ablated():
        return edge_ablated_logits(vlm, graph, pb.clean, [half], values, image)

    t = interleaved({"plain": plain, "ablated": ablated}, repeats, device, warmup)
    rows, seq = (int(x) for x in pb.clean.inputs["input_ids"].shape)
    w = widths(vlm)
    base = forward_flops(w, Forward(rows, seq), pb.clean.patches(w.merge))
    return {
        "model": vlm.name,
        "layers": vlm.arch.n_layers,
        "rows": rows,
        "seq": seq,
        "edges": n_edges,
        "ablated_edges": len(half),
        "plain_s": round(t["plain"], 3),
        "ablated_s": round(t["ablated"], 3),
        "ratio": round(t["ablated"] / t["plain"], 3),
        "planned_ratio": round((base + edge_forward_flops(w, seq, rows)) / base, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one depth, print its row
    args = ap.parse_args()
    import countlens
    from countlens.datasets.pairs import count_pairs

    torch.set_num_threads(os.cpu_count() or 1)
    out = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "image_size": args.image_size,
        "repeats": args.repeats,
        "seven_b_widths": [],
    }
    if args.one is not None:  # one depth, in this fresh process
        vlm, grid = build(args.one, args.image_size, torch.float32, "cpu")
        pairs = count_pairs(args.pairs, kind="dots", grid=grid, prompt="short", counts=range(2, 8), seed=0)
        print("ROW " + json.dumps(measure(vlm, pairs, args.repeats)), flush=True)
        return
    for depth in args.depths:  # each depth in a fresh process: no model's memory left behind
        cmd = [sys.executable, __file__, "--one", str(depth), *sys.argv[1:]]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        row = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("ROW "))[4:])
        print(json.dumps(row), flush=True)
        out["seven_b_widths"].append(row)
    toy = countlens.load("toy")
    pairs = count_pairs(4, kind="shapes", grid=toy.geometry, prompt="short", counts=range(2, 7), seed=4)
    out["organism"] = measure(toy, pairs, max(args.repeats, 5))
    print(json.dumps(out["organism"]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
