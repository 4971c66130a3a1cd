"""Ground truth for features: does a transcoder recover the planted feature, and does the attribution graph
route the answer through it?

    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_feature.py               # train_transcoders' defaults
    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_feature.py --steps 500   # shorter transcoder training

The organism ``planted-count-ge-5`` (`countlens.toy.feature_plant`): hidden unit ``unit`` of layer ``layer``'s
MLP computes h = [count ≥ 5] at the last token, and the answer reads h from it alone. Transcoders are trained
on it (`train_transcoders`, its defaults but ``--steps``; written under ``--cache`` and reused while the
organism's weights are the same). Then, on fresh scenes (``count_pair(SEED, …, "shapes", prompt="short")``,
seed `SEED`: neither training's ≥ 1000, nor the checks' 2, nor the transcoders' 7000 +):

(a) **Recovery.** Over ``--n-pairs`` pairs' cleans and corrupts, layer ``layer``'s MLP input at every
    position, encoded by that layer's transcoder. The **best-matching feature** is the one whose activation
    has the largest Pearson correlation with the planted unit's value over every position of every scene
    (countlens's choice of matching rule). Reported: that correlation, the same at the last token only, its
    point-biserial correlation and AUROC with h at the last token, the cosine of its decoder row with the
    unit's write direction (the down projection's column), its activation's share of the scenes where it
    fires; and the next-best feature's correlation. In-sample: the feature is picked and scored on the same
    scenes.
(b) **The graph.** One attribution graph (`attribution_graph`, every active feature a node) per count 1–9
    (the clean scene of ``count_pair(SEED, c, clean=c, corrupt=c ± 1)``): whether the best-matching feature
    is a node at (layer, last position), its rank among the graph's feature nodes by `node_influence`
    (1 = most influential), the same among the features of its layer and among those at the last position,
    and whether `prune(graph)` (0.8, 0.98) keeps it; the top logit's change when it is removed, as the graph
    predicts it (`removal_effects`, and its rank among the features by that drop) and in the real model
    (`feature_effects`). Where c ≥ 5, the same removal in the real model with each of the graph's
    simplifications put back (attention, norm scales, the MLPs' error terms frozen at the clean run;
    ``wrong_sign`` of bench/attribution_graph.py): which one makes the real model move as the graph says.
(c) **The real model.** The best-matching feature edited at the last token inside the real forward (error
    term held; `remove_feature` where c ≥ 5, `clamp_feature` to its mean activation over c ≥ 5 where c < 5),
    on the scenes of (a): how often the answer becomes (c mod 5) + 5·(1 − h), as the planted unit's
    interchange does, and how often it stays c.

Writes bench/planted_feature.json and prints the markdown table of docs/concepts/attribution_graphs.md,
"Ground truth for features".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import countlens
from countlens.datasets.pairs import count_pair
from countlens.features import (
    attribution_graph,
    feature_effects,
    node_influence,
    prune,
    removal_effects,
    train_transcoders,
)
from countlens.toy.catalogue import planted_feature_of
from countlens.toy.feature_plant import auroc_of, correlation, down_proj
from countlens.toy.planter import pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.train import Collator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attribution_graph import wrong_sign  # noqa: E402

NAME = "planted-count-ge-5"
#: The fresh scenes' seed.
SEED = 5


def cache_name(steps: int | None) -> str:
    """The transcoders' folder: the organism's weights' digest (a re-planted organism trains its own) and steps."""
    import hashlib

    from countlens.model.shipped import ORGANISMS

    digest = hashlib.sha256((ORGANISMS[NAME] / "model.safetensors").read_bytes()).hexdigest()[:12]
    return f"{NAME}-{digest}-steps{steps or 'default'}"


