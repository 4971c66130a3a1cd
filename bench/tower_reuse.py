"""Stacked ablated forwards with the vision tower run once per batch, against the tower run per replica.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/tower_reuse.py   # writes bench/tower_reuse.json

`countlens.circuits.graph.nodes.ablated_logits` and `countlens.circuits.graph.edge_ablation.edge_ablated_logits`
stack one copy of the batch per circuit; every copy shows the same images, so the tower's output is
computed once (`countlens.circuits.sites.tower_output`) and fed to every copy (`skip_tower`). Timed
here against the same calls with that reuse turned off (the tower then runs on every copy), on the
organism (Qwen2-VL: its tower attends within each image) and on the tests' tiny Mistral 3 (Pixtral:
its tower packs every image of the stacked batch into one sequence, so its cost grows with the square
of the copies). 4 count pairs, 16 random circuits of nodes and of edges, the medians of 3 interleaved
runs after a warm-up; the logits of both ways are compared (they must be equal).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from _timing import Load, interleaved  # noqa: E402

import countlens  # noqa: E402
from countlens.circuits.graph import edge_ablation, nodes  # noqa: E402
from countlens.circuits.graph.edges import edge_graph  # noqa: E402
from countlens.circuits.graph.nodes import ablated_logits, graph_nodes, image_positions, record_nodes  # noqa: E402
from countlens.circuits.methods.patching import prepare_pairs  # noqa: E402
from countlens.datasets.pairs import count_pairs  # noqa: E402

CIRCUITS = 16


def _load(name: str):
    if name == "toy":
        return countlens.load("toy"), 192
    from disk_cache import cached_dir, entry_key
    from tiny_models import TINY_IMAGE_SIZE

    from tests.conftest import _save_tiny

    path = cached_dir(entry_key("tiny", name), lambda p: _save_tiny(name, {}, p))
    return countlens.load(path), TINY_IMAGE_SIZE[name][0]


def _no_reuse(fn):
    """``fn`` run with the tower computed on every stacked copy (the reuse turned off)."""

    def run():
        saved = nodes.tower_output, edge_ablation.tower_output
        nodes.tower_output = edge_ablation.tower_output = lambda vlm, batch: None
        try:
            return fn()
        finally:
            nodes.tower_output, edge_ablation.tower_output = saved

    return run


def measure(name: str) -> dict:
    vlm, size = _load(name)
    pairs = count_pairs(4, 3, 5, kind="polygons", image_size=size, prompt="short", seed=4)
    pb = prepare_pairs(vlm, pairs)
    image = image_positions(vlm, pb.clean)
    rng = random.Random(0)
    node_list = graph_nodes(vlm)
    node_values = record_nodes(vlm, pb.corrupt, node_list)
    node_sets = [frozenset(rng.sample(node_list, len(node_list) // 2)) for _ in range(CIRCUITS)]
    graph = edge_graph(vlm)
    edge_values = record_nodes(vlm, pb.corrupt, graph.nodes)
    edge_sets = [frozenset(rng.sample(range(len(graph.edges)), len(graph.edges) // 2)) for _ in range(CIRCUITS)]
    calls = {
        "nodes": lambda: ablated_logits(vlm, pb.clean, node_sets, node_values, image),
        "edges": lambda: edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, edge_sets, edge_values, image),
    }
    out = {}
    for kind, call in calls.items():
        diff = float((call() - _no_reuse(call)()).abs().max())
        with Load() as load:
            t = interleaved({"reused": call, "per_copy": _no_reuse(call)}, repeats=3)
        out[kind] = {
            "reused_s": round(t["reused"], 3),
            "per_copy_s": round(t["per_copy"], 3),
            "speedup": round(t["per_copy"] / t["reused"], 2),
            "max_abs_logit_diff": diff,
            "others_load_cores": load.others,
        }
    return {"circuits": CIRCUITS, "pairs": len(pairs), "rows": 2 * len(pairs), **out}


def main() -> dict:
    torch.set_num_threads(1)
    result = {"threads": 1, "models": {name: measure(name) for name in ("toy", "mistral3")}}
    (Path(__file__).with_suffix(".json")).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
