"""Every head-ranking method against every planted circuit: AUROC, precision@|C| and faithfulness.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_recovery.py            # the shipped planted organisms
    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_recovery.py --pairs 32 # quicker, noisier

For each shipped planted organism (`countlens.model.shipped.SHIPPED_PLANTED`, loaded by name), on discover's
own pairs ("shapes" pairs under seed 0, the short prompt, counts 1–9), each method ranks the 24 heads:
- every method of the registry (`countlens.circuits.methods.registry.METHODS`) the organism supports: exact head
  patching of z, AtP, EAP-IG on nodes (5 steps), the drop in log p(gold) when a head is mean-ablated
  (on the pairs' clean scenes), AtP*, EAP and EAP-IG (5 steps) on edges — a head's score is the sum of
  its outgoing edges' (``node_effect``), and the faithfulness columns of these rows are the *edge*
  curve's (top edges kept, every other edge from the corrupt run), so f(top |C|) is left empty there —
  and RelP;
- the share of the last position's attention on image tokens (`image_attention_share`, mean over
  the clean samples): a reading, not an intervention;
- HeadLens (fitted on the clean samples): CTER, the share of number tokens a head writes at the last
  position, and its count alignment, the share of samples whose top-1 decoded token is the count;
  its classes (`countlens.analysis.heads.classify_heads`, default thresholds, exact patching's effect
  as importance) as a 0 / 1 ranking — the heads classed cross-modal routing or counting aggregation first;
- a random ranking, as its expectation: AUROC 0.5, precision@|C| = |C| / 24.
Scored against the planted heads C (`countlens.circuits.graph.recovery`): AUROC and precision@|C|; and the
faithfulness f of the method's top |C| heads (every other head's z patched from the corrupt run,
`countlens.circuits.graph.faithfulness`) with the CPR / CMD of its whole curve over MIB's sizes.

VAP (`patch_layers`) patches the residual stream by layer and token group, so it ranks no heads; it
is shown as the route it measures: per layer, the effect of patching the image tokens, the other
text (where `<|vision_end|>` is) and the last position.

On an organism whose MLPs are nodes (``planted-mlp``: C = L0H2 and layer 0's MLP), the methods that
score MLPs are scored again over every node, heads and MLPs together (`node_recovery`, 30 nodes):
exact patching (heads' z, and each MLP's output patched from the corrupt run), EAP-IG on nodes
(``mlp_effect``), EAP and EAP-IG on edges (a node's outgoing edges); random: AUROC 0.5,
precision |C| / 30. Its head rows score against C's heads only.

On the top-half organism (``planted-top-half``, `countlens.toy.regions`: only objects in the top half
count), the ground truth is objects: 48 of its fresh scenes (seed 2), every object scored by exact
object effects (`countlens.circuits.objects.effects`: removed and background references, at the input)
and by AtP and EAP-IG per object (`countlens.circuits.object_attribution`, against the background),
against the objects it counts (`object_recovery`: AUROC of |score|, precision@|counted|, objects
pooled over scenes); random: AUROC 0.5, precision = the counted share.

On the edge organism (``planted-value-route``, `countlens.toy.edge_plant`: C is four edges, its nodes L0H2
and MLP1), the edge methods (EAP, EAP-IG on edges) are scored again over all 839 edges against the
planted edges E (`node_recovery` over edge labels: AUROC, precision@|E|), and the faithfulness of the
top |E| edges of each ranking — every other edge from the corrupt run — stands beside the planted set
E's own and a random set's (the mean of 5 draws). Its head rows score against L0H2, its node rows
(heads and MLPs) against L0H2 and MLP1.

These are countlens's own measurements on its own planted organisms: no paper's figures are
comparable. Writes bench/planted_recovery.json and prints the tables docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import xarray as xr

import countlens
from countlens.analysis.heads import classify_heads, constancy
from countlens.circuits import (
    HeadLens,
    image_attention_share,
    patch_layers,
)
from countlens.circuits.engine.interventions import Patch
from countlens.circuits.engine.run import effect
from countlens.circuits.graph.faithfulness import faithfulness, faithfulness_curves
from countlens.circuits.graph.recovery import auroc, node_recovery, object_recovery, precision_at
from countlens.circuits.methods.registry import METHODS, OBJECT_RANKERS, RANDOM_DRAWS, method
from countlens.circuits.objects.effects import object_effects
from countlens.circuits.sites import MlpOut, Residual
from countlens.datasets.pairs import count_pair
from countlens.labels import head_label
from countlens.model.shipped import SHIPPED_EDGES, SHIPPED_OBJECTS, SHIPPED_PLANTED
from countlens.toy.catalogue import planted_circuit_of, planted_edges_of
from countlens.toy.regions import top_half_sample
from countlens.toy.strictness import FRESH_SEED

OUT = Path(__file__).with_suffix(".json")
#: The HeadLens classes that move or aggregate the count: the heads a class-based reading would name.
COUNT_CLASSES = ("cross-modal routing", "counting aggregation")
#: The registry's exact head patching: the reference the other rankings are read beside.
EXACT = method("exact")
#: VAP's token groups, in the route's order.
VAP_GROUPS = ("image", "text", "last")


def headlens_rankings(vlm, samples, importance: xr.DataArray, attention: xr.DataArray) -> dict[str, xr.DataArray]:
    """HeadLens's CTER, count alignment and classes (which read ``importance`` and the image-attention
    share ``attention``, both over (layer, head))."""
    hl = HeadLens.fit(vlm, samples).decode(vlm, samples)
    top1 = hl.token_id.isel(k=0)
    alignment = (top1 == hl.count_token).where(hl.count_token >= 0).mean("sample")
    table = classify_heads(hl.vgs, hl.cter, attention, np.abs(importance), constancy(hl.token.isel(k=0)))
    classed = importance.copy(data=np.zeros(importance.shape))
    for _, row in table[table["class"].isin(COUNT_CLASSES)].iterrows():
        classed.loc[{"layer": row["layer"], "head": row["head"]}] = 1.0
    return {"HeadLens CTER": hl.cter, "HeadLens count alignment": alignment, "HeadLens classes": classed}


def rankings(vlm, pairs) -> tuple[dict[str, xr.DataArray], dict[str, xr.Dataset]]:
    """Head rankings by method — every registered method (`countlens.circuits.methods.registry.METHODS`) the
    organism supports, then the readings that are no attribution method — and the edge methods' results
    (for their edge curves)."""
    results = {m.label: (m, m.result(vlm, pairs)) for m in METHODS if m.supports(vlm)}
    out = {name: m.heads(vlm, result) for name, (m, result) in results.items()}
    clean = [p.clean for p in pairs]
    attention = image_attention_share(vlm, clean).mean("sample")
    out |= {"image-attention share": attention, **headlens_rankings(vlm, clean, out[EXACT.label], attention)}
    return out, {name: result for name, (m, result) in results.items() if m.level == "edge"}


def vap_route(vlm, pairs) -> dict[str, list]:
    """VAP's effect per layer (−1: the embeddings) for the image tokens, the other text and the last position."""
    effect = patch_layers(vlm, pairs, groups=VAP_GROUPS).effect
    return {
        "layers": effect.layer.values.tolist(),
        **{g: [round(float(v), 3) for v in effect.sel(group=g).values] for g in VAP_GROUPS},
    }


