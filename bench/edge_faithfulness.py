"""Edge-level faithfulness on the organism: EAP and EAP-IG edge rankings against random ones.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/edge_faithfulness.py   # writes bench/edge_faithfulness.json

32 shape pairs at the organism's geometry (counts 2–6, seed 4), every edge of its graph
(`countlens.circuits.graph.edges`: inputs, heads and MLPs into q / k / v per head, MLP inputs and the
logits); EAP (one gradient) and EAP-IG (5 steps) scores, then `faithfulness_curves(level="edge")` at
MIB's sizes with counterfactual patching and 5 random rankings. Reported: CPR, CMD, the smallest
fraction of edges reaching 80 % faithfulness, each curve, and the seconds of each step on this CPU.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import countlens
from countlens.circuits.graph.edge_attribution import edge_attribution
from countlens.circuits.graph.faithfulness import faithfulness_curves, smallest_faithful
from countlens.datasets.pairs import count_pairs


def main() -> dict:
    vlm = countlens.load("toy")
    pairs = count_pairs(32, kind="shapes", grid=vlm.geometry, prompt="short", counts=range(2, 7), seed=4)
    t0 = time.perf_counter()
    eap = edge_attribution(vlm, pairs, method="eap")
    t1 = time.perf_counter()
    ig = edge_attribution(vlm, pairs, method="eap-ig", steps=5)
    t2 = time.perf_counter()
    ds = faithfulness_curves(vlm, pairs, {"EAP": eap, "EAP-IG (5 steps)": ig}, level="edge", random_draws=5)
    t3 = time.perf_counter()
    smallest = smallest_faithful(ds, 0.8)
    rankings = ["EAP", "EAP-IG (5 steps)", "random"]
    out = {
        "model": vlm.name,
        "pairs": len(pairs),
        "edges": int(ds.attrs["n_nodes"]),
        "kept": [int(k) for k in ds.kept.values],
        "seconds": {"eap": round(t1 - t0, 1), "eap_ig": round(t2 - t1, 1), "curves": round(t3 - t2, 1)},
        "random_std": {
            "cpr": round(float(ds.cpr_std.sel(ranking="random")), 3),
            "cmd": round(float(ds.cmd_std.sel(ranking="random")), 3),
        },
    }
    for r in rankings:
        out[r] = {
            "cpr": round(float(ds.cpr.sel(ranking=r)), 3),
            "cmd": round(float(ds.cmd.sel(ranking=r)), 3),
            "smallest_80": round(float(smallest.sel(ranking=r)), 4),
            "curve": [round(float(x), 3) for x in ds.faithfulness.sel(ranking=r).values],
        }
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
