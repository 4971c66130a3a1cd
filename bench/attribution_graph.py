"""Attribution graphs of the organism, and whether they explain the real model.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/attribution_graph.py [--transcoders FOLDER]
    # writes bench/attribution_graph_{3,5}.json (viewer JSON) and bench/attribution_graph.json

Transcoders: `train_transcoders(vlm)` with its defaults, or the circuit-tracer set in ``--transcoders``.
Scenes: the first sample of each count 2–9 of ``task_samples("count", 64, seed=0)``. It reports

- per scene 3 and 5: nodes and edges of the graph and of ``prune(graph)`` (0.8, 0.98), the graph's
  wall time and the process's peak resident memory, the logit-sum residual (max |demeaned logit − Σ
  edges − constant| over logit nodes), circuit-tracer's graph scores (`graph_scores`), the top 5
  features by influence;
- **the real-model validation** over 8 scenes × the 20 most influential features = 160 (scene,
  feature) pairs (`feature_effects`): the graph's predicted change of the answer's demeaned logit
  against the real model's, when the feature is removed and when it is steered (× 2), each edited
  inside the real forward with its error term held (`countlens.features.interventions`): Spearman ρ
  over all pairs and per scene, and the share of matching signs;
- **the wrong sign** (``wrong_sign``): in the 3-object scene, the feature the graph says most promotes
  the answer, steered ×2 and ×0 (removed) in the real model with each of the graph's simplifications
  put back in turn — attention patterns frozen at the clean run, norm scales frozen, every MLP's error
  term frozen at the clean run, all three — and with small steps (×1.1 / ×0.9, per unit of
  factor) for the saturation of the answer's logit. The variant whose change has the graph's sign
  names the cause.

One torch thread (the CPUs are shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

import countlens
from countlens.circuits import intervene
from countlens.circuits.engine.freeze import frozen
from countlens.circuits.engine.interventions import Replace
from countlens.circuits.sites import MlpIn, MlpOut
from countlens.circuits.sites.positions import Mask
from countlens.datasets.tasks import task_samples
from countlens.features import (
    attribution_graph,
    feature_effects,
    graph_scores,
    load_transcoders,
    node_influence,
    prune,
    removal_effects,
    save_graph,
    steer_feature,
    train_transcoders,
)
from countlens.features.effects import agreement
from countlens.features.graph import LocalReplacement

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import Load  # noqa: E402

TOP = 20
COUNTS = range(2, 10)
FACTOR = 2.0


def _r(x: float, n: int = 4) -> float:
    return round(float(x), n)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary(vlm, graph, seconds: float, count: int) -> dict:
    """The graph's size, time, residual, scores and top features (scenes 3 and 5)."""
    pruned = prune(graph)
    save_graph(pruned, HERE / f"attribution_graph_{count}.json", slug=f"toy-count-{count}")
    m = graph.start("logit")
    residual = (graph.values[m:] - graph.adjacency[m:].sum(1) - graph.constant[m:]).abs().max()
    infl = node_influence(graph)[: graph.n_features]
    top5 = []
    for j in infl.sort(descending=True).indices[:5].tolist():
        lj, pj, fj = graph.features[j].tolist()
        top5.append(
            {
                "layer": lj,
                "position": pj,
                "feature": fj,
                "activation": _r(graph.activations[j]),
                "influence": _r(infl[j], 5),
                "token": graph.token_strings[pj],
                "image_token": bool(graph.cells[pj, 0] >= 0),
            }
        )
    scores = graph_scores(graph)
    return {
        "tokens": len(graph.tokens),
        "logits": {s: _r(p) for s, p in zip(graph.logit_strings, graph.logit_probs.tolist())},
        "nodes": {"graph": graph.n_nodes, "pruned": pruned.n_nodes},
        "features": {"graph": graph.n_features, "pruned": pruned.n_features},
        "edges": {"graph": graph.n_edges, "pruned": pruned.n_edges},
        "graph_seconds": _r(seconds, 2),
        "peak_rss_mb_after_graph": round(_peak_mb()),
        "logit_sum_residual": float(f"{float(residual):.3g}"),
        "scores": {k: _r(v) for k, v in scores.items()},
        "top5": top5,
    }


def one_position(sample, seq: int, pos: int) -> Mask:
    where = torch.zeros(1, seq, dtype=torch.bool)
    where[0, pos] = True
    return Mask(where, samples=[sample])


@torch.no_grad()
def demeaned(vlm, sample, target: int, edits=(), freeze=None) -> float:
    """The target's demeaned logit at the last position, with ``edits`` (engine interventions) and
    ``freeze`` (keywords of `frozen`) on."""
    batch = vlm.prepare_samples([sample])
    with intervene(vlm, list(edits)) if edits else nullcontext(), frozen(vlm, **(freeze or {})):
        logits = vlm.forward(batch).logits[0, -1].float()
    return float(logits[target] - logits.mean())


def errors_frozen(lr: LocalReplacement, tcs, edit: tuple[int, int, int, float] | None) -> list[Replace]:
    """Every MLP as its transcoder plus the clean run's error term (the graph holds the errors), feature
    ``edit`` = (layer, position, feature, factor) steered: one `Replace` per layer over every position
    of the one-sample forward."""

    def layer_fn(layer):
        tc, error = tcs.layer(layer), lr.error[layer][0]

        def fn(x):
            if len(x) != len(error):  # the engine's probe on random rows before the forward
                return tc(x.to(tc.dtype)).to(x.dtype)
            a = tc.encode(x.to(tc.dtype))
            if edit is not None and edit[0] == layer:
                a[edit[1], edit[2]] *= edit[3]
            return (tc.decode(a, x.to(tc.dtype)) + error).to(x.dtype)

        return fn

    return [Replace(MlpOut(layer), layer_fn(layer), reads=MlpIn(layer)) for layer in tcs.layers]


