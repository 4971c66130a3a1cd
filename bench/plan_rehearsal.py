"""The 7B-width rehearsal of `countlens plan`: every discover stage, planned and measured, on CPU.

    python bench/plan_rehearsal.py                  # depths 1 and 2, 448 px → bench/plan_rehearsal.json
    python bench/plan_rehearsal.py --depths 1 --image-size 224 --out /tmp/r.json   # a quicker check
    python bench/plan_rehearsal.py --replan           # the recorded runs against the current plan
    python bench/plan_rehearsal.py --remeasure headlens   # one stage measured again, alone, at each depth
    python bench/plan_rehearsal.py --remeasure edge_faithfulness   # the edge stage (not in discover's default)

Each depth runs in a fresh process: a random-init Qwen2.5-VL at Qwen2.5-VL-7B's widths
(`bench/gpu.py`'s `build`: text hidden 3,584, 28 heads, 4 KV heads, intermediate 18,944, vocabulary
152,064; vision width 1,280), ``--depth`` text layers and as many vision blocks, fp32, the real Qwen
vocabulary (so answers are multi-token and discover scores candidates), then:

1. `countlens.pipeline.plan.plan` on the loaded model (memory: what is free now plus the weights);
2. `countlens.pipeline.discover` at small n, each stage's peak resident set read from ``VmHWM`` (reset
   through ``/proc/self/clear_refs`` at the stage's start, after ``malloc_trim``) and its wall time.

Written: per depth and stage, planned and measured peak (bytes, ratio), planned FLOPs and seconds;
then at 28 layers: each stage's CPU time extrapolated linearly from depths 1 and 2, and the plan of
the default discover in bf16 on a 141 GiB GPU (the H200's), its time from the FLOPs at an assumed
utilisation of the H200's dense bf16 peak (an assumption, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
H200_BF16_FLOPS = 989e12  # dense bf16 peak, from NVIDIA's H200 datasheet
ASSUMED_UTILISATION = 0.4


ALONE = ("headlens", "edge_faithfulness")


def _alone(vlm, c, name: str, log) -> None:
    """Run only discover's stage ``name`` on its own samples (`--remeasure`): HeadLens's fit + decode,
    or the edge stage (EAP-IG and EAP, then the curves of their circuits and the random ones)."""
    from types import SimpleNamespace

    from countlens import circuits
    from countlens.pipeline.config import resolved_prompt
    from countlens.pipeline.inputs import stage_inputs
    from countlens.pipeline.stages.edges import _compute

    if name not in ALONE:
        sys.exit(f"--remeasure takes {' / '.join(ALONE)}, not {name}; run the whole rehearsal instead")
    inputs = stage_inputs(vlm, c, resolved_prompt(vlm, c))
    if name == "edge_faithfulness":
        pairs = inputs["pairs"]()
        log(f"[{name}] running")
        ds = _compute(SimpleNamespace(vlm=vlm, pairs=pairs, batch_size=c.batch_size, config=c))
        if "refused" in ds.attrs:
            sys.exit(ds.attrs["refused"])
        return
    fit, data = inputs["headlens_fit"](), inputs["tasks"]()["count"]
    log(f"[{name}] running")
    circuits.HeadLens.fit(vlm, fit, batch_size=c.batch_size).decode(vlm, data, batch_size=c.batch_size)


def one_depth(depth: int, image_size: int, config: dict, only: list[str] | None = None) -> dict:
    """Plan, then run, discover on the depth-``depth`` model in this process (or only the stages ``only``)."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from _rehearsal import read_peak, reset_peak
    from wide_model import build

    from countlens.pipeline import plan
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.discover import discover

    torch.set_num_threads(os.cpu_count() or 1)
    vlm, _ = build(depth, image_size, torch.float32, "cpu", real_vocab=True)
    c = DiscoverConfig(**config)
    t = time.perf_counter()
    p = plan.plan(vlm, c)  # its defaults: memory free now + weights, base = resident set − weights
    plan_s = time.perf_counter() - t
    measured: dict[str, dict] = {}
    current: list = [None, 0.0]

    def close() -> None:
        if current[0] is not None:
            measured[current[0]] = {"peak_bytes": read_peak(), "seconds": round(time.perf_counter() - current[1], 1)}
            print(f"depth {depth} {current[0]}: {measured[current[0]]}", file=sys.stderr, flush=True)

    def log(line: str) -> None:
        if line.startswith("[") and line.endswith("] running"):
            close()
            reset_peak()
            current[:] = [line[1:].split("]")[0], time.perf_counter()]

    if only:
        for name in only:
            _alone(vlm, c, name, log)
        close()
    else:
        with tempfile.TemporaryDirectory() as out:
            discover(vlm, out, c, log=log)
            close()
    planned = p.to_dict()
    stages = {}
    for name, m in measured.items():
        q = planned["stages"][name]
        stages[name] = {
            "planned_peak_bytes": q["peak_bytes"],
            "measured_peak_bytes": m["peak_bytes"],
            "ratio": round(m["peak_bytes"] / q["peak_bytes"], 3),
            "rows": q["rows"],
            "forwards": q["forwards"],
            "planned_flops": q["flops"],
            "seconds": m["seconds"],
            "cpu_gflops_per_s": round(q["flops"] / max(m["seconds"], 1e-9) / 1e9, 1),
        }
    return {
        "depth": depth,
        "image_size": image_size,
        "base_bytes": p.base,
        "weights_bytes": p.widths.weight_bytes,
        "memory_bytes": p.memory,
        "plan_seconds": round(plan_s, 1),
        "stages": stages,
    }


