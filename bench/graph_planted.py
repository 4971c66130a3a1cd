"""Do the attribution graph's paths run through the planted heads? (issues 65, 77)

    HF_HUB_OFFLINE=1 .venv/bin/python bench/graph_planted.py               # train_transcoders' defaults
    HF_HUB_OFFLINE=1 .venv/bin/python bench/graph_planted.py --steps 300   # shorter transcoder training

For each planted organism whose count is carried by known heads (``planted-route``: L0H2;
``planted-two-hop``: L0H0 then L1H1; ``planted-spread``: L0H0, L0H3, L1H2, L2H1), train transcoders on
it (`train_transcoders`, its defaults but ``--steps``; written under ``--cache``, default
/tmp/countlens-graph-planted, and reused from there while the organism's weights are the same), build
the attribution graph of 8 counting scenes (the "shapes" kind, the organisms' short prompt, counts
2–9: the clean scene of ``count_pair(seed, c, clean=c, corrupt=c − 1)``, ``--seed`` 0 by default) and
split each graph's top logit by head (`countlens.features.head_paths.head_shares`). Reported per organism:

- the mean over scenes of each planted head's **share** — the share of the image-token embeddings'
  attribution to the logit that passes through it (the total effect through the head, attention
  frozen) — and the largest mean |share| of a head outside the planted set;
- AUROC and precision@|C| of the ranking of heads by mean |share| against the planted heads, and
  the same for the head's total path (``path``: its whole effect on the logit, image or not) and
  for the spread over the 8 scenes (standard deviation) of the image attribution through the head
  (``image``, in logit units): a head that carries the count passes a part that changes with it;
- the same rankings for every way of splitting (`VARIANTS`: features frozen, as the graph's edges
  hold them, or linear, following its feature-to-feature edges — ``head_shares(features=...)``; the
  answer's logit alone, or against the partner's answer, the count c − 1 — ``against=``) and every
  per-head score over the scenes (`MEASURES`: mean |share|, |path|, |image|; |mean| path and image;
  the spread of the image part and of the path);
- the real model's own ranking (`real_model`, ``--real-pairs`` held-out pairs): each head's accuracy
  drop when resampled alone, against the planted heads — what a method faithful to the model could
  reach — and, where the circuit's heads are not each necessary, the outside check with only the
  necessary ones kept;
- the exactness residual (the largest |no_heads + Σ direct − value| and |graph_image − image_total|,
  relative to the value), and wall times.

Every head's figures of every variant go to ``--cache``/…-heads.npz (scene, layer, head) too.

Writes bench/graph_planted.json and prints the markdown table the docs show
(docs/concepts/attribution_graphs.md, "Do the graph's paths run through the planted heads?").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import xarray as xr

import countlens
from countlens.datasets.pairs import count_pair
from countlens.features import attribution_graph, train_transcoders
from countlens.features.head_paths import VARIABLES, head_shares, planted_path_recovery
from countlens.labels import head_label
from countlens.toy.catalogue import planted_circuit_of
from countlens.toy.plant import PLANTED_CHECKS, verify
from countlens.toy.planted import PlantedNode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import Load  # noqa: E402

ORGANISMS = ("planted-route", "planted-two-hop", "planted-spread")
COUNTS = range(2, 10)


#: The ways `head_shares` is run on each scene: (features, against the partner's answer).
VARIANTS: dict[str, tuple[str, bool]] = {
    "frozen": ("frozen", False),
    "linear": ("linear", False),
    "frozen_vs_partner": ("frozen", True),
    "linear_vs_partner": ("linear", True),
}
#: Per-head scores over the scenes, each ranked by its magnitude against the planted heads.
MEASURES = (
    "mean_abs_share",
    "mean_abs_path",
    "mean_abs_image",
    "mean_path",
    "mean_image",
    "image_spread",
    "path_spread",
)


def pairs(seed: int = 0) -> list:
    return [count_pair(seed, c, "shapes", clean=c, corrupt=c - 1, prompt="short") for c in COUNTS]


def scenes(seed: int = 0) -> list:
    return [p.clean for p in pairs(seed)]


def measures(ds: list[xr.Dataset]) -> dict[str, xr.DataArray]:
    """The per-head scores of `MEASURES` from one variant's Datasets over the scenes."""
    share, path, image = (xr.concat([d[v] for d in ds], "scene") for v in ("share", "path", "image"))
    return {
        "mean_abs_share": abs(share).mean("scene"),
        "mean_abs_path": abs(path).mean("scene"),
        "mean_abs_image": abs(image).mean("scene"),
        "mean_path": path.mean("scene"),  # ranked by |mean|: a push the same way in every scene
        "mean_image": image.mean("scene"),
        "image_spread": image.std("scene"),
        "path_spread": path.std("scene"),
    }


