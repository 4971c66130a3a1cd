"""Do the attribution graph's paths run through the planted heads? (issue 65)

    HF_HUB_OFFLINE=1 .venv/bin/python bench/graph_planted.py               # train_transcoders' defaults
    HF_HUB_OFFLINE=1 .venv/bin/python bench/graph_planted.py --steps 300   # shorter transcoder training

For each planted organism whose count is carried by known heads (``planted-route``: L0H2;
``planted-two-hop``: L0H0 then L1H1; ``planted-spread``: L0H0, L0H3, L1H2, L2H1), train transcoders on
it (`train_transcoders`, its defaults but ``--steps``; written under ``--cache``, default
/tmp/countlens-graph-planted, and reused from there while the organism's weights are the same), build
the attribution graph of 8 counting scenes (the "shapes" kind, the organisms' short prompt, counts
2–9: the clean scene of ``count_pair(0, c, clean=c, corrupt=c − 1)``) and split each graph's top logit by head
(`countlens.features.head_paths.head_shares`). Reported per organism:

- the mean over scenes of each planted head's **share** — the share of the image-token embeddings'
  attribution to the logit that passes through it (the total effect through the head, attention
  frozen) — and the largest mean |share| of a head outside the planted set;
- AUROC and precision@|C| of the ranking of heads by mean |share| against the planted heads, and
  the same for the head's total path (``path``: its whole effect on the logit, image or not) and
  for the spread over the 8 scenes (standard deviation) of the image attribution through the head
  (``image``, in logit units): a head that carries the count passes a part that changes with it;
- the exactness residual (the largest |no_heads + Σ direct − value| and |graph_image − image_total|,
  relative to the value), and wall times.

Writes bench/graph_planted.json and prints the markdown table the docs show
(docs/concepts/attribution_graphs.md, "Do the graph's paths run through the planted heads?").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import xarray as xr

import countlens
from countlens.datasets.pairs import count_pair
from countlens.features import attribution_graph, train_transcoders
from countlens.features.head_paths import head_shares, planted_path_recovery
from countlens.labels import head_label
from countlens.toy.catalogue import planted_circuit_of

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import Load  # noqa: E402

ORGANISMS = ("planted-route", "planted-two-hop", "planted-spread")
COUNTS = range(2, 10)


def scenes() -> list:
    return [count_pair(0, c, "shapes", clean=c, corrupt=c - 1, prompt="short").clean for c in COUNTS]


def _cache_name(name: str, steps: int | None) -> str:
    """The transcoders' folder: the organism's name, its weights' digest (a re-planted organism trains
    its own) and the steps."""
    import hashlib

    from countlens.model.shipped import ORGANISMS as FOLDERS

    digest = hashlib.sha256((FOLDERS[name] / "model.safetensors").read_bytes()).hexdigest()[:12]
    return f"{name}-{digest}-steps{steps or 'default'}"


def organism(name: str, steps: int | None, cache: Path) -> dict:
    vlm = countlens.load(name)
    circuit = sorted(planted_circuit_of(name).heads)
    kw = {} if steps is None else {"steps": steps}
    start = time.perf_counter()
    with Load() as load:
        tcs = train_transcoders(vlm, out=cache / _cache_name(name, steps), progress=False, **kw)
    train_s = time.perf_counter() - start
    fvu = tcs.fidelity["fvu"].values.tolist() if "fvu" in tcs.fidelity else None
    rows, shares, paths, images = [], [], [], []
    graph_s = shares_s = 0.0
    for sample in scenes():
        t = time.perf_counter()
        graph = attribution_graph(vlm, tcs.transcoders, sample)
        graph_s += time.perf_counter() - t
        t = time.perf_counter()
        d = head_shares(vlm, tcs.transcoders, sample, graph=graph)
        shares_s += time.perf_counter() - t
        a = d.attrs
        shares.append(d["share"])
        paths.append(d["path"])
        images.append(d["image"])
        rows.append(
            {
                "answer": sample.answer,
                "target": a["target_string"],
                "target_is_answer": a["target"] == graph.answer_token,
                "value": round(a["value"], 4),
                "image_total": round(a["image_total"], 4),
                "no_heads": round(a["no_heads"], 4),
                "planted_share": {
                    head_label(c): round(float(d["share"].sel(layer=c[0], head=c[1])), 4) for c in circuit
                },
                "direct_residual": abs(a["no_heads"] + float(d["direct"].sum()) - a["value"]) / abs(a["value"]),
                "graph_residual": abs(a["graph_image"] - a["image_total"]) / abs(a["value"]),
            }
        )
    share = xr.concat(shares, "scene")
    mean_abs, mean = abs(share).mean("scene"), share.mean("scene")
    path_abs = abs(xr.concat(paths, "scene")).mean("scene")
    outside = mean_abs.copy()
    for layer, head in circuit:
        outside.loc[{"layer": layer, "head": head}] = np.nan
    top = np.unravel_index(int(np.nanargmax(outside.values)), outside.shape)
    by_share = planted_path_recovery(mean_abs, circuit)
    by_path = planted_path_recovery(path_abs, circuit)
    by_spread = planted_path_recovery(xr.concat(images, "scene").std("scene"), circuit)
    return {
        "organism": name,
        "planted": [head_label(c) for c in circuit],
        "transcoder_steps": steps or "default",
        "fvu": fvu,
        "planted_mean_share": {head_label(c): round(float(mean.sel(layer=c[0], head=c[1])), 4) for c in circuit},
        "top_other": head_label((int(top[0]), int(top[1]))),
        "top_other_mean_share": round(float(mean.values[top]), 4),
        "top_other_mean_abs_share": round(float(mean_abs.values[top]), 4),
        "auroc_share": round(by_share["auroc"], 4),
        "precision_share": round(by_share["precision"], 4),
        "auroc_path": round(by_path["auroc"], 4),
        "precision_path": round(by_path["precision"], 4),
        "auroc_image_spread": round(by_spread["auroc"], 4),
        "precision_image_spread": round(by_spread["precision"], 4),
        "target_is_answer": sum(r["target_is_answer"] for r in rows),
        "max_direct_residual": max(r["direct_residual"] for r in rows),
        "max_graph_residual": max(r["graph_residual"] for r in rows),
        "mean_share": np.round(mean.values, 4).tolist(),
        "train_s": round(train_s, 1),
        "train_others_load_cores": load.others,
        "graphs_s": round(graph_s, 1),
        "shares_s": round(shares_s, 1),
        "scenes": rows,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| organism | planted heads: mean share | largest other head: mean share (mean \\|share\\|) "
        "| AUROC / precision@\\|C\\| of mean \\|share\\| | of mean \\|path\\| | of the image part's spread "
        "| top logit = answer "
        "| residuals (direct sum, graph) | time: transcoders / 8 graphs / 8 splits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        planted = ", ".join(f"{k} {v:+.3f}" for k, v in r["planted_mean_share"].items())
        lines.append(
            f"| {r['organism']} | {planted} | {r['top_other']} {r['top_other_mean_share']:+.3f} "
            f"({r['top_other_mean_abs_share']:.3f}) | {r['auroc_share']:.3f} / {r['precision_share']:.2f} "
            f"| {r['auroc_path']:.3f} / {r['precision_path']:.2f} "
            f"| {r['auroc_image_spread']:.3f} / {r['precision_image_spread']:.2f} "
            f"| {r['target_is_answer']} / {len(r['scenes'])} "
            f"| {r['max_direct_residual']:.1e}, {r['max_graph_residual']:.1e} "
            f"| {r['train_s']:.0f} s / {r['graphs_s']:.0f} s / {r['shares_s']:.1f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="transcoder training steps (default: its default)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/countlens-graph-planted"))
    parser.add_argument("--organisms", nargs="*", default=list(ORGANISMS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [organism(name, args.steps, args.cache) for name in args.organisms]
    out = {"command": " ".join(sys.argv), "counts": list(COUNTS), "results": results}
    (HERE / "graph_planted.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
