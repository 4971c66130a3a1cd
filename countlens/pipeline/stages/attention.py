"""HeadLens and where the heads look: the HeadLens maps and their decoded tokens, the share of each
head's attention on the image tokens, and the attention diagnostics on COUNTINGTRICKS scenes.

``headlens`` fits a linear map per layer from a head's output to the residual stream it writes (on the
organism's three trained tasks) and decodes each head on the counting samples (VGS, CTER);
``attention`` is each head's attention share on image tokens at the last token; ``attention_metrics``
gives MAS, VRA, Attention-IoU and ARS per layer, split by right and wrong answers. The report's
section also carries the probes' AP@50 when the run has a ``probes`` stage.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from countlens import circuits
from countlens.analysis import plots
from countlens.analysis.attention_metrics import aggregate, attention_metrics
from countlens.analysis.heads import RESULT_DIMS
from countlens.analysis.tables import finite_markdown
from countlens.errors import RunDirError
from countlens.labels import head_label, top_sites
from countlens.pipeline.costs import Forward, Planner, StagePlan, chunk_sizes, score_rows
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage
from countlens.pipeline.stages.probes import summary as probes_summary
from countlens.reference.counting_to_four.attention import modality_shares as reference_shares


def _headlens(run: RunContext) -> xr.Dataset:
    bs = run.batch_size
    lens = circuits.HeadLens.fit(run.vlm, run.inputs["headlens_fit"](), batch_size=bs)
    return lens.decode(run.vlm, run.data["count"], batch_size=bs)


def _plan_headlens(p: Planner) -> StagePlan:
    w, b = p.w, p.w.act_bytes
    fit, decode = p.samples("headlens_fit"), p.samples("tasks")["count"]
    seq = p.seq(fit)
    n0 = min(p.bs, len(fit))
    fw = [Forward(n, seq, count=k) for n, k in chunk_sizes(len(fit), p.bs).items()]
    fw += [
        Forward(n, p.seq(decode), count=k, extra=n * w.n_heads * w.vocab * 8)
        for n, k in chunk_sizes(len(decode), p.bs).items()
    ]
    tokens = n0 * seq  # one batch's positions, an upper bound: padding is dropped
    # float64 sums: XᵀX and Xᵀy of the fitting and held-out positions per layer, one product being
    # added, and the solve's matrices at the end; one batch's y and one layer's x with its two parts.
    host = (4 * w.n_layers + 5) * w.d_model**2 * 8 + 4 * tokens * w.d_model * 8
    return StagePlan("headlens", fw, kept=(w.n_layers + 1) * n0 * seq * w.d_model * b, host=host, batch=p.bs)


def _plan_attention(p: Planner) -> StagePlan:
    samples = p.samples("tasks")["count"]
    seq = p.seq(samples)
    fw = [Forward(n, seq, count=k, eager=True) for n, k in chunk_sizes(len(samples), p.bs).items()]
    return StagePlan("attention", fw, batch=p.bs)


def _plan_metrics(p: Planner) -> StagePlan:
    """Eager forwards, then candidate scoring, both in the scoring's chunks (`Planner.score`), as
    `_metrics` runs them."""
    samples = p.samples("attention_metrics")
    seq = p.seq(samples)
    scored = p.score("attention_metrics", samples)
    fw = [Forward(n, seq, count=k, eager=True) for n, k in chunk_sizes(len(samples), scored.batch).items()]
    return StagePlan(
        "attention_metrics",
        fw + scored.forwards,
        batch=scored.batch,
        notes=scored.notes,
        fits=scored.fits,
        knob=scored.knob,
    )


def _metrics(run: RunContext) -> xr.Dataset:
    samples = run.inputs["attention_metrics"]()
    return attention_metrics(
        run.vlm,
        samples,
        batch_size=score_rows(run.vlm, "attention_metrics", samples, run.batch_size),
        at=run.config.attention_at,  # the notebook's 50 new tokens
    )


HEADLENS = Stage(
    "headlens",
    inputs=("headlens_fit", "tasks"),
    compute=_headlens,
    plan=_plan_headlens,
    variables=RESULT_DIMS["headlens"][1],
)
ATTENTION = Stage(
    "attention",
    inputs=("tasks",),
    compute=lambda run: circuits.image_attention_share(
        run.vlm, run.data["count"], batch_size=run.batch_size
    ).to_dataset(name="image_attention"),
    plan=_plan_attention,
    variables=RESULT_DIMS["attention"][1],
)
ATTENTION_METRICS = Stage(
    "attention_metrics",
    inputs=("attention_metrics",),
    compute=_metrics,
    plan=_plan_metrics,
    variables={
        "mas": ("layer", "sample"),
        "vra": ("layer", "sample"),
        "iou": ("layer", "sample"),
        "ars": ("layer", "sample"),
    },
)


def _argmax_head(da: xr.DataArray) -> str:
    [(layer, head, value)] = top_sites(da, 1)
    return f"{head_label((layer, head))} ({value:.2f})"


def _reference_attention(am: xr.Dataset) -> dict | None:
    """The MAS code's diagnostics of an ``at="generation"`` attention_metrics result, for the report."""
    if "sets" not in am:
        return None
    import torch

    shares = reference_shares(torch.tensor(am.sets.transpose("sample", "layer", "set").values))
    right = am.correct.values.astype(bool)

    def by_outcome(name: str) -> str:
        values = am[name].values.astype(float)
        parts = [
            f"{label} {np.nanmean(values[m]):.3f}" for label, m in (("correct", right), ("wrong", ~right)) if m.any()
        ]
        return ", ".join(parts) or "none"

    return {
        "shares": ", ".join(f"{k} {v:.1%}" for k, v in shares.items()),
        "vra": by_outcome("vra_code"),
        "ars": by_outcome("ars_code"),
    }