def node_rows(vlm, pairs, circuit, results: dict) -> dict:
    """Heads and MLPs ranked together by the methods that score MLPs, against C's heads and MLPs."""
    arch = vlm.arch
    members = {head_label(h) for h in circuit.heads} | {f"MLP{layer}" for layer in circuit.mlps}

    def heads_and(head_scores: xr.DataArray, mlp_scores) -> dict:
        out = {
            head_label((la, h)): float(head_scores.sel(layer=la, head=h))
            for la in range(arch.n_layers)
            for h in range(arch.heads(la))
        }
        return out | {f"MLP{la}": float(v) for la, v in enumerate(mlp_scores)}

    mlps = effect(vlm, pairs, {f"MLP{la}": [Patch(MlpOut(la))] for la in range(arch.n_layers)}).effect.values
    scored = {f"{EXACT.label} (heads + MLPs)": heads_and(results[EXACT.label], mlps)}
    ig_method = method("eap_ig")
    ig = ig_method.result(vlm, pairs)
    scored[f"{ig_method.label} (heads + MLPs)"] = heads_and(ig.effect, ig.mlp_effect.values)
    for name in (m.label for m in METHODS if m.level == "edge"):
        if name in results:
            by = dict(zip(results[name]["node"].values.tolist(), results[name].node_effect.values.tolist()))
            scored[f"{name} (heads + MLPs)"] = {k: by[k] for k in heads_and(results[EXACT.label], mlps)}
    rows = {name: node_recovery(scores, members) for name, scores in scored.items()}
    n_nodes = len(next(iter(scored.values())))
    rows["random (expected)"] = {"auroc": 0.5, "precision": round(len(members) / n_nodes, 3)}
    return {"circuit": sorted(members), "methods": rows}


