"""Patching sweeps on the organism: their cost against plain forwards, batched vs one site per forward,
AtP vs exact, and peak memory as the number of pairs grows — side by side in one run.

    .venv/bin/python bench/patching_sweeps.py           # writes bench/patching_sweeps.json

Pairs: ``count_pairs(32, kind="shapes", grid=vlm.geometry, prompt="short", counts=range(2, 9), seed=0)``.
Timings are medians over repeats; the two sides of each comparison are run interleaved (A, B, A, B, …)
so that load from other processes hits both alike. The load average is recorded before and after.

- (a) ``patch_layers(vlm, pairs, groups=("image", "last", "text"))`` (L×G sites, L its default layers)
  vs L×G plain HF forwards of the clean batch (``vlm.forward(prepare_pairs(vlm, pairs).clean, logits_to_keep=1)``),
  i.e. the same number of patched rows (sites × pairs). Also a breakdown of the sweep (prepare, the two
  cached runs, the expanded edit forwards) and the edit forwards against plain forwards of the very
  same expanded inputs (the cost of the interventions themselves).
- (b) the all-heads sweep batched (``run_edits`` with ``MAX_ROWS`` rows, and `patch_heads`) vs
  one head per forward (``run_edits(..., max_rows=len(pairs))``), on one prepared batch of all 32 pairs;
  max |Δlogit| against the one-per-forward logits, a scan of other ``max_rows`` values, and a naive loop
  (one full forward per head, nothing reused: what a hand-written nnsight loop does).
- (c) ``attribution_patch`` vs ``patch_heads`` (both with the default batch_size=16): time and
  ``compare(atp.effect, exact.effect, k=5)``; also AtP's ``resid_effect`` vs exact residual patching
  over (layer, token group) for the image / last / text groups.
- (d) peak RSS (``ru_maxrss``) of a ``patch_layers`` sweep (batch_size=16) for 16…128 pairs, each in a
  fresh subprocess (``--peak-mem N``), before and after the sweep; run first (see `peak_child`); also with
  glibc told to mmap large blocks, to tell fragmentation from retained data.

Other engineers may share the machine: ``others_load_cores`` is the CPU (in cores) other processes
used during a measurement, from /proc/stat; figures taken with it well above 0 are suspect, so each
measurement first waits for a quiet machine and is retried (up to 3 tries) when it was not. The script
runs on a frozen copy of `countlens` (see `run_on_snapshot`); ``source_sha256`` names the version.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_on_snapshot() -> None:
    """Re-run this script on a frozen copy of the `countlens` package, then exit with its status.

    The library is edited while benchmarks run, and nnsight reads a traced function's source lazily
    (once per file), so an edit mid-run either breaks a trace or mixes two versions in one result.
    The copy goes first on PYTHONPATH (ahead of the editable install), for the memory children too.
    """
    if os.environ.get("COUNTLENS_BENCH_SNAPSHOT"):
        return
    import importlib.util
    import shutil
    import tempfile

    src = Path(importlib.util.find_spec("countlens").origin).parent
    snap = Path(tempfile.mkdtemp(prefix="countlens-bench-"))
    try:
        shutil.copytree(src, snap / "countlens", ignore=shutil.ignore_patterns("__pycache__"))
        path = os.pathsep.join(p for p in (str(snap), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "COUNTLENS_BENCH_SNAPSHOT": str(src), "PYTHONPATH": path}
        rc = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    finally:
        shutil.rmtree(snap, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    run_on_snapshot()

import torch  # noqa: E402
import xarray as xr  # noqa: E402
from _timing import Load, interleaved, measured  # noqa: E402  (bench/ is on sys.path when run as a script)

import countlens  # noqa: E402
import countlens.circuits.engine.edits as edits_module  # noqa: E402
from countlens.circuits.engine.edits import Edit, cache_run  # noqa: E402
from countlens.circuits.engine.pair_batch import prepare_pairs  # noqa: E402
from countlens.circuits.methods.patching import attribution_patch, compare, patch_heads, patch_layers  # noqa: E402
from countlens.circuits.sites import HeadZ, Residual, group_mask, repeat_inputs  # noqa: E402
from countlens.datasets.pairs import count_pairs  # noqa: E402
from countlens.model.memory import MAX_ROWS  # noqa: E402

THREADS = 2
PAIRS_KW = dict(kind="shapes", prompt="short", counts=range(2, 9), seed=0)


def run_edits(vlm, pb, cache, edits, max_rows=MAX_ROWS):
    """`countlens.circuits.engine.edits.run_edits` under either signature: (vlm, pb: PairBatch, …) or
    (vlm, batch, …)."""
    second = list(inspect.signature(edits_module.run_edits).parameters)[1]
    return edits_module.run_edits(vlm, pb if second == "pb" else pb.clean, cache, edits, max_rows=max_rows)


def source_digest() -> dict:
    """sha256 (first 12) of the library files measured, to tie figures to the code they ran."""
    root = Path(countlens.__file__).parent
    files = (
        "circuits/methods/patching.py",
        "circuits/sites/__init__.py",
        "circuits/engine/edits.py",
        "circuits/engine/sweep.py",
        "circuits/engine/pair_batch.py",
        "circuits/sites/expert_rules.py",
        "model/vlm.py",
    )
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12] for f in files}


def ms(s: float) -> float:
    return round(1000 * s, 1)


def logit_diff(logits, clean_id, corrupt_id):
    rows = torch.arange(len(logits))
    return logits[rows, clean_id] - logits[rows, corrupt_id]


def bench_layers(vlm, pairs, repeats: int) -> dict:
    groups = ("image", "last", "text")
    # The sweep's own layers (its default may include −1, the embeddings): sites = layers × groups.
    sweep_layers = [int(x) for x in patch_layers(vlm, pairs[:2], groups=groups).layer.values]
    n_sites = len(sweep_layers) * len(groups)
    batch = prepare_pairs(vlm, pairs).clean

    def plain():
        for _ in range(n_sites):
            vlm.forward(batch, logits_to_keep=1)

    t, load = measured(
        lambda: interleaved({"sweep": lambda: patch_layers(vlm, pairs, groups=groups), "plain": plain}, repeats)
    )

    # Breakdown of the same sweep, step by step as `_sweep` does it (batch_size=16 chunks), and the
    # edit forwards against plain forwards of the same expanded inputs (vision tower included).
    bs, layers = 16, sorted(set(range(vlm.arch.n_layers)) | set(sweep_layers))  # every layer, as `_sweep`
    chunks = [pairs[s : s + bs] for s in range(0, len(pairs), bs)]
    pbs = [prepare_pairs(vlm, c) for c in chunks]
    caches = [cache_run(vlm, pb.corrupt, layers) for pb in pbs]
    edits = []
    for pb in pbs:
        masks = {g: group_mask(pb.clean, g) for g in groups}
        edits.append([Edit(Residual(layer), masks[g]) for layer in sweep_layers for g in groups])
    shapes = [
        [
            len(e[k : k + max(1, MAX_ROWS // len(pb.clean.inputs["input_ids"]))])
            for k in range(0, len(e), max(1, MAX_ROWS // len(pb.clean.inputs["input_ids"])))
        ]
        for pb, e in zip(pbs, edits)
    ]

    @torch.no_grad()
    def plain_same_inputs():
        for pb, reps in zip(pbs, shapes):
            for k in reps:
                vlm.hf(**repeat_inputs(pb.clean.inputs, k), logits_to_keep=1)

    visual = vlm.hf.get_submodule(vlm.arch.spec.vision_tower) if hasattr(vlm.arch, "spec") else vlm.hf.model.visual
    inp = batch.inputs
    parts, load_parts = measured(
        lambda: interleaved(
            {
                "prepare": lambda: [prepare_pairs(vlm, c) for c in chunks],
                "cache_corrupt": lambda: [cache_run(vlm, pb.corrupt, layers) for pb in pbs],
                "cache_clean": lambda: [cache_run(vlm, pb.clean, [], resid=False, z=False) for pb in pbs],
                "edit_forwards": lambda: [run_edits(vlm, pb, c, e) for pb, c, e in zip(pbs, caches, edits)],
                "plain_same_inputs": plain_same_inputs,
                "vision_tower_32": lambda: visual(inp["pixel_values"], grid_thw=inp["image_grid_thw"]),
                "plain_forward_32": lambda: vlm.forward(batch, logits_to_keep=1),
            },
            repeats,
        )
    )
    return {
        "layers": sweep_layers,
        "groups": list(groups),
        "sites": n_sites,
        "pairs": len(pairs),
        "patched_rows": n_sites * len(pairs),
        "batch_size": bs,
        "max_rows": MAX_ROWS,
        "repeats": repeats,
        "patch_layers_ms": ms(t["sweep"]),
        "plain_forwards_ms": ms(t["plain"]),
        "ratio": round(t["sweep"] / t["plain"], 3),
        "goal": "<= 1.10",
        "others_load_cores": load.others,
        "breakdown_ms": {k: ms(v) for k, v in parts.items()},
        "breakdown_others_load_cores": load_parts.others,
        "expanded_forwards_rows": [
            [k * len(pb.clean.inputs["input_ids"]) for k in reps] for pb, reps in zip(pbs, shapes)
        ],
        "ratio_edit_forwards_vs_plain": round(parts["edit_forwards"] / t["plain"], 3),
        "ratio_edit_forwards_vs_plain_same_inputs": round(parts["edit_forwards"] / parts["plain_same_inputs"], 3),
        "vision_tower_share_of_plain_forward": round(parts["vision_tower_32"] / parts["plain_forward_32"], 3),
    }


def bench_heads(vlm, pairs, repeats: int) -> dict:
    n = len(pairs)
    pb = prepare_pairs(vlm, pairs)
    cache = cache_run(vlm, pb.corrupt, range(vlm.arch.n_layers))
    mask = group_mask(pb.clean, "all")
    edits = [Edit(HeadZ(layer, head), mask) for layer in range(vlm.arch.n_layers) for head in range(vlm.arch.n_heads)]
    ref = run_edits(vlm, pb, cache, edits, max_rows=n)  # one edit per forward

    def one_per_forward_sweep():  # the whole sweep as patch_heads does it, but one head per forward
        b = prepare_pairs(vlm, pairs)
        c = cache_run(vlm, b.corrupt, range(vlm.arch.n_layers))
        cache_run(vlm, b.clean, [], resid=False, z=False)
        return run_edits(vlm, b, c, edits, max_rows=n)

    def naive_sweep():  # what a hand-written loop does: one full forward per head, nothing reused
        b = prepare_pairs(vlm, pairs)
        c = cache_run(vlm, b.corrupt, range(vlm.arch.n_layers))
        return torch.cat([run_edits(vlm, b, c, [e], max_rows=n) for e in edits])

    naive = naive_sweep()
    t, load = measured(
        lambda: interleaved(
            {
                "patch_heads_bs32": lambda: patch_heads(vlm, pairs, batch_size=n),
                "naive_one_full_forward_per_head": naive_sweep,
                "one_per_forward_sweep": one_per_forward_sweep,
                "patch_heads_default": lambda: patch_heads(vlm, pairs),
            },
            repeats,
        )
    )

    # run_edits alone at several max_rows (n = one edit per forward … all edits in one forward).
    scan, fns = {}, {}
    for max_rows in (n, 2 * n, 4 * n, MAX_ROWS, 16 * n, len(edits) * n):
        logits = run_edits(vlm, pb, cache, edits, max_rows=max_rows)  # doubles as the warm-up
        scan[str(max_rows)] = {
            "edits_per_forward": max(1, max_rows // n),
            "forwards": -(-len(edits) // max(1, max_rows // n)),
            "max_abs_diff_vs_one_per_forward": float((logits - ref).abs().max()),
        }
        fns[str(max_rows)] = lambda m=max_rows: run_edits(vlm, pb, cache, edits, max_rows=m)
    secs, load_scan = measured(lambda: interleaved(fns, repeats, warm=False))
    for k, v in scan.items():
        v["ms"] = ms(secs[k])
    base = scan[str(n)]["ms"]
    for v in scan.values():
        v["speedup_vs_one_per_forward"] = round(base / v["ms"], 3)

    ds = patch_heads(vlm, pairs, batch_size=n)
    ref_ld = logit_diff(ref.flatten(0, 1), pb.clean_id.repeat(len(ref)), pb.corrupt_id.repeat(len(ref))).view(
        vlm.arch.n_layers, vlm.arch.n_heads, n
    )
    ds16 = patch_heads(vlm, pairs)
    return {
        "sites": len(edits),
        "pairs": n,
        "positions": "all",
        "repeats": repeats,
        "patch_heads_bs32_ms": ms(t["patch_heads_bs32"]),
        "patch_heads_default_bs16_ms": ms(t["patch_heads_default"]),
        "one_per_forward_sweep_ms": ms(t["one_per_forward_sweep"]),
        "naive_one_full_forward_per_head_ms": ms(t["naive_one_full_forward_per_head"]),
        "speedup_batched_vs_naive": round(t["naive_one_full_forward_per_head"] / t["patch_heads_bs32"], 3),
        "max_abs_diff_naive_vs_one_per_forward": float((naive - ref).abs().max()),
        "speedup_batched_vs_one_per_forward": round(t["one_per_forward_sweep"] / t["patch_heads_bs32"], 3),
        "speedup_default_vs_one_per_forward": round(t["one_per_forward_sweep"] / t["patch_heads_default"], 3),
        "goal": ">= 5",
        "max_abs_diff_logit_diff_patch_heads_bs32_vs_one_per_forward": float(
            (torch.from_numpy(ds["logit_diff"].values) - ref_ld).abs().max()
        ),
        "max_abs_diff_logit_diff_patch_heads_bs16_vs_one_per_forward": float(
            (torch.from_numpy(ds16["logit_diff"].values) - ref_ld).abs().max()
        ),
        "max_abs_diff_effect_bs16_vs_bs32": float(abs(ds16["effect"] - ds["effect"]).max()),
        "run_edits_max_rows_scan": scan,
        "others_load_cores": load.others,
        "scan_others_load_cores": load_scan.others,
    }


def bench_atp(vlm, pairs, repeats: int) -> dict:
    t, load = measured(
        lambda: interleaved(
            {"atp": lambda: attribution_patch(vlm, pairs), "exact": lambda: patch_heads(vlm, pairs)}, repeats
        )
    )
    atp, exact = attribution_patch(vlm, pairs), patch_heads(vlm, pairs)
    # Residual AtP against exact residual patching over (layer, group) for the three token groups. (Over
    # *all* positions exact patching sets the whole corrupt state, effect 1 at every layer; over image
    # tokens alone the exact effects are ~0 after layer 0, so a ranking of one group is mostly noise.)
    groups = ("image", "last", "text")
    resid_atp = xr.concat(
        [attribution_patch(vlm, pairs, positions=g).resid_effect for g in groups],
        dim=xr.DataArray(list(groups), dims="group"),
    )
    resid_exact = patch_layers(vlm, pairs, groups=groups, layers=range(vlm.arch.n_layers)).effect
    return {
        "repeats": repeats,
        "attribution_patch_ms": ms(t["atp"]),
        "patch_heads_ms": ms(t["exact"]),
        "speedup_atp_vs_exact": round(t["exact"] / t["atp"], 3),
        "others_load_cores": load.others,
        "heads": compare(atp.effect, exact.effect, k=5),
        "goal_spearman": ">= 0.8",
        "resid_layer_x_group": compare(resid_atp.transpose("layer", "group"), resid_exact, k=5),
        "resid_effect_atp": {g: [round(float(x), 3) for x in resid_atp.sel(group=g).values] for g in groups},
        "resid_effect_exact": {g: [round(float(x), 3) for x in resid_exact.sel(group=g).values] for g in groups},
    }


def status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def peak_child(n: int) -> dict:
    """One sweep in a fresh process. ru_maxrss starts at the parent's RSS (exec keeps the forking
    mm's high-water mark), so the parent runs this before it loads anything; VmHWM, reset through
    /proc/self/clear_refs just before the sweep, gives the sweep's own peak as a cross-check."""
    torch.set_num_threads(THREADS)
    rss = lambda: round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # noqa: E731  KiB → MiB
    at_start = rss()
    vlm = countlens.load("toy")
    pairs = count_pairs(n, grid=vlm.geometry, **PAIRS_KW)
    before = rss()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    hwm_reset = status_mib("VmHWM")
    t = time.perf_counter()
    with Load() as load:
        patch_layers(vlm, pairs, groups=("image", "last", "text"), batch_size=16)
    return {
        "pairs": n,
        "maxrss_at_start_mib": at_start,
        "maxrss_before_sweep_mib": before,
        "maxrss_after_sweep_mib": rss(),
        "sweep_delta_mib": round(rss() - before, 1),
        "vmhwm_reset_mib": hwm_reset,
        "vmhwm_after_sweep_mib": status_mib("VmHWM"),
        "sweep_own_peak_mib": round(status_mib("VmHWM") - hwm_reset, 1),
        "sweep_s_cold": round(time.perf_counter() - t, 2),
        "others_load_cores": load.others,
    }