def wrong_sign(vlm, tcs, sample, graph, node: int | None = None) -> dict:
    """Steering feature node ``node`` (default: the most answer-promoting) with each of the graph's
    simplifications put back."""
    target = int(graph.logit_tokens[0])
    effects = removal_effects(graph, target)
    best = int(effects.argmin()) if node is None else node
    layer, pos, f = (int(v) for v in graph.features[best])
    act = float(graph.activations[best])
    lr = LocalReplacement(vlm, tcs, sample)
    at = one_position(sample, len(graph.tokens), pos)
    freezes = {
        "real model": {},
        "attention frozen": {"attention": lr.clamp},
        "norms frozen": {"norms": lr.clamp},
        "attention and norms frozen": {"attention": lr.clamp, "norms": lr.clamp},
        "final norm frozen": {"norms": lr.clamp.only([vlm.arch.final_norm])},
        "layers' norms frozen": {"norms": lr.clamp.only([p for p in lr.clamp.scales if p != vlm.arch.final_norm])},
    }
    rows = {}
    for name, freeze in freezes.items():
        base = demeaned(vlm, sample, target, freeze=freeze)
        rows[name] = {
            f"x{factor:g}": _r(demeaned(vlm, sample, target, [steer_feature(tcs, layer, f, factor, at)], freeze) - base)
            for factor in (FACTOR, 0.0)
        }
    both = {"attention": lr.clamp, "norms": lr.clamp}
    for name, freeze in (("errors frozen", {}), ("attention, norms and errors frozen", both)):
        base = demeaned(vlm, sample, target, errors_frozen(lr, tcs, None), freeze)
        rows[name] = {
            f"x{factor:g}": _r(
                demeaned(vlm, sample, target, errors_frozen(lr, tcs, (layer, pos, f, factor)), freeze) - base
            )
            for factor in (FACTOR, 0.0)
        }
    base = demeaned(vlm, sample, target)
    step = {
        f"x{factor:g}": _r((demeaned(vlm, sample, target, [steer_feature(tcs, layer, f, factor, at)]) - base) / 0.1)
        for factor in (1.1, 0.9)
    }
    graph_move = {f"x{FACTOR:g}": _r(-(FACTOR - 1) * float(effects[best])), "x0": _r(float(effects[best]))}
    return {
        "feature": {"layer": layer, "position": pos, "feature": f, "activation": _r(act)},
        "target": vlm.token_strings([target])[0],
        "target_value": _r(float(graph.values[graph.logit_node(target)])),
        "graph": graph_move,
        "steered": rows,
        "small_steps_per_unit": step,
        "graph_per_unit": {"x1.1": _r(-float(effects[best])), "x0.9": _r(float(effects[best]))},
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transcoders", help="a circuit-tracer transcoder folder (default: train with defaults)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    with Load() as load:
        start = time.perf_counter()
        if args.transcoders:
            tcs, source = load_transcoders(args.transcoders, vlm), args.transcoders
        else:
            tcs, source = train_transcoders(vlm, progress=False).transcoders, "train_transcoders(vlm) defaults"
        train_seconds = time.perf_counter() - start
        samples = task_samples("count", 64, seed=0)
        scenes, pairs, per_scene = {}, [], {}
        for count in COUNTS:
            sample = next(s for s in samples if s.meta["count"] == count)
            start = time.perf_counter()
            graph = attribution_graph(vlm, tcs, sample)
            seconds = time.perf_counter() - start
            if count in (3, 5):
                scenes[str(count)] = summary(vlm, graph, seconds, count)
            if count == 3:
                scenes["3"]["wrong_sign"] = wrong_sign(vlm, tcs, sample, graph)
            ds = feature_effects(vlm, tcs, graph, sample, features=TOP, factor=FACTOR)
            pairs.append(ds)
            per_scene[str(count)] = {
                "answer": sample.answer,
                "image_token_features": int((graph.cells[ds["position"].values, 0] >= 0).sum()),
                "target": ds.attrs["target_string"],
                "removal_spearman": _r(ds.attrs["removal_spearman"]),
                "removal_same_sign": _r(ds.attrs["removal_same_sign"]),
                "steer_spearman": _r(ds.attrs["steer_spearman"]),
                "steer_same_sign": _r(ds.attrs["steer_same_sign"]),
            }
    cat = {v: np.concatenate([ds[v].values for ds in pairs]) for v in pairs[0].data_vars}
    removal_rho, removal_same = agreement(cat["removal_graph"], cat["removal_real"])
    steer_rho, steer_same = agreement(cat["steer_graph"], cat["steer_real"])
    ratio = np.abs(cat["removal_real"]).sum() / np.abs(cat["removal_graph"]).sum()
    return {
        "model": "toy",
        "threads": 1,
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python bench/attribution_graph.py",
        "transcoders": source,
        "scan": tcs.scan,
        "transcoder_seconds": _r(train_seconds, 1),
        "validation": {
            "pairs": len(cat["removal_real"]),
            "scenes": len(pairs),
            "features_per_scene": TOP,
            "steer_factor": FACTOR,
            "removal": {"spearman": _r(removal_rho), "same_sign": _r(removal_same)},
            "steering": {"spearman": _r(steer_rho), "same_sign": _r(steer_same)},
            "real_over_graph_magnitude": _r(ratio),
            "image_token_features": sum(row["image_token_features"] for row in per_scene.values()),
            "per_scene": per_scene,
        },
        "scenes": scenes,
        "others_load_cores": load.others,
    }


if __name__ == "__main__":
    result = main()
    (HERE / "attribution_graph.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
