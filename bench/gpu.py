"""The GPU check at a real model's width: Qwen2.5-VL-7B's widths, random init, no downloads.

    python bench/gpu.py --all                      # every capability, one row each (≤ 8 min on an H100)
    python bench/gpu.py --quick                    # fewer stages, steps and depths (≤ 3 min)
    python bench/gpu.py --dry-run OUT.json --all   # the same rows on the CPU: depth 1, fp32, 140 px (the tests)

``--all`` and ``--quick`` (depth 28, bf16, 448 px) run the rows of ``bench/gpu_rows.py`` (its
docstring lists them: discover's every stage, transcoder steps, an attribution graph, focus fine-tune
steps, ``patch_heads`` beside the peer's head loop, the edge-ablated forward at depths 4 … 28), each
with its time, peak and the plan's figure, into ``--out``'s ``all`` / ``quick`` key (the file's other
keys kept; rewritten after each row, so a run cut short keeps what finished). Each row has a time
budget that bounds the whole run. The dry run writes OUT only; its times are not results.

The earlier check, kept as it was recorded (its H200 figures are ``bench/gpu.json``'s top level):

    python bench/gpu.py                      # a GPU machine: depth 28, bf16, 448 px → bench/gpu.json
    python bench/gpu.py --dry-run OUT.json   # CPU, depth 1, fp32, 112 px, 1 pair, no warm-up
    python bench/gpu.py --device cpu --dtype float32 --depth 2 --image-size 224 --pairs 2 --naive-heads 4 \
        --repeats 1 --out bench/gpu_cpu_depth2.json   # the CPU rehearsal recorded here

The model is a `Qwen2_5_VLForConditionalGeneration` built from a config with the 7B checkpoint's
widths — text hidden 3,584, 28 heads, 4 KV heads, intermediate 18,944, vocabulary 152,064; vision
width 1,280, 16 heads, intermediate 3,420, patch 14, merge 2, window 112 px, full attention in
blocks 7/15/23/31 — at ``--depth`` text layers (and as many vision blocks, at most 32), random
weights, on the device in ``--dtype``. It reads the organism's word-level tokenizer (the vocabulary
size, which sets the unembedding's cost, is the config's 152,064). Measured, each the median over
``--repeats``, the two sides of a comparison interleaved:

- **P1**: an nnsight trace saving one residual vs the plain forward of the same clean batch;
- the layer **VAP** sweep (`patch_layers`, image / last / text × every layer) vs as many plain
  forwards (one per site);
- **check**: `countlens check` on the model (`countlens.pipeline.selfcheck`), its rows recorded (run first,
  before the timings and the peak-memory reading);
- **edges**: one edge-ablated forward (`bench/edge_forward.py`'s: a random half of every edge of the
  graph ablated, counterfactual patching) beside a plain forward of the same clean batch;
- **P2**: the all-head sweep (`patch_heads`, batched replicas) vs a naive loop of one forward per
  head (`run_edits` with one edit, as ``bench/patching_sweeps.py`` defines it); goal ≥ 5×. The
  naive loop runs ``--naive-heads`` heads (all by default) and its time is scaled to all heads.

Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS on CPU.

Each comparison first calls every side once untimed (warm-up), except in ``--dry-run``: that one
checks that every measurement runs and reports, and its times (first calls included) are not results.
The dry run also draws only the first rows of each large matrix and fills the rest with shifted copies
of them (`_tiled_normal_`): drawing 1.39 B normal values is ~20 s on one CPU core, a third of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from wide_model import build, interleaved  # noqa: E402


def _peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(
    depth: int,
    image_size: int,
    n_pairs: int,
    dtype: str,
    device: str,
    repeats: int,
    naive_heads: int | None,
    warmup: bool = True,
    tiled_init: bool = False,
) -> dict:
    from countlens.circuits.engine.edits import Edit, cache_run, run_edits
    from countlens.circuits.methods.patching import patch_heads, patch_layers, prepare_pairs
    from countlens.circuits.sites import HeadZ, group_mask
    from countlens.datasets.pairs import count_pairs
    from countlens.pipeline.selfcheck import as_json, check

    t0 = time.perf_counter()
    vlm, grid = build(depth, image_size, getattr(torch, dtype), device, tiled_init=tiled_init)
    built_s = time.perf_counter() - t0
    checked = as_json(check(vlm))
    pairs = count_pairs(n_pairs, kind="dots", grid=grid, prompt="short", counts=range(2, 8), seed=0)
    pb = prepare_pairs(vlm, pairs)
    arch = vlm.arch
    layer = arch.layer(arch.n_layers // 2)
    groups = ("image", "last", "text")
    n_sites = (arch.n_layers + 1) * len(groups)

    def plain():
        with torch.no_grad():
            vlm.forward(pb.clean, logits_to_keep=1)

    def traced():
        with torch.no_grad(), vlm.trace(pb.clean, logits_to_keep=1):
            vlm.module(layer).output.save()

    t = interleaved({"plain": plain, "traced": traced}, repeats, device, warmup)
    vap = interleaved(
        {
            "patch_layers": lambda: patch_layers(vlm, pairs, groups=groups, batch_size=n_pairs),
            "plain_x_sites": lambda: [plain() for _ in range(n_sites)],
        },
        repeats,
        device,
        warmup,
    )
    heads = [(la, h) for la in range(arch.n_layers) for h in range(arch.n_heads)]
    chosen = heads[: naive_heads or len(heads)]
    mask = group_mask(pb.clean, "all")

    def naive():
        b = prepare_pairs(vlm, pairs)
        cache = cache_run(vlm, b.corrupt, range(arch.n_layers))
        for la, h in chosen:
            run_edits(vlm, b.clean, cache, [Edit(HeadZ(la, h), mask)], max_rows=n_pairs)

    p2 = interleaved(
        {"patch_heads": lambda: patch_heads(vlm, pairs, batch_size=n_pairs), "naive": naive}, repeats, device, warmup
    )
    naive_all = p2["naive"] * len(heads) / len(chosen)
    from edge_forward import measure as edge_forward  # noqa: PLC0415 — beside this file, imports it back

    edges = edge_forward(vlm, pairs, repeats, device, warmup)
    text, vision = vlm.hf.config.text_config, vlm.hf.config.vision_config
    ms = lambda s: round(1000 * s, 1)  # noqa: E731
    return {
        "model": vlm.name,
        "depth": depth,
        "dtype": dtype,
        "config": {
            "hidden": text.hidden_size,
            "heads": text.num_attention_heads,
            "kv_heads": text.num_key_value_heads,
            "intermediate": text.intermediate_size,
            "vocab": text.vocab_size,
            "layers": text.num_hidden_layers,
            "vision_hidden": vision.hidden_size,
            "vision_heads": vision.num_heads,
            "vision_intermediate": vision.intermediate_size,
            "vision_depth": vision.depth,
            "patch": vision.patch_size,
            "merge": vision.spatial_merge_size,
        },
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "image_size": image_size,
        "image_tokens": (image_size // 28) ** 2,
        "sequence_length": int(pb.clean.inputs["input_ids"].shape[1]),
        "pairs": n_pairs,
        "parameters": sum(p.numel() for p in vlm.hf.parameters()),
        "build_s": round(built_s, 1),
        "repeats": repeats,
        "torch": torch.__version__,
        "p1": {
            "plain_forward_ms": ms(t["plain"]),
            "nnsight_trace_ms": ms(t["traced"]),
            "ratio": round(t["traced"] / t["plain"], 3),
        },
        "vap": {
            "sites": n_sites,
            "patch_layers_ms": ms(vap["patch_layers"]),
            "plain_forwards_ms": ms(vap["plain_x_sites"]),
            "ratio": round(vap["patch_layers"] / vap["plain_x_sites"], 3),
        },
        "p2": {
            "heads": len(heads),
            "naive_heads_run": len(chosen),
            "patch_heads_ms": ms(p2["patch_heads"]),
            "naive_all_heads_ms": ms(naive_all),
            "speedup": round(naive_all / p2["patch_heads"], 2),
            "goal": ">= 5",
        },
        # One edge-ablated forward (a random half of every edge, counterfactual) beside a plain one.
        "edges": {k: edges[k] for k in ("edges", "rows", "seq", "plain_s", "ablated_s", "ratio", "planned_ratio")},
        "peak_memory_bytes": _peak_bytes(device),
        # `countlens check` on this model (countlens.pipeline.selfcheck): its rows, for the record.
        "check": checked,
    }


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dry-run",
        metavar="OUT",
        type=Path,
        help="CPU, depth 1, fp32, 112 px, 1 pair, no warm-up (checks that it all runs; its times "
        "are not results); write OUT",
    )
    ap.add_argument("--depth", type=int, default=28)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="default bfloat16 (with --dry-run: float32)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--naive-heads", type=int, default=None, help="heads the naive loop runs (default: all)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    ap.add_argument("--all", action="store_true", help="every row of bench/gpu_rows.py (≤ 8 min on an H100)")
    ap.add_argument("--quick", action="store_true", help="fewer stages, steps and depths (≤ 3 min on an H100)")
    args = ap.parse_args()
    if args.all and args.quick:
        ap.error("give --all or --quick, not both")
    if args.all or args.quick:
        from gpu_rows import MODES, run_all

        key = "dry_run" if args.dry_run else "all" if args.all else "quick"
        device = "cpu" if args.dry_run else args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            ap.error("no CUDA device here: run on a GPU machine, or --dry-run OUT --all for the CPU check")
        out, sizes = args.dry_run or args.out, MODES[key]
        if args.dtype:  # e.g. the dry run in bfloat16, the GPU run's dtype
            sizes = replace(sizes, dtype=args.dtype)
        rec = run_all(sizes, out, key, device)
        if rec.failed:
            raise SystemExit(f"rows not finished: {', '.join(rec.failed)} (their errors are in {out})")
        return rec.record
    if args.dry_run:
        result = run(1, 112, 1, "float32", "cpu", 1, naive_heads=1, warmup=False, tiled_init=True)
        args.dry_run.write_text(json.dumps(result, indent=2) + "\n")
        return result
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device here: run on a GPU machine, or --dry-run OUT for the CPU check")
    dtype = args.dtype or "bfloat16"
    result = run(args.depth, args.image_size, args.pairs, dtype, args.device, args.repeats, args.naive_heads)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
