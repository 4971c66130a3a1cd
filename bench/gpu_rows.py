"""The rows of ``bench/gpu.py --all`` / ``--quick`` / ``--dry-run OUT --all``: every capability once on a
random-init Qwen2.5-VL at 7B widths (`wide_model.build`), each row timed, its peak read, beside the
plan's figure where a plan exists.

Rows, in order (``Sizes`` gives each mode's counts and per-row time budgets):

- ``build``: the model, built once at the deepest depth any row needs (planned peak: its weights);
- ``check``: `countlens check` (`countlens.pipeline.selfcheck`), its rows recorded (not in ``--quick``);
- ``trace``: an nnsight trace saving one residual beside the plain forward of the same clean batch;
- ``discover/<stage>``: discover's stages through the registry (`countlens.pipeline.stages.STAGES`),
  in discover's order, each stage's ``compute`` and ``check`` as discover's loop runs them (no
  report), one row each; planned: `countlens.pipeline.plan.plan` of the same config on this device;
- ``transcoders``: a few `train_transcoders` steps at the middle layer; planned:
  `countlens.pipeline.transcoder_cost` (its own rates);
- ``graph``: one `attribution_graph` with ``max_features``, random TopK transcoders on every layer;
  planned: `countlens.pipeline.graph_cost.graph_cost` of the same prompt and settings;
- ``finetune``: focus fine-tune steps (LoRA, λ_focus 1 at the middle layer; no plan exists);
- ``patch_heads`` and ``peer_head_loop``: the all-head sweep, and beside it the loop a TransformerLens
  user writes (one full forward per head, that head's z patched from the corrupt run: the naive loop
  of ``bench/patching_sweeps.py``), run for its time box and scaled to every head (no plan);
- ``edges_depth_<d>``: one edge-ablated forward against a plain one (``bench/edge_forward.py``'s
  `measure`) with the model cut to its first ``d`` text layers and vision blocks (`at_depth`: the
  architecture `build(d)` makes, the first ``d`` layers' weights; nothing rebuilt); the plan's ratio.

Times: wall seconds of the row (synchronised on a GPU). Peaks: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats`` on a GPU; on the CPU the process's ``VmHWM`` after a reset
(``/proc/self/clear_refs``, as ``bench/plan_rehearsal.py`` reads it). Planned seconds: the plan's
FLOPs at the rate the header names (on a GPU `graph_cost.GPU_FLOPS`, an assumption, not a
measurement). Each row is written to the JSON as it ends, so a run cut short keeps what finished.
A row that runs past its budget is stopped (SIGALRM) and marked ``over_budget``; a row that raises
is marked ``error`` and the run goes on (the script's exit status says so).
"""

from __future__ import annotations

import json
import platform
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _rehearsal import read_peak, reset_peak
from wide_model import WIDTHS, build, sync


@dataclass(frozen=True)
class Sizes:
    """One mode's counts. ``budgets``: seconds per row (one ``discover`` budget for all its stages;
    ``edges``: (seconds, seconds per layer) at each depth); none: no budget (the CPU dry run, whose
    times are not results). The GPU budgets sum to under the mode's limit, build and start-up included."""

    depth: int
    image_size: int
    dtype: str
    curve: tuple[int, ...]  # depths of the edge-forward curve
    discover: dict  # DiscoverConfig fields
    stages: tuple[str, ...] | None  # discover's stages run (None: every one the config enables)
    pairs: int  # pairs of the trace, patch_heads, the peer loop and the edge forwards
    repeats: int
    warmup: bool
    tc_width: int
    tc_steps: int
    tc_mix: dict
    graph_width: int
    graph_max_features: int
    graph_batch: int
    ft_steps: int
    ft_batch: int
    peer_seconds: float  # the peer loop's time box (at least one head runs)
    check: bool = True
    tiled_init: bool = False
    k: int = 16
    budgets: dict = field(default_factory=dict)


