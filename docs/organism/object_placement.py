"""Which objects does the organism count? Exact object effects on COUNTINGTRICKS position cases.

    HF_HUB_OFFLINE=1 .venv/bin/python docs/organism/object_placement.py [n_per_case]   # default 12

Draws ``n_per_case`` scenes of each position case 1A–4A (size-p circles centred in a cell, on a
vertical line, on a horizontal line, on an intersection; counts 3–12 cycled by index) on the
organism's geometry (192 px, 16 px patches, 2×2 merge: 32 px token cells), measures every object's
effect at the input (site Residual(-1), stored as "embed" in the figures below) against both
references ("removed": the scene without the object; "background": the empty scene) with
`countlens.circuits.objects.effects`, and the misses table by placement, size and contact with
`countlens.analysis.object_misses` (bootstrap over scenes, 2,000 resamples, seed 0; Wilson for the missed rate).
Writes docs/organism/object_placement.json
beside this file: per reference the table rows, the accuracy by case (``clean_correct``: the arg-max
at the read position is the true count's token) and the timings.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import countlens
from countlens.analysis import object_misses
from countlens.circuits import Residual, object_effects
from countlens.datasets import countingtricks

CASES = ["1A", "2A", "3A", "4A"]


def main(n_per_case: int = 12) -> dict:
    vlm = countlens.load("toy")
    samples = countingtricks(CASES, n_per_case, grid=vlm.geometry, seed=0, prompt="short")
    out: dict = {"model": "toy", "cases": CASES, "n_per_case": n_per_case, "site": "embed", "references": {}}
    for reference in ("removed", "background"):
        t0 = time.perf_counter()
        ds = object_effects(vlm, samples, reference=reference, site=Residual(-1), batch_size=32)
        seconds = time.perf_counter() - t0
        table = object_misses(ds, seed=0)
        live = ds.exists & (ds.n_tokens > 0)
        by_case = {
            case: {
                "accuracy": float(ds.clean_correct[ds.case == case].mean()),
                "mean_effect": float(ds.effect.where(live)[ds.case == case].mean()),
                "mean_normalised": float(ds.normalised.where(live)[ds.case == case].mean()),
            }
            for case in CASES
        }
        rows = {
            str(g): {k: (None if not np.isfinite(v) else round(float(v), 4)) for k, v in table.sel(group=g).items()}
            for g in table.group.values
        }
        out["references"][reference] = {
            "seconds": round(seconds, 1),
            "objects": int(live.sum()),
            "wrong_scenes": int(table.attrs["wrong_scenes"]),
            "by_case": by_case,
            "table": rows,
            "mean_tokens_per_object": float(ds.n_tokens.where(live).mean()),
            "shared_token_objects": int((ds.shared_tokens > 0).sum()),
        }
        print(f"\n{reference}: {int(live.sum())} objects in {len(samples)} scenes, {seconds:.1f} s")
        print(f"  {'group':24s} {'n':>4s} {'mean effect [95% CI]':>28s} {'missed':>7s} {'rate [95% CI]':>24s} chance")
        for g, r in rows.items():
            eff = f"{r['mean_effect']} [{r['effect_low']}, {r['effect_high']}]"
            rate = f"{r['missed_rate']} [{r['missed_low']}, {r['missed_high']}]"
            missed = f"{r['missed']:.0f}/{r['n_wrong_objects']:.0f}"
            print(f"  {g:24s} {r['n_objects']:>4.0f} {eff:>28s} {missed:>7s} {rate:>24s} {r['chance_rate']}")
        print("  by case:", json.dumps(by_case))
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    result = main(n)
    path = Path(__file__).with_suffix(".json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