def edge_rows(vlm, pairs, planted, edge_results: dict) -> dict:
    """The edge methods' rankings of every edge against the planted edges, and the faithfulness of each
    ranking's top |E| edges beside E's own and a random set's."""
    members = set(planted.edges)
    labels = [str(e) for e in next(iter(edge_results.values()))["edge"].values]
    k, n = len(members), len(labels)
    rankings = {**edge_results, "planted E": {label: float(label in members) for label in labels}}
    top = faithfulness_curves(vlm, pairs, rankings, sizes=((k + 0.5) / n,), level="edge", random_draws=RANDOM_DRAWS)
    f = {str(r): round(float(v), 3) for r, v in zip(top.ranking.values, top.faithfulness.isel(size=0).values)}
    rows = {}
    for name, result in edge_results.items():
        scores = dict(zip(map(str, result["edge"].values), map(float, result.effect.values)))
        rows[name] = {**node_recovery(scores, members), "f": f[name]}
    rows["planted E"] = {"auroc": 1.0, "precision": 1.0, "f": f["planted E"]}
    rows["random (expected)"] = {"auroc": 0.5, "precision": round(k / n, 4), "f": f["random"]}
    return {"circuit": sorted(members), "edges": n, "methods": rows}


def object_rows(vlm, n_scenes: int) -> dict:
    """Exact object effects and per-object AtP / EAP-IG against the objects the organism counts."""
    scenes = [top_half_sample(FRESH_SEED, i) for i in range(n_scenes)]
    scores, seconds = {}, {}
    for name, run in (
        ("exact (removed)", lambda: object_effects(vlm, scenes, "removed", Residual(-1)).effect),
        ("exact (background)", lambda: object_effects(vlm, scenes, "background", Residual(-1)).effect),
        *(
            (r.of.label, lambda r=r: r.result(vlm, scenes).score)
            for r in OBJECT_RANKERS
            if r.function == "object_attribution"
        ),
    ):
        start = time.time()
        scores[name] = run()
        seconds[name] = round(time.time() - start, 1)
    rows = {name: {**object_recovery(s, scenes), "seconds": seconds[name]} for name, s in scores.items()}
    counted = next(iter(rows.values()))
    share = counted["counted"] / (counted["counted"] + counted["ignored"])
    rows["random (expected)"] = {"auroc": 0.5, "precision": round(share, 3)}
    return {"scenes": n_scenes, "methods": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--scenes", type=int, default=48, help="the top-half organism's scenes")
    ap.add_argument(
        "--organisms",
        nargs="*",
        default=[f"planted-{c}" for c in SHIPPED_PLANTED + SHIPPED_OBJECTS + SHIPPED_EDGES],
    )
    ap.add_argument("--merge", action="store_true", help="update these organisms in the existing JSON, keep the others")
    args = ap.parse_args()
    result: dict = {"pairs": args.pairs, "organisms": {}}
    if args.merge and OUT.exists():
        result = json.loads(OUT.read_text())
        if result["pairs"] != args.pairs:
            raise SystemExit(f"--merge: {OUT} was made with --pairs {result['pairs']}; give the same")
    for name in args.organisms:
        if name.removeprefix("planted-") in SHIPPED_OBJECTS:
            start = time.time()
            result["organisms"][name] = {"objects": object_rows(countlens.load(name), args.scenes)}
            result["organisms"][name]["seconds"] = round(time.time() - start, 1)
            print(name, json.dumps(result["organisms"][name], indent=1), flush=True)
            continue
        circuit = planted_circuit_of(name)
        vlm = countlens.load(name)
        pairs = [count_pair(0, i, "shapes", prompt="short") for i in range(args.pairs)]
        start = time.time()
        ranks, edge_results = rankings(vlm, pairs)
        edge_curves = faithfulness_curves(vlm, pairs, edge_results, level="edge")
        n_heads = vlm.arch.n_layers * vlm.arch.n_heads
        k = len(circuit.heads)
        rows = {}
        for label, scores in ranks.items():
            row = {
                "auroc": round(auroc(scores, circuit.heads), 3),
                f"precision@{k}": round(precision_at(scores, circuit.heads), 3),
            }
            if label in edge_results:
                cpr, cmd = (float(edge_curves[m].sel(ranking=label)) for m in ("cpr", "cmd"))
                row |= {"cpr": round(cpr, 3), "cmd": round(cmd, 3)}
            else:
                curve = faithfulness(vlm, pairs, scores)
                top = faithfulness(vlm, pairs, scores, sizes=((k + 0.5) / n_heads,))
                row |= {
                    f"f(top {k})": round(float(top.faithfulness.item()), 3),
                    "cpr": round(curve.attrs["cpr"], 3),
                    "cmd": round(curve.attrs["cmd"], 3),
                }
            rows[label] = row
        rows["random (expected)"] = {"auroc": 0.5, f"precision@{k}": round(k / n_heads, 3)}
        result["organisms"][name] = {
            "circuit": sorted(circuit.heads),
            "methods": rows,
            "vap": vap_route(vlm, pairs),
        }
        if circuit.mlp_nodes:
            result["organisms"][name]["nodes"] = node_rows(vlm, pairs, circuit, {**ranks, **edge_results})
        if planted_edges_of(name) is not None:
            result["organisms"][name]["edges"] = edge_rows(vlm, pairs, planted_edges_of(name), edge_results)
        result["organisms"][name]["seconds"] = round(time.time() - start, 1)
        print(name, json.dumps(rows, indent=1), flush=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


def table(result: dict) -> str:
    lines = []
    for name, r in result["organisms"].items():
        if "objects" in r:
            lines += [
                f"\n{name}: objects ({r['objects']['scenes']} fresh scenes; C = the objects in the top half)\n",
                "| method | AUROC | precision@counted | mean abs score, counted | mean abs score, ignored | s |",
                "|---|---|---|---|---|---|",
            ]
            for method, row in r["objects"]["methods"].items():
                cells = [
                    row.get(c, "") for c in ("auroc", "precision", "counted_mean_abs", "ignored_mean_abs", "seconds")
                ]
                lines.append(f"| {method} | " + " | ".join(str(c) for c in cells) + " |")
            continue
        k = len(r["circuit"])
        lines += [
            f"\n{name} (C = {', '.join(f'L{a}H{b}' for a, b in r['circuit'])})\n",
            f"| method | AUROC | precision@{k} | f(top {k}) | CPR | CMD |",
            "|---|---|---|---|---|---|",
        ]
        for method, row in r["methods"].items():
            cells = [row.get(c, "") for c in ("auroc", f"precision@{k}", f"f(top {k})", "cpr", "cmd")]
            lines.append(f"| {method} | " + " | ".join(str(c) for c in cells) + " |")
        if "nodes" in r:
            nodes = r["nodes"]
            lines += [
                f"\n{name}, heads and MLPs ranked together (C = {', '.join(nodes['circuit'])})\n",
                f"| method | AUROC | precision@{len(nodes['circuit'])} |",
                "|---|---|---|",
                *(f"| {m} | {row['auroc']} | {row['precision']} |" for m, row in nodes["methods"].items()),
            ]
        if "edges" in r:
            e = r["edges"]
            k = len(e["circuit"])
            lines += [
                f"\n{name}, edges ranked ({e['edges']} edges; E = {', '.join(e['circuit'])})\n",
                f"| method | AUROC | precision@{k} | f(top {k} edges) |",
                "|---|---|---|---|",
                *(f"| {m} | {row['auroc']} | {row['precision']} | {row['f']} |" for m, row in e["methods"].items()),
            ]
        vap = r["vap"]
        lines += [
            f"\nVAP on {name}: effect of patching the residual stream after each layer (−1: the embeddings)\n",
            "| group | " + " | ".join(str(layer) for layer in vap["layers"]) + " |",
            "|---|" + "---|" * len(vap["layers"]),
            *(f"| {g} | " + " | ".join(f"{v:.2f}" for v in vap[g]) + " |" for g in VAP_GROUPS),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