_SMALL = dict(n_per_case=1, batch_size=4)
#: An H100 (80 GB): ≤ 8 min in all. Budgets from the plan's FLOPs at the rates the H200 run measured
#: (bench/gpu.json) plus per-stage overheads: an estimate, not a GPU measurement.
ALL = Sizes(
    depth=28,
    image_size=448,
    dtype="bfloat16",
    curve=(4, 8, 16, 28),
    discover=dict(n_pairs=4, n_samples=4, **_SMALL),
    stages=None,
    pairs=4,
    repeats=1,
    warmup=True,
    tc_width=16384,
    tc_steps=8,
    tc_mix={"count": 8, "text": 8},
    graph_width=16384,
    graph_max_features=1024,
    graph_batch=32,  # graph_cost: 47 GiB on the device at depth 28 (64 rows: 71 GiB, too near 80)
    ft_steps=20,
    ft_batch=4,
    peer_seconds=12.0,
    budgets=dict(build=40, check=30, trace=10, discover=160, transcoders=30, graph=40, finetune=35)
    | dict(patch_heads=25, peer_head_loop=20, edges=(4.0, 0.5)),
)
#: ≤ 3 min: no check, six stages (the node, object and edge stages among them), fewer steps and depths.
QUICK = Sizes(
    depth=28,
    image_size=448,
    dtype="bfloat16",
    curve=(4, 28),
    discover=dict(n_pairs=2, n_samples=2, tasks=("count",), **_SMALL),
    stages=("cases", "vap", "heads", "eap_ig", "objects", "edge_faithfulness"),
    pairs=2,
    repeats=1,
    warmup=True,
    tc_width=16384,
    tc_steps=3,
    tc_mix={"count": 4, "text": 4},
    graph_width=16384,
    graph_max_features=256,
    graph_batch=32,  # graph_cost: 47 GiB on the device at depth 28 (64 rows: 71 GiB, too near 80)
    ft_steps=5,
    ft_batch=2,
    peer_seconds=3.0,
    check=False,
    budgets=dict(build=25, trace=6, discover=50, transcoders=12, graph=15, finetune=12, patch_heads=10)
    | dict(peer_head_loop=6, edges=(3.0, 0.4)),
)
#: The CPU dry run (the tests): depth 1 (the curve at 1 and 2), fp32, 140 px (the smallest at which every
#: stage's inputs, so the plan, can be made), 1 pair, 1–2 steps; two cheap stages (gradients, a reader;
#: the sweeps have their own rows): all of them cost minutes on this CPU at 7B widths (the plan's
#: 16 TFLOP, about 2 min; `bench/plan_rehearsal.py` runs every stage at these widths).
DRY = Sizes(
    depth=1,
    image_size=140,
    dtype="float32",
    curve=(1, 2),
    discover=dict(n_pairs=1, n_samples=1, n_per_case=1, batch_size=2, tasks=("count",), methods=("exact",)),
    stages=("atp", "lens"),
    pairs=1,
    repeats=1,
    warmup=False,
    tc_width=256,
    tc_steps=2,
    tc_mix={"count": 1, "text": 1},
    graph_width=256,
    graph_max_features=16,
    graph_batch=8,
    ft_steps=1,
    ft_batch=1,
    peer_seconds=0.0,
    tiled_init=True,
)
MODES = {"all": ALL, "quick": QUICK, "dry_run": DRY}


class OverBudget(BaseException):
    """A row ran past its time budget (a BaseException, as KeyboardInterrupt is: a library's ``except
    Exception`` does not swallow it)."""


@contextmanager
def time_limit(seconds: float | None):
    """Raise `OverBudget` in this (main) thread once ``seconds`` have passed (None: no limit)."""
    if seconds is None:
        yield
        return

    def fire(signum, frame):
        raise OverBudget(f"over its {seconds:g} s budget")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Recorder:
    """The rows so far, under ``key`` of the JSON at ``path`` (its other keys kept), rewritten after each row."""

    def __init__(self, path: Path, key: str, header: dict, device: str):
        self.path, self.key, self.device = path, key, device
        self.record = {**header, "rows": []}
        self.failed: list[str] = []
        self.write()

    def write(self) -> None:
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        data[self.key] = self.record
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.path)

    def row(self, name: str, fn, budget: float | None = None, planned: tuple = (None, None)) -> dict | None:
        """Run ``fn()`` as the row ``name``; its dict's keys join the row (``planned_seconds`` /
        ``planned_peak_bytes`` in it replace ``planned``). Returns that dict, None if the row failed."""
        reset_peak(self.device)
        t0, status, extra = time.perf_counter(), "ok", {}
        try:
            with time_limit(budget):
                extra = fn() or {}
                sync(self.device)
        except OverBudget as err:
            status, extra = "over_budget", {"error": str(err)}
        except Exception as err:  # noqa: BLE001 — recorded, and the run goes on to the next row
            traceback.print_exc()
            status, extra = "error", {"error": f"{type(err).__name__}: {err}"[:600]}
        seconds = time.perf_counter() - t0
        row = {
            "name": name,
            "seconds": round(seconds, 3),
            "peak_bytes": read_peak(self.device),
            "planned_seconds": planned[0],
            "planned_peak_bytes": planned[1],
            "budget_s": budget,
            "status": status,
            **extra,
        }
        self.record["rows"].append(row)
        if status != "ok":
            self.failed.append(name)
        self.write()
        print(
            f"{name}: {status} {seconds:.1f} s, peak {row['peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True
        )
        return None if status != "ok" else extra


