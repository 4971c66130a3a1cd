"""The README's Python walk-through, end to end on the shipped organism (run by the tests).

python examples/walkthrough.py [OUT_DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import countlens as cl
from countlens.datasets import count_pairs, countingtricks, task_samples


def main(out: Path) -> dict:
    vlm = cl.load("toy")  # or cl.load("/models/Qwen2.5-VL-7B-Instruct", dtype="bfloat16", device_map="cuda")

    # Controlled data on the model's own patch grid.
    tricks = countingtricks(["1A", "4A", "9A"], n_per_case=8, grid=vlm.geometry, seed=0, prompt="short")
    acc = cl.analysis.score(vlm, tricks)  # xr.Dataset over sample: pred, gold, correct, case, ...
    pairs = count_pairs(16, clean=3, corrupt=5, kind="shapes", grid=vlm.geometry, prompt="short")

    # Patch a layer: where does the count travel? (layer × token group)
    vap = cl.circuits.patch_layers(vlm, pairs, groups=("image", "last", "text"))
    # Patch every head's z (before o_proj), many heads per forward; and the 3-pass AtP estimate.
    heads = cl.circuits.patch_heads(vlm, pairs)
    atp = cl.circuits.attribution_patch(vlm, pairs)
    agreement = cl.circuits.compare(atp.effect, heads.effect, k=5)

    # Decode heads into the vocabulary with HeadLens.
    fit = [s for t in ("count", "color", "shape") for s in task_samples(t, 24, seed=500)]
    lens = cl.circuits.HeadLens.fit(vlm, fit)
    decoded = lens.decode(vlm, task_samples("count", 8, seed=1), top_k=5)

    # Mean-ablate the most important head and see counting break.
    top = heads.effect.stack(site=("layer", "head")).idxmax().item()
    ablated = cl.circuits.ablate(vlm, task_samples("count", 32, seed=2), [top])

    # Sharpen it with head temperature instead.
    batch = vlm.prepare([p.clean.image for p in pairs[:4]], [p.clean.question for p in pairs[:4]])
    with cl.circuits.head_temperature(vlm, {top: 1.5}):
        sharpened = vlm.forward(batch).logits[:, -1]

    # Save and load labelled results (netCDF, with provenance attrs).
    path = cl.results.save(vap, out / "vap.nc")
    again = cl.results.load(path)
    return {
        "accuracy": float(acc.correct.mean()),
        "vap_last_token_effect": [round(float(x), 2) for x in again.effect.sel(group="last").values],
        "top_head": top,
        "atp_spearman": agreement["spearman"],
        "top_tokens_of_top_head": decoded.token.sel(layer=top[0], head=top[1], sample=0).values.tolist(),
        "ablated_accuracy": (float(ablated.base_correct.mean()), float(ablated.correct.mean())),
        "sharpened_logits_shape": tuple(sharpened.shape),
    }


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    for key, value in main(target).items():
        print(f"{key}: {value}")