def modality_shares(am: xr.Dataset) -> pd.DataFrame:
    """The attention of the answer position by token set, one row per outcome (correct, wrong) that has
    samples, labelled with its n; shares sum to 1. With the MAS code's sets (``at="generation"``):
    special, system, image, text (`countlens.reference.counting_to_four.attention.modality_shares` per
    outcome); else MAS, the image tokens' share, against the rest (text and special tokens), each a mean
    over layers and samples (`aggregate`, as the section's MAS table)."""
    right = am.correct.values.astype(bool)
    rows = {}
    if "sets" in am:
        import torch

        sums = torch.tensor(am.sets.transpose("sample", "layer", "set").values)
        for label, mask in (("correct", right), ("wrong", ~right)):
            if mask.any():
                rows[f"{label} (n={int(mask.sum())})"] = reference_shares(sums[torch.from_numpy(mask)])
        return pd.DataFrame(rows).T
    mas = aggregate(am, by=None)
    for label, outcome in (("correct", "correct"), ("wrong", "incorrect")):
        n = int(mas.loc[outcome, "n"])
        if n:
            share = float(mas.loc[outcome, "mas"])
            rows[f"{label} (n={n})"] = {"image": share, "other (text, special)": 1.0 - share}
    return pd.DataFrame(rows).T


def _values(ctx: ReportContext) -> dict:
    r = ctx.results
    hl, att, am = r["headlens"], r["attention"], r["attention_metrics"]
    per_layer = aggregate(am, by=None, per_layer=True)
    mas_iou = per_layer.unstack("outcome")[["mas", "iou"]].round(3)
    mas_iou.columns = [f"{m} ({o})" for m, o in mas_iou.columns]
    if "pixel_iou" not in am:
        raise RunDirError(
            f"{ctx.out}/results/attention_metrics.nc lacks 'pixel_iou': it was written by an older "
            f"countlens; delete it and rerun `countlens discover --out {ctx.out}` to recompute it"
        )
    # Over the heads that have attention maps (not slots beyond a layer's heads, nor linear layers).
    by_head = am.pixel_iou.mean("sample", skipna=True)
    return {
        "headlens": {
            "r2": ", ".join(f"{float(v):.2f}" for v in hl.r2.values),
            "most_image_attentive": _argmax_head(att.image_attention.mean("sample")),
            "top_vgs": _argmax_head(hl.vgs),
            "top_cter": _argmax_head(hl.cter),
        },
        "attention": {
            "n_scenes": int(am.sizes["sample"]),
            "mas_iou_table": finite_markdown(mas_iou),
            "pixel_iou": {"top_head": _argmax_head(by_head.fillna(0.0)), "mean": float(by_head.mean(skipna=True))},
            "position": am.attrs.get("position", "last prompt token"),
            "code": _reference_attention(am),
            "probes": probes_summary(r.get("probes")),
        },
    }


def _draw(ctx: ReportContext) -> None:
    plots.plot_heatmap(
        ctx.results["attention"].image_attention.mean("sample"),
        ctx.figures / "image_attention.png",
        "Attention of the last token on image tokens",
    )
    am = ctx.results["attention_metrics"]
    plots.plot_modality_share(
        modality_shares(am), am.attrs.get("position", "last prompt token"), ctx.figures / "modality_share.png"
    )
    if ctx.results.get("probes") is not None:
        plots.plot_probe_ap(ctx.results["probes"], ctx.figures / "probes.png")


SECTION = Section("attention.md.j2", _values, _draw)