@torch.no_grad()
def layer_activations(vlm, feature, n_pairs: int) -> dict[str, torch.Tensor]:
    """(scenes, positions) the unit's value, (scenes, positions, d_model) the MLP's input, (scenes,) h."""
    hf = vlm.hf.float().eval()
    collate = Collator(ToyConfig())
    mlp = hf.model.language_model.layers[feature.layer].mlp
    xs, units, hs = [], [], []
    ids = collate.tok.convert_tokens_to_ids([str(i) for i in range(10)])
    count_of = {t: i for i, t in enumerate(ids)}
    for start in range(0, n_pairs, 32):
        inputs, answers, _ = pair_batch(collate, pairs_at(SEED, start, min(32, n_pairs - start)))
        got = {}
        h1 = mlp.register_forward_pre_hook(lambda m, a: got.__setitem__("x", a[0]))
        h2 = hf.get_submodule(down_proj(hf, feature.layer)).register_forward_pre_hook(
            lambda m, a: got.__setitem__("u", a[0][..., feature.unit])
        )
        try:
            hf(**inputs, logits_to_keep=1)
        finally:
            h1.remove()
            h2.remove()
        xs.append(got["x"])
        units.append(got["u"])
        hs.append(feature.h(torch.tensor([count_of[int(a)] for a in answers])))
    return {"x": torch.cat(xs), "unit": torch.cat(units), "h": torch.cat(hs)}


def recovery(tc, acts: dict, feature, w_down: torch.Tensor) -> dict:
    """(a): the best-matching feature of ``tc`` against the planted unit (module docstring)."""
    a = tc.encode(acts["x"].to(tc.dtype)).float().detach()  # (scenes, positions, width)
    flat, unit = a.reshape(-1, a.shape[-1]), acts["unit"].reshape(-1)
    f_c = flat - flat.mean(0)
    u_c = unit - unit.mean()
    cors = (f_c * u_c[:, None]).sum(0) / (f_c.norm(dim=0) * u_c.norm()).clamp_min(1e-30)
    order = cors.nan_to_num(-2).argsort(descending=True)
    best = int(order[0])
    last, h = a[:, -1, best], acts["h"]
    w_dec = tc.W_dec[best].detach().float()  # (d_transcoder, d_model): row i is feature i's write
    direction = w_down[:, feature.unit].float()
    cosine = float(torch.nn.functional.cosine_similarity(w_dec, direction, 0))
    return {
        "feature": best,
        "corr_unit_all_positions": round(float(cors[best]), 4),
        "corr_unit_last_token": round(correlation(last, acts["unit"][:, -1]), 4),
        "point_biserial_h_last_token": round(correlation(last, h), 4),
        "auroc_h_last_token": round(auroc_of(last, h), 4),
        "decoder_cosine_with_unit_direction": round(cosine, 4),
        "mean_activation_last_token_h1": round(float(last[h > 0.5].mean()), 4),
        "fires_share_last_token_h1": round(float((last[h > 0.5] > 0).float().mean()), 4),
        "fires_share_last_token_h0": round(float((last[h <= 0.5] > 0).float().mean()), 4),
        "fires_share_other_positions": round(float((a[:, :-1, best] > 0).float().mean()), 4),
        "next_best": {"feature": int(order[1]), "corr_unit_all_positions": round(float(cors[order[1]]), 4)},
        "unit_point_biserial_h_last_token": round(correlation(acts["unit"][:, -1], h), 4),
        "n_scenes": int(a.shape[0]),
        "n_positions": int(flat.shape[0]),
    }