@contextmanager
def at_depth(vlm, depth: int):
    """``vlm`` cut to its first ``depth`` text layers and vision blocks (fully attending blocks kept where
    they fall), as a `VLM` of its own over the same weights; the whole model is put back afterwards."""
    from countlens.model.vlm import VLM

    if depth == vlm.arch.n_layers:
        yield vlm
        return
    hf = vlm.hf
    text, vision = hf.model.language_model, hf.model.visual
    tc, vc = hf.config.text_config, hf.config.vision_config
    saved = (text.layers, vision.blocks, tc.num_hidden_layers, vc.depth, vision.fullatt_block_indexes)
    types = getattr(tc, "layer_types", None)
    try:
        text.layers = torch.nn.ModuleList(list(saved[0])[:depth])
        vision.blocks = torch.nn.ModuleList(list(saved[1])[: min(depth, 32)])
        tc.num_hidden_layers, vc.depth = depth, min(depth, 32)
        vision.fullatt_block_indexes = [i for i in saved[4] if i < vc.depth]
        if types is not None:
            tc.layer_types = types[:depth]
        cut = VLM(hf, vlm.processor, name=f"qwen2.5-vl-7b-widths-depth{depth}")
        assert cut.arch.n_layers == depth, (cut.arch.n_layers, depth)
        yield cut
    finally:
        text.layers, vision.blocks, tc.num_hidden_layers, vc.depth, vision.fullatt_block_indexes = saved
        if types is not None:
            tc.layer_types = types


def rate(device: str) -> tuple[float, str]:
    """(FLOP/s, where it comes from) that turns the plans' FLOPs into planned seconds."""
    from countlens.pipeline.graph_cost import CPU_FLOPS, GPU_FLOPS

    if device.startswith("cuda"):
        return (
            GPU_FLOPS,
            "countlens.pipeline.graph_cost.GPU_FLOPS: an assumed 40 % of an H200's bf16 peak, not measured",
        )
    threads = torch.get_num_threads()
    return CPU_FLOPS * threads, f"graph_cost.CPU_FLOPS (one thread, calibrated) × {threads} threads"


def guarded(rec: Recorder, name: str, fn) -> None:
    """``fn()``, which records rows of its own; what it raises outside them is an ``error`` row ``name``."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 — recorded, and the run goes on
        traceback.print_exc()
        rec.record["rows"].append({"name": name, "status": "error", "error": f"{type(err).__name__}: {err}"[:600]})
        rec.failed.append(name)
        rec.write()


def run_all(s: Sizes, out: Path, key: str, device: str) -> Recorder:
    """Every row of mode ``s`` into ``out``'s ``key`` (the module's docstring)."""
    from countlens.datasets.pairs import count_pairs

    flops_per_s, source = rate(device)
    header = {
        "mode": key,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": s.dtype,
        "depth": s.depth,
        "image_size": s.image_size,
        "widths": WIDTHS,
        "sizes": {k: v for k, v in vars(s).items() if k != "budgets"},
        "budgets_s": s.budgets,
        "planned_rate_flops_per_s": flops_per_s,
        "planned_rate": source,
        "finished": False,
    }
    rec = Recorder(out, key, header, device)
    t_start = time.perf_counter()
    made = {}

    def build_row():
        made["vlm"], made["grid"] = build(
            max(s.depth, *s.curve), s.image_size, getattr(torch, s.dtype), device, tiled_init=s.tiled_init
        )
        from countlens.model.memory import widths

        w = widths(made["vlm"])
        return {"parameters": sum(p.numel() for p in made["vlm"].hf.parameters()), "planned_peak_bytes": w.weight_bytes}

    if rec.row("build", build_row, s.budgets.get("build")) is None:
        return rec
    full = made["vlm"]
    pairs = count_pairs(s.pairs, kind="dots", grid=made["grid"], prompt="short", counts=range(2, 8), seed=0)
    from gpu_steps import discover_rows, finetune_row, graph_row, peer_rows, trace_row, transcoder_row

    with at_depth(full, s.depth) as vlm:
        if s.check:
            from countlens.pipeline.selfcheck import as_json, check

            rec.row("check", lambda: {"check": as_json(check(vlm))}, s.budgets.get("check"))
        rec.row("trace", lambda: trace_row(vlm, pairs, s, device), s.budgets.get("trace"))
        guarded(rec, "discover", lambda: discover_rows(rec, vlm, s, device, flops_per_s))
        rec.row("transcoders", lambda: transcoder_row(vlm, s, device), s.budgets.get("transcoders"))
        rec.row("graph", lambda: graph_row(vlm, s, device, flops_per_s), s.budgets.get("graph"))
        rec.row("finetune", lambda: finetune_row(vlm, s), s.budgets.get("finetune"))
        guarded(rec, "patch_heads", lambda: peer_rows(rec, vlm, pairs, s, device))
    from edge_forward import measure

    base, per_layer = s.budgets.get("edges", (None, 0.0))
    for depth in s.curve:
        with at_depth(full, depth) as vlm:
            rec.row(
                f"edges_depth_{depth}",
                lambda vlm=vlm: measure(vlm, pairs, s.repeats, device, s.warmup),
                None if base is None else base + per_layer * depth,
            )
    rec.record.update(finished=True, total_s=round(time.perf_counter() - t_start, 1), failed=rec.failed)
    rec.write()
    return rec