def extrapolate(runs: list[dict], image_size: int, config: dict) -> dict:
    """Two things at 28 layers: each stage's CPU seconds at the rehearsal's sizes, linear in depth from
    depths 1 and 2 (and whether time tracks the planned FLOPs: seconds per TFLOP at both depths);
    and the plan of the default `countlens discover` in bf16 on a 141 GiB GPU (the H200's), its
    time from the FLOPs at an assumed utilisation."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from wide_model import build

    from countlens.pipeline import plan
    from countlens.pipeline.config import DiscoverConfig

    by_depth = {r["depth"]: r["stages"] for r in runs}
    cpu = {}
    if 1 in by_depth and 2 in by_depth:
        for name in by_depth[1]:
            a, b = by_depth[1][name], by_depth[2].get(name)
            if b is None:
                continue
            cpu[name] = {
                "seconds_depth_28": round(a["seconds"] + 27 * (b["seconds"] - a["seconds"])),
                "s_per_tflop": [round(x["seconds"] / (x["planned_flops"] / 1e12), 2) for x in (a, b)],
            }
    vlm, _ = build(28, image_size, torch.bfloat16, "meta", real_vocab=True)
    default = DiscoverConfig()
    p = plan.plan(vlm, default, memory=141 * 2**30, device="cuda").to_dict()
    gpu = {
        name: {
            "planned_peak_gib": round(q["peak_bytes"] / 2**30, 2),
            "rows": q["rows"],
            "forwards": q["forwards"],
            "tflop": round(q["flops"] / 1e12, 1),
            "seconds_at_assumed_utilisation": round(q["flops"] / (H200_BF16_FLOPS * ASSUMED_UTILISATION), 1),
        }
        for name, q in p["stages"].items()
    }
    return {
        "cpu_at_rehearsal_sizes": cpu,
        "h200_default_discover": {
            "config": {k: getattr(default, k) for k in ("n_per_case", "n_pairs", "n_samples", "batch_size")},
            "weights_gib": round(p["weights_bytes"] / 2**30, 2),
            "stages": gpu,
            "assumption": f"{ASSUMED_UTILISATION:.0%} of {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s dense bf16, not measured",
        },
    }


def _depth_in_subprocess(depth: int, image_size: int, config: dict, only: list[str] | None = None) -> dict:
    """`one_depth` in a fresh process (each stage's figures go to its stderr); exits if it failed."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        str(depth),
        "--image-size",
        str(image_size),
        *(x for k, v in config.items() for x in (f"--{k.replace('_', '-')}", str(v))),
        *(["--only", *only] if only else []),
    ]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("REHEARSAL ")), None)
    if line is None:
        sys.exit(f"depth {depth} failed (its traceback is above)")
    return json.loads(line[len("REHEARSAL ") :])