def real_model(vlm, tcs, feature, rec: dict, n_pairs: int) -> dict:
    """(c): the best-matching feature edited at the last token inside the real model (error term held,
    `countlens.features.interventions`), on the scenes of (a): removed where c ≥ 5, and clamped to its mean
    activation there where c < 5. Reported: how often the answer becomes the high-level model's answer with
    h flipped, (c mod 5) + 5·(1 − h), and how often it stays c."""
    from countlens.analysis.evaluate import score
    from countlens.circuits import intervene
    from countlens.features import clamp_feature, remove_feature

    scenes = [s for p in pairs_at(SEED, 0, n_pairs) for s in (p.clean, p.corrupt)]
    best, layer, out = rec["feature"], feature.layer, {}
    edits = {
        "removed_where_h1": (1, remove_feature(tcs, layer, best, positions="last")),
        "clamped_where_h0": (0, clamp_feature(tcs, layer, best, rec["mean_activation_last_token_h1"], "last")),
    }
    for key, (h, edit) in edits.items():
        chosen = [s for s in scenes if (int(s.answer) >= feature.threshold) == bool(h)]
        with intervene(vlm, [edit]):
            pred = score(vlm, chosen, method="token")["pred_count"].values
        counts = torch.tensor([int(s.answer) for s in chosen])
        flipped = feature.answer(counts, torch.full_like(counts, 1 - h)).numpy()
        out[key] = {
            "n": len(chosen),
            "follows_flipped_h": round(float((pred == flipped).mean()), 4),
            "unchanged": round(float((pred == counts.numpy()).mean()), 4),
        }
    return out


def graph_rows(vlm, tcs, feature, best: int) -> list[dict]:
    """(b): per count 1–9, the best-matching feature in the clean scene's graph (module docstring)."""
    rows = []
    for c in range(1, 10):
        sample = count_pair(SEED, c, "shapes", clean=c, corrupt=c - 1 if c > 1 else 2, prompt="short").clean
        t = time.perf_counter()
        graph = attribution_graph(vlm, tcs, sample)
        seconds = time.perf_counter() - t
        feats = graph.features
        where = ((feats[:, 0] == feature.layer) & (feats[:, 1] == graph.last) & (feats[:, 2] == best)).nonzero()
        row = {
            "count": c,
            "h": int(c >= feature.threshold),
            "top_logit": graph.logit_strings[0] if graph.logit_strings else None,
            "n_feature_nodes": graph.n_features,
            "active": bool(len(where)),
            "graph_s": round(seconds, 1),
        }
        if len(where):
            node = int(where[0, 0])
            scores = node_influence(graph)[: graph.n_features]
            pruned = prune(graph)
            drops = removal_effects(graph)
            effects = feature_effects(vlm, tcs, graph, sample, features=[node])
            kept = pruned.features
            row |= {
                "activation": round(float(graph.activations[node]), 4),
                "rank_by_influence": int((scores > scores[node]).sum()) + 1,
                "rank_in_layer": int((scores[feats[:, 0] == feature.layer] > scores[node]).sum()) + 1,
                "n_in_layer": int((feats[:, 0] == feature.layer).sum()),
                "rank_at_last_position": int((scores[feats[:, 1] == graph.last] > scores[node]).sum()) + 1,
                "n_at_last_position": int((feats[:, 1] == graph.last).sum()),
                "influence_share": round(float(scores[node] / scores.sum().clamp_min(1e-30)), 4),
                "in_pruned": bool(((kept == feats[node]).all(1)).any()),
                # the top logit's predicted drop when the feature is removed, its rank among features (largest
                # drop first), and the real model's change (`feature_effects`: the feature removed, error held)
                "removal_graph": round(float(drops[node]), 4),
                "rank_by_removal": int((drops < drops[node]).sum()) + 1,
                "removal_real": round(float(effects["removal_real"].values[0]), 4),
                "n_pruned_features": int(pruned.n_features),
            }
            if row["h"]:  # what the graph leaves out, put back one simplification at a time (removal: ×0)
                why = wrong_sign(vlm, tcs, sample, graph, node)
                row["removal_with_simplifications"] = {name: moved["x0"] for name, moved in why["steered"].items()}
        rows.append(row)
    return rows


