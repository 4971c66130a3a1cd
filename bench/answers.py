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
  ``<|im_end|>``: 12 teacher-forced rows per sample, `countlens.answers.read_rows`) vs one plain
  forward of the same batch (what single-token scoring would cost, were the answers one token).
- (c) Real-vocabulary Qwen, 12 pairs (1, 12), (9, 12), (10, 12), 4 of each: the all-heads sweep
  ``patch_heads`` (L·H sites) vs as many plain forwards of the clean batch (L·H × pairs rows, the
  same shared-prefix-forced inputs): P1, the cost of patching with multi-token targets over plain
  forwards of the same rows.
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

import countlens  # noqa: E402
from _timing import interleaved, measured  # noqa: E402


def real_vocab_qwen():
    from tiny_models import build_tiny

    model, processor = build_tiny("qwen2_5_vl")
    path = tempfile.mkdtemp(prefix="countlens-bench-")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return countlens.load(path)


def counting(counts, side: int, seed: int = 3):
    from countlens.datasets.pairs import count_pairs

    return [count_pairs(1, n, 13, kind="shapes", image_size=side, prompt="short", seed=seed + i)[0].clean
            for i, n in enumerate(counts)]


def main(repeats: int = 5) -> dict:
    from countlens.analysis.evaluate import score
    from countlens.circuits import patch_heads
    from countlens.circuits.patching import prepare_pairs
    from countlens.datasets.pairs import count_pairs
    from countlens.datasets.tasks import task_samples

    torch.set_num_threads(2)
    out: dict = {"threads": 2, "repeats": repeats, "machine": {
        "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}

    toy = countlens.load("toy")
    samples = task_samples("count", 64, 3, image_size=toy.geometry.image_height)
    fns = {"token": lambda: score(toy, samples), "candidates": lambda: score(toy, samples, method="candidates")}
    t, load = measured(lambda: interleaved(fns, repeats))
    out["a_organism_scoring"] = {"samples": len(samples), "token_s": round(t["token"], 3),
                                 "candidates_s": round(t["candidates"], 3),
                                 "ratio": round(t["candidates"] / t["token"], 2), "others_load_cores": load.others}

    qwen = real_vocab_qwen()
    side = qwen.geometry.image_height
    qs = counting([1 + i % 12 for i in range(32)], side)
    batch = qwen.prepare([s.image for s in qs], [s.question for s in qs])
    fns = {"plain_forward": lambda: qwen.forward(batch, logits_to_keep=1),
           "candidates": lambda: score(qwen, qs, batch_size=32)}
    t, load = measured(lambda: interleaved(fns, repeats))
    out["b_real_vocab_candidates"] = {
        "samples": len(qs), "candidates": 13, "rows_per_sample": 12, "vocab": qwen.hf.config.text_config.vocab_size,
        "plain_forward_s": round(t["plain_forward"], 3), "candidates_s": round(t["candidates"], 3),
        "ratio": round(t["candidates"] / t["plain_forward"], 2), "others_load_cores": load.others}

    pairs = [p for i, (a, b) in enumerate([(1, 12), (9, 12), (10, 12)])
             for p in count_pairs(4, a, b, kind="shapes", image_size=side, prompt="short", seed=20 + i)]
    sites = qwen.arch.n_layers * qwen.arch.n_heads
    clean = prepare_pairs(qwen, pairs).clean
    wide = countlens.circuits.sites.repeat_inputs(clean.inputs, sites)

    def plain_rows():
        with torch.no_grad():
            qwen.hf(**wide, logits_to_keep=1, use_cache=False)

    fns = {"plain_forwards": plain_rows, "patch_heads": lambda: patch_heads(qwen, pairs, batch_size=len(pairs))}
    t, load = measured(lambda: interleaved(fns, repeats))
    out["c_real_vocab_head_sweep"] = {
        "pairs": len(pairs), "pair_counts": "(1,12) (9,12) (10,12) x4", "sites": sites,
        "patched_rows": sites * len(pairs), "plain_forwards_s": round(t["plain_forwards"], 3),
        "patch_heads_s": round(t["patch_heads"], 3), "ratio_P1": round(t["patch_heads"] / t["plain_forwards"], 2),
        "others_load_cores": load.others}
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