def replan(result: dict) -> dict:
    """Recompute the planned side of a recorded rehearsal with the current `countlens.pipeline.plan` (on meta
    models with the recorded memory and runtime base, so the sweeps get the same rows) against its
    measured side, unchanged; the earlier planned peaks are kept as ``previous_planned_peak_bytes``."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from wide_model import build

    from countlens.pipeline import plan
    from countlens.pipeline.config import DiscoverConfig

    for run in result["runs"]:
        vlm, _ = build(run["depth"], result["image_size"], torch.float32, "meta", real_vocab=True)
        config = DiscoverConfig(**result["config"])
        q = plan.plan(vlm, config, memory=run["memory_bytes"], device="cpu", base=run["base_bytes"]).to_dict()["stages"]
        for name, st in run["stages"].items():
            if "memory_bytes" in st:  # measured alone, later: planned with that process's memory and base
                alone = plan.plan(vlm, config, memory=st["memory_bytes"], device="cpu", base=st["base_bytes"])
                q[name] = alone.to_dict()["stages"][name]
            if q[name]["rows"] != st["rows"]:
                sys.exit(
                    f"depth {run['depth']} {name}: the current plan stacks {q[name]['rows']} rows, the "
                    f"measured run {st['rows']}; measure again instead"
                )
            st.setdefault("previous_planned_peak_bytes", st["planned_peak_bytes"])
            st["planned_peak_bytes"] = q[name]["peak_bytes"]
            st["ratio"] = round(st["measured_peak_bytes"] / st["planned_peak_bytes"], 3)
    result["depth_28"] = extrapolate(result["runs"], result["image_size"], result["config"])
    return result


def remeasure(result: dict, names: list[str]) -> dict:
    """Measure the stages ``names`` again, alone, at each recorded depth, and put their figures in the
    record (the earlier ones kept as ``previous_measured_peak_bytes``); the other stages are replanned."""
    for run in result["runs"]:
        alone = _depth_in_subprocess(run["depth"], result["image_size"], result["config"], names)
        fresh = alone["stages"]
        for name in names:
            # the rows of a memory-bound stage follow the memory free in that process: kept to replan it
            fresh[name].update(memory_bytes=alone["memory_bytes"], base_bytes=alone["base_bytes"])
            old = run["stages"].get(name, {})  # a stage the full rehearsal does not run: measured alone only
            if "measured_peak_bytes" in old:
                fresh[name]["previous_measured_peak_bytes"] = old.get(
                    "previous_measured_peak_bytes", old["measured_peak_bytes"]
                )
            fresh[name]["measured_alone"] = True
            if "previous_planned_peak_bytes" in old:  # the plan before any correction, as replan keeps it
                fresh[name]["previous_planned_peak_bytes"] = old["previous_planned_peak_bytes"]
            run["stages"][name] = fresh[name]
    return replan(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--n-pairs", type=int, default=2)
    ap.add_argument("--n-samples", type=int, default=2)
    ap.add_argument("--n-per-case", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one depth, print JSON
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    ap.add_argument("--replan", action="store_true", help="recompute the planned side of --out's rehearsal")
    ap.add_argument(
        "--remeasure",
        nargs="+",
        metavar="STAGE",
        help="measure these stages again, alone (headlens, edge_faithfulness), into --out's record",
    )
    ap.add_argument("--only", nargs="+", help=argparse.SUPPRESS)  # internal: with --one
    args = ap.parse_args()
    if args.remeasure or args.replan:
        recorded = json.loads(args.out.read_text())
        result = remeasure(recorded, args.remeasure) if args.remeasure else replan(recorded)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({r["depth"]: {k: v["ratio"] for k, v in r["stages"].items()} for r in result["runs"]}))
        return
    config = dict(
        n_pairs=args.n_pairs, n_samples=args.n_samples, n_per_case=args.n_per_case, batch_size=args.batch_size
    )
    if args.one is not None:
        print("REHEARSAL " + json.dumps(one_depth(args.one, args.image_size, config, args.only)))
        return
    runs = []
    for depth in args.depths:
        runs.append(_depth_in_subprocess(depth, args.image_size, config))
        print(json.dumps({k: v for k, v in runs[-1]["stages"].items()}, indent=1), flush=True)
    result = {
        "config": config,
        "image_size": args.image_size,
        "cpu_threads": os.cpu_count(),
        "runs": runs,
        "depth_28": extrapolate(runs, args.image_size, config),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["depth_28"], indent=1))


if __name__ == "__main__":
    main()
