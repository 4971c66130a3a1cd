"""The logit lens: the gold answer's rank and probability read off each layer's residual stream at the
last prompt token, through the final norm and the unembedding. The report's section gives the first
layer from which the answer is the top token (median rank 0).
"""

from __future__ import annotations

from countlens import circuits
from countlens.analysis import plots
from countlens.pipeline.costs import Forward, Planner, StagePlan, chunk_sizes
from countlens.pipeline.stages.base import ReportContext, Section, Stage


def _plan(p: Planner) -> StagePlan:
    w, samples = p.w, p.samples("tasks")["count"]
    seq = p.seq(samples, forced=True)
    a = max(len(p.vlm.answer_ids(s.answer)) for s in samples)
    fw = [Forward(n, seq, count=k, extra=n * a * w.vocab * 12) for n, k in chunk_sizes(len(samples), p.bs).items()]
    return StagePlan("lens", fw, batch=p.bs)


LENS = Stage(
    "lens",
    inputs=("tasks",),
    compute=lambda run: circuits.logit_lens(run.vlm, run.data["count"], batch_size=run.batch_size),
    plan=_plan,
    variables={"rank": ("layer", "sample"), "prob": ("layer", "sample")},
)


def _values(ctx: ReportContext) -> dict:
    lens = ctx.results["lens"]
    decoded = next((int(la) for la in lens.layer.values if float(lens["rank"].sel(layer=la).median()) == 0), None)
    return {"lens": {"decoded_layer": decoded, "final_p_gold": float(lens.prob.isel(layer=-1).mean())}}


def _draw(ctx: ReportContext) -> None:
    plots.plot_lens(ctx.results["lens"], ctx.figures / "lens.png")
    plots.plot_rank_emergence(ctx.results["lens"], ctx.figures / "lens_rank1.png")


SECTION = Section("lens.md.j2", _values, _draw)
