"""Every head-ranking method against every planted circuit: AUROC, precision@|C| and faithfulness.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_recovery.py            # the shipped planted organisms
    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_recovery.py --pairs 32 # quicker, noisier

For each shipped planted organism (`countlens.organisms.SHIPPED_PLANTED`, loaded by name), on discover's
own pairs ("shapes" pairs under seed 0, the short prompt, counts 1–9), each method ranks the 24 heads:
- exact head patching of z (`patch_heads`), AtP and AtP* (`attribution_patch`),
  EAP-IG on nodes (`node_attribution`, 5 steps);
- the drop in log p(gold) when a head is mean-ablated on counting scenes (`ablation_scan`);
- the share of the last position's attention on image tokens (`image_attention_share`, mean over
  the clean samples): a reading, not an intervention;
- a random ranking (the mean over 20 permutations; AUROC 0.5 by construction).
Scored against the planted heads C (`countlens.circuits.recovery`): AUROC and precision@|C|; and the
faithfulness f of the method's top |C| heads (every other head's z patched from the corrupt run,
`countlens.circuits.faithfulness`) with the CPR / CMD of its whole curve over MIB's sizes. These are
countlens's own measurements on its own planted organisms: no paper's figures are comparable.
Writes bench/planted_recovery.json and prints the table docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import xarray as xr

import countlens
from countlens.circuits import ablation_scan, attribution_patch, image_attention_share, node_attribution, patch_heads
from countlens.circuits.faithfulness import faithfulness
from countlens.circuits.recovery import auroc, precision_at
from countlens.datasets.pairs import count_pair, count_scene
from countlens.organisms import SHIPPED_PLANTED
from countlens.toy.planted import CIRCUITS

OUT = Path(__file__).with_suffix(".json")
RANDOM_DRAWS = 20


def rankings(vlm, pairs, scenes) -> dict[str, xr.DataArray]:
    out = {
        "exact patching": patch_heads(vlm, pairs).effect,
        "AtP": attribution_patch(vlm, pairs).effect,
        "EAP-IG (nodes)": node_attribution(vlm, pairs).effect,
        "mean-ablation drop": ablation_scan(vlm, {"count": scenes}).logp_drop.sel(task="count", drop=True),
        "image-attention share": image_attention_share(vlm, [p.clean for p in pairs]).mean("sample"),
        "AtP*": attribution_patch(vlm, pairs, method="atp*").effect,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--organisms", nargs="*", default=[f"planted-{c}" for c in SHIPPED_PLANTED])
    args = ap.parse_args()
    result: dict = {"pairs": args.pairs, "random_draws": RANDOM_DRAWS, "organisms": {}}
    for name in args.organisms:
        circuit = CIRCUITS[name.removeprefix("planted-")]
        vlm = countlens.load(name)
        pairs = [count_pair(0, i, "shapes", prompt="short") for i in range(args.pairs)]
        scenes = [count_scene(0, i, "shapes", prompt="short", counts=range(1, 10)) for i in range(args.pairs)]
        start = time.time()
        ranks = rankings(vlm, pairs, scenes)
        n_heads = vlm.arch.n_layers * vlm.arch.n_heads
        k = len(circuit.heads)
        rows = {}
        for method, scores in ranks.items():
            curve = faithfulness(vlm, pairs, scores)
            top = faithfulness(vlm, pairs, scores, sizes=((k + 0.5) / n_heads,))
            rows[method] = {
                "auroc": round(auroc(scores, circuit.heads), 3),
                f"precision@{k}": round(precision_at(scores, circuit.heads), 3),
                f"f(top {k})": round(float(top.faithfulness.item()), 3),
                "cpr": round(curve.attrs["cpr"], 3),
                "cmd": round(curve.attrs["cmd"], 3),
            }
        rng = np.random.default_rng(0)
        template = ranks["exact patching"]
        draws = [template.copy(data=rng.permutation(template.size).reshape(template.shape)) for _ in range(20)]
        rows["random"] = {
            "auroc": round(float(np.mean([auroc(d, circuit.heads) for d in draws])), 3),
            f"precision@{k}": round(float(np.mean([precision_at(d, circuit.heads) for d in draws])), 3),
        }
        result["organisms"][name] = {
            "circuit": sorted(circuit.heads),
            "methods": rows,
            "seconds": round(time.time() - start, 1),
        }
        print(name, json.dumps(rows, indent=1), flush=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


def table(result: dict) -> str:
    lines = []
    for name, r in result["organisms"].items():
        k = len(r["circuit"])
        lines += [
            f"\n{name} (C = {', '.join(f'L{a}H{b}' for a, b in r['circuit'])})\n",
            f"| method | AUROC | precision@{k} | f(top {k}) | CPR | CMD |",
            "|---|---|---|---|---|---|",
        ]
        for method, row in r["methods"].items():
            cells = [row.get(c, "") for c in ("auroc", f"precision@{k}", f"f(top {k})", "cpr", "cmd")]
            lines.append(f"| {method} | " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
