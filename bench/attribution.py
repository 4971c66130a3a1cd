"""Attribution methods side by side against exact head patching: cost and how well each ranks the heads.

    .venv/bin/python bench/attribution.py            # writes bench/attribution.json
    .venv/bin/python bench/attribution.py --tiny     # AtP, AtP* on the tiny Qwen2-VLs → bench/attribution_tiny.json

On the organism with the demo's 128 pairs (`countlens discover`'s defaults: ``count_pairs(128,
kind="shapes", seed=0, prompt="short", counts=1–9)``), in one process: every method of the registry
(`countlens.circuits.methods.registry.METHODS`: exact head patching, AtP, EAP-IG on nodes (5 steps), the
mean-ablation drop, AtP*, EAP and EAP-IG on edges (a head's score is its outgoing edges' sum), RelP),
and beside them EAP-IG at 1 and 16 steps. For each: wall seconds (one run each, after one warm-up of a
small chunk; the machine's other load recorded), that cost in "forward-equivalents" (the method's
seconds over one plain forward of the 128 clean inputs in the same batches), and Spearman ρ and top-5
overlap of |effect| against exact patching (`countlens.circuits.compare`).

One more row is no countlens ranking: the QK fix's query, key and value estimates of each head
(`atp_star(..., graddrop=False)`) summed, what a head's estimate would be if it were scored through
its parts: the figure `countlens.circuits.methods.atp_star`'s docstring cites for not doing so.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _timing import Load  # noqa: E402

import countlens  # noqa: E402
from countlens.circuits import attribution_patch, compare, patch_heads  # noqa: E402
from countlens.circuits.graph.integrated import node_attribution  # noqa: E402
from countlens.circuits.methods.atp_star import atp_star  # noqa: E402
from countlens.circuits.methods.registry import METHODS, method  # noqa: E402
from countlens.datasets import count_pairs  # noqa: E402

OUT = Path(__file__).with_suffix(".json")
BATCH = 16


def main() -> None:
    torch.set_num_threads(2)
    vlm = countlens.load("toy")
    pairs = count_pairs(128, kind="shapes", grid=vlm.geometry, seed=0, prompt="short", counts=range(1, 10))
    attribution_patch(vlm, pairs[:4], batch_size=4)  # warm-up: first-call costs out of the figures

    def plain() -> None:
        with torch.no_grad():
            for start in range(0, len(pairs), BATCH):
                chunk = pairs[start : start + BATCH]
                batch = vlm.prepare([p.clean.image for p in chunk], [p.clean.question for p in chunk])
                vlm.hf(**batch.inputs)

    # Every registered method (`countlens.circuits.methods.registry.METHODS`), then the extra settings shown
    # beside them.
    methods = {"plain forward (clean inputs)": plain}
    methods |= {m.label: (lambda m=m: m.ranking(vlm, pairs, BATCH)) for m in METHODS if m.supports(vlm)}
    methods |= {
        "EAP-IG, 1 step": lambda: node_attribution(vlm, pairs, steps=1, batch_size=BATCH).effect,
        "EAP-IG, 16 steps": lambda: node_attribution(vlm, pairs, steps=16, batch_size=BATCH).effect,
        "QK fix, q + k + v summed per head": lambda: _parts_summed(
            atp_star(vlm, pairs, batch_size=BATCH, graddrop=False)
        ),
    }
    results, rows = {}, {}
    for name, fn in methods.items():
        with Load() as load:
            t = time.perf_counter()
            results[name] = fn()
            seconds = time.perf_counter() - t
        rows[name] = {"seconds": round(seconds, 2), "others_load_cores": load.others}
    reference = method("exact").label
    exact = results[reference]
    unit = rows["plain forward (clean inputs)"]["seconds"]
    for name, row in rows.items():
        row["forward_equivalents"] = round(row["seconds"] / unit, 1)
        if name not in ("plain forward (clean inputs)", reference):
            score = compare(results[name], exact, k=5)
            row.update(spearman=round(score["spearman"], 3), top5_overlap=score["top_k_overlap"])
    record = {"machine": platform.processor() or platform.machine(), "pairs": len(pairs), "methods": rows}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name:32s} {row}")


def _parts_summed(ds):
    return ds.q_effect + ds.k_effect + ds.v_effect


def tiny() -> None:
    """AtP and AtP* against exact head patching on the tiny real-vocabulary Qwen2-VL and Qwen2.5-VL
    (random weights, the tests' builders; 32 polygon pairs 3 vs 5, batch 8, one thread) →
    bench/attribution_tiny.json."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import tiny_checkpoint
    from tiny_models import TINY_IMAGE_SIZE

    torch.set_num_threads(1)
    record = {}
    for name in ("qwen2_vl", "qwen2_5_vl"):
        vlm = countlens.load(tiny_checkpoint.__wrapped__()(name))
        pairs = count_pairs(32, 3, 5, kind="polygons", image_size=TINY_IMAGE_SIZE[name][0], prompt="short", seed=4)
        exact = patch_heads(vlm, pairs, batch_size=8).effect
        row = {"heads": int(exact.notnull().sum())}
        for m in (method("atp"), method("atp_star")):  # both by attribution_patch, as its method= names them
            t = time.perf_counter()
            estimate = m.ranking(vlm, pairs, 8)
            score = compare(estimate, exact, k=5)
            row[m.variant] = {
                "seconds": round(time.perf_counter() - t, 1),
                "spearman": round(score["spearman"], 3),
                "top5_overlap": score["top_k_overlap"],
            }
        record[name] = row
        print(name, row)
    OUT.with_name("attribution_tiny.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    tiny() if "--tiny" in sys.argv else main()