def bench_memory(sizes=(16, 32, 64, 128)) -> dict:
    """Each size in a fresh process, with glibc malloc as it comes and with large blocks forced to mmap
    (``MALLOC_MMAP_THRESHOLD_``): a peak that grows only under the former is heap fragmentation, not
    data kept across chunks."""
    out: dict = {"batch_size": 16, "goal": "flat (chunks streamed)"}
    for label, extra in (("default_malloc", {}), ("mmap_threshold_128k", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
        rows = []
        for n in sizes:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", **extra}

            def child(n=n, env=env):
                proc = subprocess.run(
                    [sys.executable, __file__, "--peak-mem", str(n)],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                return json.loads(proc.stdout.strip().splitlines()[-1])

            rows.append(measured(child)[0])
        peaks = [r["maxrss_after_sweep_mib"] for r in rows]
        own = [r["sweep_own_peak_mib"] for r in rows]
        out[label] = {
            "sizes": rows,
            "maxrss_spread_mib": round(max(peaks) - min(peaks), 1),
            "sweep_own_peak_spread_mib": round(max(own) - min(own), 1),
        }
    return out


def main(n_pairs: int = 32, repeats: int = 5) -> dict:
    torch.set_num_threads(THREADS)
    load_start, src_start = os.getloadavg(), source_digest()
    memory = bench_memory()  # first, while this process is small (see `peak_child`)
    vlm = countlens.load("toy")
    pairs = count_pairs(n_pairs, grid=vlm.geometry, **PAIRS_KW)
    import nnsight
    import transformers

    result = {
        "model": "toy",
        "layers": vlm.arch.n_layers,
        "heads": vlm.arch.n_heads,
        "pairs": n_pairs,
        "pairs_kw": {**PAIRS_KW, "counts": "range(2, 9)"},
        "threads": THREADS,
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "nnsight": nnsight.__version__,
            "processor": platform.processor() or platform.machine(),
        },
    }
    result["a_layers_vs_plain"] = bench_layers(vlm, pairs, repeats)
    result["b_heads_batched_vs_one_per_forward"] = bench_heads(vlm, pairs, max(3, repeats - 2))
    result["c_atp_vs_exact"] = bench_atp(vlm, pairs, repeats)
    result["d_peak_memory"] = memory
    result["source_sha256"] = {"start": src_start, "end": source_digest()}
    result["library"] = {
        "snapshot_of": os.environ.get("COUNTLENS_BENCH_SNAPSHOT"),
        "ran_from": str(Path(countlens.__file__).parent),
    }
    result["loadavg_1_5_15"] = {
        "start": [round(x, 2) for x in load_start],
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peak-mem":
        print(json.dumps(peak_child(int(sys.argv[2]))))
    else:
        print(json.dumps(main(), indent=2))