def _cache_name(name: str, steps: int | None) -> str:
    """The transcoders' folder: the organism's name, its weights' digest (a re-planted organism trains
    its own) and the steps."""
    import hashlib

    from countlens.model.shipped import ORGANISMS as FOLDERS

    digest = hashlib.sha256((FOLDERS[name] / "model.safetensors").read_bytes()).hexdigest()[:12]
    return f"{name}-{digest}-steps{steps or 'default'}"


def real_model(vlm, name: str, n_pairs: int) -> dict:
    """The planted heads in the real model (`countlens.toy.plant.verify` on ``n_pairs`` held-out pairs): each
    head's accuracy drop when it alone is resampled from another scene (every head of the model a node),
    ranked against the planted heads — the ranking a method faithful to the model could reach — and, for
    a circuit whose heads are not each necessary, the outside check with only the heads that are
    (a drop ≥ `PLANTED_CHECKS`' node_drop_min) kept: whether the others are needed at all."""
    circuit = planted_circuit_of(name)
    cells = [(layer, h) for layer in range(vlm.arch.n_layers) for h in range(vlm.arch.heads(layer))]
    every = replace(circuit, nodes=tuple(PlantedNode(layer, h) for layer, h in cells), each_necessary=False)
    t = time.perf_counter()
    fig = verify(vlm.hf, every, n_pairs=n_pairs)
    drop = xr.DataArray(
        np.full((vlm.arch.n_layers, vlm.arch.n_heads), np.nan),
        dims=("layer", "head"),
        coords={"layer": np.arange(vlm.arch.n_layers), "head": np.arange(vlm.arch.n_heads)},
    )
    for layer, h in cells:
        drop.loc[{"layer": layer, "head": h}] = fig["accuracy"] - fig[f"node_resampled/{head_label((layer, h))}"]
    out = {
        "n_pairs": n_pairs,
        "accuracy": fig["accuracy"],
        "node_drop": {head_label(c): round(float(drop.sel(layer=c[0], head=c[1])), 4) for c in cells},
        "recovery_node_drop": _recovery(drop, sorted(circuit.heads)),
    }
    needed = [
        n for n in circuit.nodes if float(drop.sel(layer=n.layer, head=n.head)) >= PLANTED_CHECKS["node_drop_min"]
    ]
    if len(needed) < len(circuit.nodes):
        kept = verify(vlm.hf, replace(circuit, nodes=tuple(needed)), n_pairs=n_pairs)
        out["only_needed"] = {
            "kept": [n.label for n in needed],
            **{k: kept[k] for k in ("accuracy", "outside_resampled", "outside_resampled_random", "circuit_resampled")},
        }
    out["seconds"] = round(time.perf_counter() - t, 1)
    return out


