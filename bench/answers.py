"""Multi-token answers: what candidate scoring and multi-token patching targets cost, side by side.

    .venv/bin/python bench/answers.py                   # writes bench/answers.json

Two models: the organism (word-level vocabulary, every count one token) and the tiny Qwen2.5-VL of
the test matrix with the real Qwen vocabulary (151,936 rows; "12" → "1", "2", `tests/real_vocab.py`;
hidden 64, 2 layers, 64 px images), built from its config (no download). Timings are medians of
interleaved repeats (A, B, A, B, …), after a warm-up, waiting for a quiet machine (`_timing`).

- (a) Organism, 64 counting samples (`task_samples("count", 64, 3)`): ``score(method="token")`` vs
  ``score(method="candidates")`` (candidates 0 … the largest count: one row per sample, the bare
  prompt, so the same forward plus the candidate bookkeeping).
- (b) Real-vocabulary Qwen, 32 samples with counts 1 … 12: candidate scoring (13 candidates ending in
  ``<|im_end|>``: 12 teacher-forced rows per sample, `countlens.model.answers.read_rows`) vs one plain
  forward of the same batch (what single-token scoring would cost, were the answers one token).
- (c) Real-vocabulary Qwen, 32 pairs of single-digit counts ((3, 5), (4, 6), (2, 7), (5, 3)) and 32
  of multi-digit targets ((1, 12), (9, 12), (10, 12), (12, 10): a shared "1" is teacher-forced for
  the last two): the layer sweep ``patch_layers`` (3 layers incl. the embeddings × 3 groups) vs as
  many plain forwards of the clean batch (sites × pairs rows, the same inputs); and P1, an nnsight
  trace saving one residual vs the plain forward of the same (prefix-forced) batch.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models, real_vocab

import torch  # noqa: E402
from _timing import interleaved, measured  # noqa: E402

import countlens  # noqa: E402


def real_vocab_qwen():
    from tiny_models import build_tiny

    model, processor = build_tiny("qwen2_5_vl")
    path = tempfile.mkdtemp(prefix="countlens-bench-")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return countlens.load(path)


def counting(counts, side: int, seed: int = 3):
    from countlens.datasets.pairs import count_pairs

    return [
        count_pairs(1, n, 13, kind="shapes", image_size=side, prompt="short", seed=seed + i)[0].clean
        for i, n in enumerate(counts)
    ]


def main(repeats: int = 5) -> dict:
    from countlens.analysis.evaluate import score
    from countlens.circuits import patch_layers
    from countlens.circuits.methods.patching import prepare_pairs
    from countlens.circuits.sites import repeat_inputs
    from countlens.datasets.pairs import count_pairs
    from countlens.datasets.tasks import task_samples

    torch.set_num_threads(2)
    out: dict = {
        "threads": 2,
        "repeats": repeats,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }

    toy = countlens.load("toy")
    samples = task_samples("count", 64, 3, image_size=toy.geometry.image_height)
    fns = {"token": lambda: score(toy, samples), "candidates": lambda: score(toy, samples, method="candidates")}
    t, load = measured(lambda: interleaved(fns, repeats))
    out["a_organism_scoring"] = {
        "samples": len(samples),
        "token_s": round(t["token"], 3),
        "candidates_s": round(t["candidates"], 3),
        "ratio": round(t["candidates"] / t["token"], 2),
        "others_load_cores": load.others,
    }

    qwen = real_vocab_qwen()
    side = qwen.geometry.image_height
    qs = counting([1 + i % 12 for i in range(32)], side)
    batch = qwen.prepare([s.image for s in qs], [s.question for s in qs])
    fns = {
        "plain_forward": lambda: qwen.forward(batch, logits_to_keep=1),
        "candidates": lambda: score(qwen, qs, batch_size=32),
    }
    t, load = measured(lambda: interleaved(fns, repeats))
    out["b_real_vocab_candidates"] = {
        "samples": len(qs),
        "candidates": 13,
        "rows_per_sample": 12,
        "vocab": qwen.hf.config.text_config.vocab_size,
        "plain_forward_s": round(t["plain_forward"], 3),
        "candidates_s": round(t["candidates"], 3),
        "ratio": round(t["candidates"] / t["plain_forward"], 2),
        "others_load_cores": load.others,
    }

    groups = ("image", "last", "text")
    sites = (qwen.arch.n_layers + 1) * len(groups)
    kinds = {"single_digit": [(3, 5), (4, 6), (2, 7), (5, 3)], "multi_digit": [(1, 12), (9, 12), (10, 12), (12, 10)]}
    out["c_real_vocab_layer_sweep"] = {"pairs": 32, "sites": sites, "patched_rows": sites * 32, "groups": groups}
    for kind, counts in kinds.items():
        pairs = [
            p
            for i, (a, b) in enumerate(counts)
            for p in count_pairs(8, a, b, kind="shapes", image_size=side, prompt="short", seed=20 + i)
        ]
        clean = prepare_pairs(qwen, pairs).clean
        wide = repeat_inputs(clean.inputs, sites)
        layer = qwen.arch.layer(qwen.arch.n_layers - 1)

        def plain_rows(wide=wide):
            with torch.no_grad():
                qwen.hf(**wide, logits_to_keep=1, use_cache=False)

        def plain(clean=clean):
            qwen.forward(clean, logits_to_keep=1)

        def traced(clean=clean):
            with torch.no_grad(), qwen.trace(clean, logits_to_keep=1):
                qwen.module(layer).output.save()

        fns = {
            "plain_forwards": plain_rows,
            "patch_layers": lambda pairs=pairs: patch_layers(qwen, pairs, groups=groups, batch_size=32),
            "plain_forward": plain,
            "trace": traced,
        }
        t, load = measured(lambda: interleaved(fns, repeats))
        out["c_real_vocab_layer_sweep"][kind] = {
            "pair_counts": str(counts),
            "pairs_with_a_forced_prefix": int((clean.last > clean.prompt_last).sum()),
            "plain_forwards_s": round(t["plain_forwards"], 3),
            "patch_layers_s": round(t["patch_layers"], 3),
            "ratio_sweep_vs_plain": round(t["patch_layers"] / t["plain_forwards"], 2),
            "trace_ms": round(1000 * t["trace"], 2),
            "plain_forward_ms": round(1000 * t["plain_forward"], 2),
            "ratio_P1_trace_vs_plain": round(t["trace"] / t["plain_forward"], 3),
            "others_load_cores": load.others,
        }
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
