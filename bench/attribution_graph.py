"""Attribution graphs of the organism: one 3-object and one 5-object counting scene, with the checks
that go beyond the graph's exact identities.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/attribution_graph.py [--transcoders FOLDER]
    # writes bench/attribution_graph_{3,5}.json (viewer JSON) and bench/attribution_graph.json

Transcoders: `train_transcoders(vlm)` with its defaults (every layer, width 512, k 16, 1500 steps,
seed 0), or the circuit-tracer set in ``--transcoders``. Scenes: the first samples of
``task_samples("count", 64, seed=0)`` whose count is 3 and 5. Per scene it reports

- nodes and edges of the graph and of ``prune(graph)`` (0.8, 0.98), the graph's wall time and the
  process's peak resident memory (``resource.getrusage``; the model's and training's included);
- the **logit-sum residual**: max |demeaned logit − Σ edges − constant| over logit nodes (and the
  largest |constant|, the biases' share);
- **check (i)**: over the 20 features of largest node influence, the graph's predicted change of the
  target logit's demeaned value when each is removed (`removal_effects`: direct and indirect) against
  the real change when it is zero-ablated in the replacement model with the clean error terms added
  (live attention, live norms, every other feature recomputed), Spearman ρ;
- **check (ii)** steering: the feature whose removal the graph says lowers the answer's logit most
  gets ``α × W_dec[f]`` added at its position to the real model's MLP output (α = ± its activation);
  does the answer's demeaned logit move the way the graph says (and by how much);
- the top 5 features by influence: layer, position, feature, activation, image token or not, object.

One torch thread (the CPUs are shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from scipy.stats import spearmanr

import countlens
from countlens.datasets.tasks import task_samples
from countlens.features import (
    attribution_graph,
    load_transcoders,
    node_influence,
    prune,
    removal_effects,
    save_graph,
    train_transcoders,
)
from countlens.features.graph import LocalReplacement

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import Load  # noqa: E402

TOP = 20


def _r(x: float, n: int = 4) -> float:
    return round(float(x), n)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def demeaned_logit(vlm, sample, token: int, hooks) -> float:
    """The demeaned logit of ``token`` at the last position with ``hooks`` ((module path, hook)) on."""
    handles = [vlm.hf.get_submodule(path).register_forward_hook(h, with_kwargs=True) for path, h in hooks]
    try:
        logits = vlm.forward(vlm.prepare_samples([sample])).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()
    return float(logits[token] - logits.mean())


def replacement_hooks(vlm, tcs, lr: LocalReplacement, ablate: tuple[int, int, int] | None):
    """The replacement model with the clean error terms (live attention and norms), feature
    ``ablate`` = (layer, position, feature) zeroed."""

    def hook(layer):
        tc = tcs.layer(layer)

        def swap(module, args, kwargs, output):
            x = (args[0] if args else next(iter(kwargs.values()))).to(tc.dtype)
            a = tc.encode(x)
            if ablate is not None and ablate[0] == layer:
                a[:, ablate[1], ablate[2]] = 0
            return (tc.decode(a, x) + lr.error[layer]).to(output.dtype)

        return swap

    return [(vlm.arch.mlp(layer), hook(layer)) for layer in tcs.layers]


def steer_hook(vlm, tcs, layer: int, pos: int, f: int, alpha: float):
    vector = alpha * tcs.layer(layer).W_dec[f].detach()

    def add(module, args, kwargs, output):
        output = output.clone()
        output[:, pos] += vector.to(output.dtype)
        return output

    return [(vlm.arch.mlp(layer), add)]


def scene(vlm, tcs, sample, count: int) -> dict:
    start = time.perf_counter()
    graph = attribution_graph(vlm, tcs, sample)
    seconds = time.perf_counter() - start
    peak = _peak_mb()
    pruned = prune(graph)
    save_graph(pruned, HERE / f"attribution_graph_{count}.json", slug=f"toy-count-{count}")

    m = graph.start("logit")
    residual = (graph.values[m:] - graph.adjacency[m:].sum(1) - graph.constant[m:]).abs().max()
    answer = graph.answer_token
    target = answer if answer in graph.logit_tokens.tolist() else int(graph.logit_tokens[0])
    target_node = graph.logit_node(target)

    # Check (i): predicted vs real removal effects over the top-20 features by influence.
    infl = node_influence(graph)[: graph.n_features]
    top = infl.topk(min(TOP, graph.n_features)).indices
    predicted = removal_effects(graph, target)[top]
    lr = LocalReplacement(vlm, tcs, sample)
    base = demeaned_logit(vlm, sample, target, replacement_hooks(vlm, tcs, lr, None))
    clean_value = float(graph.values[target_node])
    real = [
        demeaned_logit(vlm, sample, target, replacement_hooks(vlm, tcs, lr, tuple(graph.features[j].tolist()))) - base
        for j in top.tolist()
    ]
    rho = spearmanr(predicted.numpy(), real).statistic

    # Check (ii): steer the real model with the feature the graph says most promotes the answer.
    effects = removal_effects(graph, target)
    best = int(effects.argmin())  # removal lowers the target logit most: it promotes it most
    layer, pos, f = graph.features[best].tolist()
    act = float(graph.activations[best])
    clean = demeaned_logit(vlm, sample, target, [])
    steering = {}
    for name, alpha in (("plus_activation", act), ("minus_activation", -act)):
        moved = demeaned_logit(vlm, sample, target, steer_hook(vlm, tcs, layer, pos, f, alpha)) - clean
        predicted_move = -float(effects[best]) * alpha / act
        steering[name] = {
            "alpha": _r(alpha),
            "real_change": _r(moved),
            "graph_change": _r(predicted_move),
            "same_sign": bool(moved * predicted_move > 0),
        }

    order = infl.sort(descending=True).indices[:5]
    top5 = []
    for j in order.tolist():
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
                "cell": graph.cells[pj].tolist(),
                "object": int(graph.objects[pj]),
            }
        )
    return {
        "count": count,
        "question": sample.question,
        "answer": sample.answer,
        "objects": len(sample.scene.objects),
        "tokens": len(graph.tokens),
        "logits": {s: _r(p) for s, p in zip(graph.logit_strings, graph.logit_probs.tolist())},
        "target_logit": vlm.token_strings([target])[0],
        "target_is_answer": target == answer,
        "nodes": {"graph": graph.n_nodes, "pruned": pruned.n_nodes},
        "features": {"graph": graph.n_features, "pruned": pruned.n_features},
        "edges": {"graph": graph.n_edges, "pruned": pruned.n_edges},
        "graph_seconds": _r(seconds, 2),
        "peak_rss_mb_after_graph": round(peak),
        "adjacency_mb": _r(graph.adjacency.numel() * 4 / 2**20, 1),
        "logit_sum_residual": float(f"{float(residual):.3g}"),
        "largest_logit_constant": _r(graph.constant[m:].abs().max()),
        "largest_logit_value": _r(graph.values[m:].abs().max()),
        "check_i": {
            "features": len(top),
            "spearman_rho": _r(rho),
            "clean_target_value": _r(clean_value),
            "replacement_target_value": _r(base),
            "predicted": [_r(x) for x in predicted.tolist()],
            "real": [_r(x) for x in real],
        },
        "check_ii": {"feature": {"layer": layer, "position": pos, "feature": f, "activation": _r(act)}, **steering},
        "top5": top5,
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
        scenes = {}
        for count in (3, 5):
            sample = next(s for s in samples if s.meta["count"] == count)
            scenes[str(count)] = scene(vlm, tcs, sample, count)
    return {
        "model": "toy",
        "threads": 1,
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python bench/attribution_graph.py",
        "transcoders": source,
        "scan": tcs.scan,
        "transcoder_seconds": _r(train_seconds, 1),
        "scenes": scenes,
        "others_load_cores": load.others,
    }


if __name__ == "__main__":
    result = main()
    (HERE / "attribution_graph.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