def organism(name: str, steps: int | None, cache: Path, n_pairs: int, seed: int = 0) -> dict:
    vlm = countlens.load(name)
    circuit = sorted(planted_circuit_of(name).heads)
    kw = {} if steps is None else {"steps": steps}
    start = time.perf_counter()
    with Load() as load:
        tcs = train_transcoders(vlm, out=cache / _cache_name(name, steps), progress=False, **kw)
    train_s = time.perf_counter() - start
    fvu = tcs.fidelity["fvu"].values.tolist() if "fvu" in tcs.fidelity else None
    rows, shares, paths, images = [], [], [], []
    by_variant: dict[str, list[xr.Dataset]] = {v: [] for v in VARIANTS}
    variant_s = dict.fromkeys(VARIANTS, 0.0)
    graph_s = 0.0
    for pair in pairs(seed):
        sample = pair.clean
        t = time.perf_counter()
        graph = attribution_graph(vlm, tcs.transcoders, sample)
        graph_s += time.perf_counter() - t
        partner = vlm.answer_ids(pair.corrupt.answer)[0]
        for key, (features, vs) in VARIANTS.items():
            t = time.perf_counter()
            got = head_shares(
                vlm, tcs.transcoders, sample, graph=graph, features=features, against=partner if vs else None
            )
            variant_s[key] += time.perf_counter() - t
            by_variant[key].append(got)
        d = by_variant["frozen"][-1]
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
                "variants": {key: _scene_summary(ds[-1]) for key, ds in by_variant.items()},
            }
        )
    shares_s = variant_s["frozen"]
    if cache is not None:  # every head's figures, for analyses the JSON does not hold
        np.savez(
            cache / f"{_cache_name(name, steps)}-seed{seed}-heads.npz",
            **{f"{k}/{v}": np.stack([d[v].values for d in ds]) for k, ds in by_variant.items() for v in VARIABLES},
        )
    ranked = {
        key: {m: _recovery(score, circuit) for m, score in measures(ds).items()} for key, ds in by_variant.items()
    }
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
        "variant_s": {k: round(v, 1) for k, v in variant_s.items()},
        "recovery": ranked,
        "real_model": real_model(vlm, name, n_pairs) if n_pairs else None,
        "scenes": rows,
    }


def _scene_summary(d: xr.Dataset) -> dict:
    """One variant on one scene: its value, image total, and the residuals of its identities (relative to
    the value's size, at least 1)."""
    a = d.attrs
    size = max(abs(a["value"]), 1.0)
    out = {
        "value": round(a["value"], 4),
        "image_total": round(a["image_total"], 4),
        "direct_residual": abs(a["no_heads"] + float(d["direct"].sum()) - a["value"]) / size,
    }
    if "graph_image" in a:
        out["graph_residual"] = abs(a["graph_image"] - a["image_total"]) / size
    return out


def _recovery(score: xr.DataArray, circuit) -> dict:
    got = planted_path_recovery(score, circuit)
    return {"auroc": round(got["auroc"], 4), "precision": round(got["precision"], 4)}


def grid(results: list[dict]) -> str:
    """AUROC / precision@|C| of every variant and measure, one row per (organism, variant)."""
    lines = [
        "| organism | variant | " + " | ".join(MEASURES) + " |",
        "|---|---|" + "---|" * len(MEASURES),
    ]
    for r in results:
        for key, by in r["recovery"].items():
            cells = " | ".join(f"{by[m]['auroc']:.3f} / {by[m]['precision']:.2f}" for m in MEASURES)
            lines.append(f"| {r['organism']} | {key} | {cells} |")
    return "\n".join(lines)


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
    parser.add_argument("--seed", type=int, default=0, help="the scenes' seed (not 0: writes graph_planted_seedN.json)")
    parser.add_argument("--real-pairs", type=int, default=64, help="held-out pairs of the real-model check (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [organism(name, args.steps, args.cache, args.real_pairs, args.seed) for name in args.organisms]
    out = {"command": " ".join(sys.argv), "counts": list(COUNTS), "seed": args.seed, "results": results}
    (HERE / ("graph_planted.json" if args.seed == 0 else f"graph_planted_seed{args.seed}.json")).write_text(
        json.dumps(out, indent=1) + "\n"
    )
    print(table(results))
    print()
    print(grid(results))


if __name__ == "__main__":
    main()