def table(result: dict) -> str:
    r = result["recovery"]
    out = [
        "| | value |",
        "|---|---|",
        f"| best-matching feature (layer {result['layer']}) | {r['feature']} |",
        f"| corr. with the planted unit, every position ({r['n_positions']:,} positions of {r['n_scenes']} scenes) "
        f"| {r['corr_unit_all_positions']:.3f} (next best feature {r['next_best']['corr_unit_all_positions']:.3f}) |",
        f"| corr. with the planted unit, last token | {r['corr_unit_last_token']:.3f} |",
        f"| point-biserial with [count ≥ 5], last token (the unit's own) | {r['point_biserial_h_last_token']:.3f} "
        f"({r['unit_point_biserial_h_last_token']:.3f}) |",
        f"| AUROC for [count ≥ 5], last token | {r['auroc_h_last_token']:.3f} |",
        f"| cosine of its decoder row with the unit's write direction "
        f"| {r['decoder_cosine_with_unit_direction']:.3f} |",
        f"| fires at the last token: count ≥ 5 / count < 5; elsewhere | {r['fires_share_last_token_h1']:.2f} / "
        f"{r['fires_share_last_token_h0']:.2f}; {r['fires_share_other_positions']:.3f} |",
    ]
    for key, what in (("removed_where_h1", "removed where c ≥ 5"), ("clamped_where_h0", "clamped on where c < 5")):
        e = result["real_model"][key]
        out.append(
            f"| real model, the feature {what} (last token): answer follows the flipped h / unchanged "
            f"| {e['follows_flipped_h']:.3f} / {e['unchanged']:.3f} (n = {e['n']}) |"
        )
    out += ["", "| count | top logit | feature active (activation) | rank by influence: of all features / of "]
    out[-1] += f"layer {result['layer']}'s / of the last position's | in `prune(graph)` | removed: top logit's "
    out[-1] += "change, graph (rank) / real |"
    out += ["|---|---|---|---|---|---|"]
    for g in result["graphs"]:
        if not g["active"]:
            out.append(f"| {g['count']} | {g['top_logit']} | no | — | — | — |")
            continue
        rank = (
            f"{g['rank_by_influence']} of {g['n_feature_nodes']:,} / {g['rank_in_layer']} of {g['n_in_layer']:,} / "
            f"{g['rank_at_last_position']} of {g['n_at_last_position']}"
        )
        kept = f"{'yes' if g['in_pruned'] else 'no'} ({g['n_pruned_features']} features kept)"
        removal = f"{g['removal_graph']:+.2f} (rank {g['rank_by_removal']}) / {g['removal_real']:+.2f}"
        out.append(f"| {g['count']} | {g['top_logit']} | yes ({g['activation']:.1f}) | {rank} | {kept} | {removal} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="transcoder steps (default: train_transcoders')")
    parser.add_argument("--n-pairs", type=int, default=128, help="pairs for (a): twice as many scenes")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/countlens-planted-feature"))
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    vlm = countlens.load(NAME)
    feature = planted_feature_of(NAME)
    kw = {} if args.steps is None else {"steps": args.steps}
    start = time.perf_counter()
    folder = args.cache / cache_name(args.steps)
    cached = (folder / "transcoders").is_dir()  # a finished run there: loaded, not trained
    training = train_transcoders(vlm, out=folder, progress=False, **kw)
    train_s = time.perf_counter() - start
    tcs = training.transcoders
    fid = training.fidelity
    acts = layer_activations(vlm, feature, args.n_pairs)
    w_down = vlm.hf.get_submodule(down_proj(vlm.hf, feature.layer)).weight.detach()
    rec = recovery(tcs[feature.layer], acts, feature, w_down)
    real = real_model(vlm, tcs, feature, rec, args.n_pairs)
    graphs = graph_rows(vlm, tcs, feature, rec["feature"])
    result = {
        "organism": NAME,
        "layer": feature.layer,
        "unit": feature.unit,
        "seed": SEED,
        "transcoders": {
            "steps": args.steps or "default (1500)",
            "train_s": round(train_s, 1),
            "from_cache": cached,
            "fvu": [round(float(v), 4) for v in fid["fvu"].values],
            "dead_share": [round(float(v), 4) for v in fid["dead_share"].values],
        },
        "recovery": rec,
        "real_model": real,
        "graphs": graphs,
        "note": "one torch thread on a shared 2-core CPU; timings noisy",
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
