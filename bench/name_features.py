"""The organism's most influential transcoder features, each with the numbers of its card and a name
drafted from them.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/name_features.py [--transcoders FOLDER]
    # writes bench/name_features.json, docs/img/cards/card_L{l}F{f}.png (at most 6), prints the table

Transcoders: ``--transcoders`` (a circuit-tracer folder, e.g. ``train_transcoders(vlm, out=…)``'s
``transcoders/``) or `train_transcoders(vlm)` with its defaults (width 512, k 16, 1500 steps, seed 0).
Scenes: as ``bench/attribution_graph.py``, the first samples of ``task_samples("count", 64, seed=0)``
with 3 and 5 objects; each graph's top 5 (layer, feature) pairs by node influence
(`countlens.cli.features.top_features`, on the unpruned graph; whether `prune` keeps them is noted).
Cards (`feature_cards`) over ``task_samples("count", 64, seed=0)``, top 6 scenes each.

The drafted name reads only card numbers: where the feature peaks (the last position, another text
position, or an image token), the counts of its top scenes, the count word its direct effect favours
most and least, and the ablated change of the answer's log-probability. It is a draft: the docs'
table states which readings hold and which are unclear.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from PIL import Image

import countlens
from countlens.cli.features import top_features
from countlens.datasets.tasks import task_samples
from countlens.features import (
    attribution_graph,
    draw_card,
    feature_cards,
    load_transcoders,
    prune,
    train_transcoders,
)

HERE = Path(__file__).resolve().parent
CARDS = HERE.parent / "docs" / "img" / "cards"
MAX_IMAGES, MAX_PNG_BYTES = 6, 60_000


def small_png(src: Path, dest: Path) -> int:
    """``src`` re-saved as a 32-colour palette PNG (the cards are flat colours), halved until ≤ 60 kB."""
    image = Image.open(src).convert("RGB")
    while True:
        buf = io.BytesIO()
        image.quantize(colors=32).save(buf, format="PNG", optimize=True)
        if buf.tell() <= MAX_PNG_BYTES or image.width < 300:
            break
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4))
    dest.write_bytes(buf.getvalue())
    return buf.tell()


def draft_name(card: dict) -> str:
    """A short name from the card's numbers (see the module's docstring)."""
    where = {"last": "last-token", "image": "image-token", "text": f"text-token ({card['peak_token']!r})"}
    counts = card["top_counts"]
    spread = max(counts) - min(counts)
    if spread == 0:
        fires = f"fires most on {counts[0]}-object scenes"
    elif spread <= 2:
        fires = f"fires most on {min(counts)}–{max(counts)}-object scenes"
    else:
        fires = "top scenes of mixed counts"
    promotes = f"promotes '{card['direct_max']}', suppresses '{card['direct_min']}'"
    if card["ablated"] < -0.05:
        helps = "helps the answer"
    elif card["ablated"] > 0.05:
        helps = "hurts the answer"
    else:
        helps = "ablation barely moves the answer"
    return f"{where[card['peak_kind']]} feature; {fires}; {promotes}; {helps}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transcoders", help="a circuit-tracer transcoder folder (default: train with defaults)")
    parser.add_argument("--out", default=str(HERE / "name_features.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    if args.transcoders:
        tcs, source = load_transcoders(args.transcoders, vlm), args.transcoders
    else:
        tcs, source = train_transcoders(vlm, progress=False).transcoders, "train_transcoders(vlm) defaults"
    samples = task_samples("count", 64, seed=0)
    chosen: dict[tuple[int, int], dict] = {}
    for count in (3, 5):
        sample = next(s for s in samples if s.meta["count"] == count)
        graph = attribution_graph(vlm, tcs, sample)
        kept = {(layer, f) for layer, _, f in prune(graph).features.tolist()}
        for rank, ((layer, f), j) in enumerate(top_features(graph, 5).items()):
            pos = int(graph.features[j, 1])
            entry = chosen.setdefault((layer, f), {"in_graphs": []})
            entry["in_graphs"].append(
                {
                    "count": count,
                    "rank": rank + 1,
                    "position": pos,
                    "token": graph.token_strings[pos],
                    "last": pos == graph.last,
                    "activation": round(float(graph.activations[j]), 3),
                    "kept_by_prune": (layer, f) in kept,
                }
            )
    features = list(chosen)
    cards = feature_cards(vlm, tcs, samples, features, top=6)
    CARDS.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (layer, f) in enumerate(features):
        c = cards.sel(card=f"L{layer}F{f}")
        top_scenes = [int(s) for s in c.scene.values]
        batch = vlm.prepare_samples([samples[top_scenes[0]]])
        peak = int(c.peak_position.values[0])
        last = peak == int(batch.inputs["attention_mask"][0].sum()) - 1
        on_image = c.peak_on_image.values.astype(bool)
        kind = "image" if on_image.mean() > 0.5 else "last" if last else "text"
        direct = c.direct.values
        card = {
            "feature": f"L{layer}F{f}",
            "in_graphs": chosen[(layer, f)]["in_graphs"],
            "top_counts": [samples[s].meta["count"] for s in top_scenes],
            "top_max_activation": [round(float(x), 3) for x in c.max_activation.values],
            "peak_on_image_share": float(on_image.mean()),
            "peak_token": vlm.token_strings(batch.inputs["input_ids"][0, peak : peak + 1].tolist())[0],
            "peak_kind": kind,
            "fires_on_objects": round(float(c.fires_on_objects), 3),
            "direct": {str(n): round(float(v), 4) for n, v in zip(c["count"].values, direct)},
            "direct_max": str(int(c["count"].values[int(np.argmax(direct))])),
            "direct_min": str(int(c["count"].values[int(np.argmin(direct))])),
            "ablated": round(float(c.ablated), 4),
        }
        card["name"] = draft_name(card)
        if i < MAX_IMAGES:
            with tempfile.TemporaryDirectory() as tmp:
                raw = draw_card(cards, card["feature"], samples, Path(tmp) / "card.png")
                card["png_bytes"] = small_png(raw, CARDS / f"card_{card['feature']}.png")
        rows.append(card)
    counts = Counter(s.meta["count"] for s in samples)
    out = {
        "transcoders": source,
        "card_scenes": "task_samples('count', 64, seed=0)",
        "scene_counts": counts,
        "features": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1, default=int) + "\n")
    head = ["feature", "in graphs (count: rank, position)", "top scenes' counts", "peak", "fires on objects"]
    head += ["direct max / min", "ablated Δ log p", "drafted name"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        where = ", ".join(f"{g['count']}: #{g['rank']} {g['token']!r}" for g in r["in_graphs"])
        d = r["direct"]
        print(
            f"| {r['feature']} | {where} | {r['top_counts']} | {r['peak_kind']} {r['peak_token']!r} "
            f"| {r['fires_on_objects']:.2f} | '{r['direct_max']}' {d[r['direct_max']]:+.3f} / '{r['direct_min']}' "
            f"{d[r['direct_min']]:+.3f} | {r['ablated']:+.3f} | {r['name']} |"
        )


if __name__ == "__main__":
    main()
