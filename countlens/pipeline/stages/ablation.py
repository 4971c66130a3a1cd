"""Mean ablation of every head on each of the run's tasks, and the overlap of the tasks' top heads.

Each head's z is replaced by its mean over the task's samples, one head at a time, and the drop in
log p(gold) recorded (a sweep: split between the ranks of a sharded run, streamed so a killed run
resumes mid-sweep). The report's section names each task's top heads and their Jaccard overlaps.
"""

from __future__ import annotations

import warnings

import xarray as xr

from countlens import circuits
from countlens.analysis import plots
from countlens.analysis.heads import RESULT_DIMS
from countlens.analysis.tables import finite_markdown
from countlens.labels import head_label
from countlens.model.answers import answer_window
from countlens.pipeline.costs import Forward, Planner, StagePlan, chunk_sizes, stacked, sweep_rows
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage


def _ablation(run: RunContext) -> xr.Dataset:
    return circuits.ablation_scan(
        run.vlm, run.data, batch_size=run.batch_size, store=run.store("ablation"), progress=True, shard=run.shard
    )


def _plan(p: Planner) -> StagePlan:
    w, b = p.w, p.w.act_bytes
    dz = w.n_heads * w.d_head
    firsts = [la for la in range(w.n_layers) for _ in range(w.n_heads)]
    fw, kept, host, rows = [], 0, 0, 0
    for samples in p.samples("tasks").values():
        seq = p.seq(samples, forced=True)
        keep = answer_window([p.vlm.answer_ids(s.answer) for s in samples[: p.bs]])
        n0 = min(p.bs, len(samples))
        task_kept = w.n_layers * n0 * seq * dz * b  # the means pass saves every layer's z
        edit_values = w.n_layers * n0 * seq * (dz * 4 + w.n_heads)  # float32 values and masks, per head
        rows = sweep_rows(w, seq, p.free - (edit_values if p.vlm.device.type == "cpu" else 0), 0, keep, p.patches)
        kept, host = max(kept, task_kept), max(host, edit_values)
        for n, k in chunk_sizes(len(samples), p.bs).items():
            fw += [Forward(n, seq, count=k), Forward(n, seq, count=k, keep=keep)]
            fw += stacked(w, firsts, n, seq, rows, keep, k, p.patches, extra_per_row=keep * w.vocab * 4)
    return StagePlan("ablation", fw, kept=kept, host=host, rows=rows, batch=p.bs)


ABLATION = Stage(
    "ablation",
    inputs=("tasks",),
    compute=_ablation,
    plan=_plan,
    sweep=True,
    variables=RESULT_DIMS["ablation"][1],
)


def _reasoning_sources(spec: dict, tasks: list[str]) -> dict[str, str]:
    """Where each reasoning task of the ablation came from: a local copy's path, or "" (procedural)."""
    return {t: spec.get(t, "") for t in ("math", "spatial") if t in tasks}


def _values(ctx: ReportContext) -> dict:
    abl = ctx.results["ablation"]
    jk = int(ctx.spec["jaccard_k"])
    jac = circuits.jaccard(abl, k=jk)
    tops = {t: ", ".join(map(head_label, v)) for t, v in circuits.top_heads(abl, k=jk).items()}
    return {
        "ablation": {
            "k": jac.attrs["k"],
            "k_requested": jac.attrs.get("k_requested", jac.attrs["k"]),
            "top_heads": "; ".join(f"{t}: {v}" for t, v in tops.items()),
            "jaccard_table": finite_markdown(jac.to_pandas().round(2)),
            "reasoning": _reasoning_sources(ctx.spec, [str(t) for t in abl.task.values]),
        }
    }


def _draw(ctx: ReportContext) -> None:
    plots.plot_heatmap(
        ctx.results["ablation"].logp_drop.sel(task="count"),
        ctx.figures / "ablation_count.png",
        "Mean ablation: drop in log p(gold), counting",
        center=True,
    )
    with warnings.catch_warnings():  # a k beyond the model's heads: _values has warned already
        warnings.simplefilter("ignore")
        jac = circuits.jaccard(ctx.results["ablation"], k=int(ctx.spec["jaccard_k"]))
    plots.plot_matrix(jac, ctx.figures / "jaccard.png", f"Jaccard overlap of the tasks' top-{jac.attrs['k']} heads")


SECTION = Section("ablation.md.j2", _values, _draw)
