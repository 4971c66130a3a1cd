"""Head temperature: counting accuracy with the most important heads' attention sharpened.

Each head's β = α·γ, γ its share of the head-patching importance among the top-k heads with softmax
attention (a linear-attention layer's heads have no temperature); β scales the head's queries, so its
attention logits (`countlens.circuits.head_temperature`). Held-out counting scenes are scored with
and without it.
"""

from __future__ import annotations

import json

import xarray as xr

from countlens import circuits
from countlens.analysis.evaluate import score
from countlens.labels import head_label
from countlens.pipeline.costs import score_rows
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage


def _temperature(run: RunContext) -> xr.Dataset:
    vlm, c, heads = run.vlm, run.config, run.results["heads"]
    # Only heads with softmax attention have a temperature (Qwen3.5's linear layers: none).
    softmax = xr.DataArray([vlm.arch.softmax(int(la)) for la in heads.layer.values], coords={"layer": heads.layer})
    betas = circuits.beta_from_importance(heads.effect.where(softmax), alpha=c.alpha, top_k=c.top_k)
    held = run.inputs["temperature"]()
    rows = score_rows(vlm, "temperature", held, c.batch_size)  # as many a chunk as fit (the plan's rule)
    base = score(vlm, held, batch_size=rows)
    with circuits.head_temperature(vlm, betas):
        sharp = score(vlm, held, batch_size=rows)
    return xr.Dataset(
        {"base": base.correct, "sharpened": sharp.correct},
        attrs={"betas": json.dumps({head_label(h): b for h, b in betas.items()})},
    )


TEMPERATURE = Stage(
    "temperature",
    inputs=("temperature",),
    compute=_temperature,
    plan=lambda p: p.score("temperature", p.samples("temperature"), times=2),
    variables={"base": ("sample",), "sharpened": ("sample",)},
)


def _values(ctx: ReportContext) -> dict:
    temp = ctx.results["temperature"]
    return {
        "temperature": {
            "betas": temp.attrs["betas"],
            "base": float(temp.base.mean()),
            "sharpened": float(temp.sharpened.mean()),
            "n_scenes": int(temp.sizes["sample"]),
        }
    }


SECTION = Section("temperature.md.j2", _values)
