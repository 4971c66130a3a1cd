"""Attention on the image: where the key heads, and each layer's heads on average, look on a few scenes.

``attention_maps`` picks a handful of the run's COUNTINGTRICKS samples from its own answers (the
``cases`` stage): up to `PER_OUTCOME` answered right and as many answered wrong, each set taken at
evenly spaced positions of the run's sample order (`choose`), so that they come from several cases and
the same run picks the same samples. It stores their images, objects and the last prompt position's
attention on their image tokens (`countlens.analysis.attention_maps`: every head when that fits in 4
MiB, else the heads with the largest |head-patching effect| — the head table's importance — plus
every layer's head mean) in ``results/attention_maps.nc``. The report's section draws, from that file
alone, the samples × the run's top heads by importance and the head means of a few layers
(`countlens.analysis.overlays`), and gives each drawn column's attention on the image, right against
wrong answers.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from countlens.analysis import overlays
from countlens.analysis.attention_maps import attention_maps
from countlens.analysis.tables import finite_markdown
from countlens.errors import RunDirError
from countlens.labels import head_label, top_sites
from countlens.pipeline.costs import Forward, Planner, StagePlan, chunk_sizes
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage
from countlens.pipeline.stages.cases import answered_cases

#: Samples drawn per outcome (answered right, answered wrong).
PER_OUTCOME = 4
#: Heads drawn in the report's figure (the head table's most important ones that are stored).
N_HEADS = 3
#: Layers whose head mean the figure draws, spread evenly over the depth.
N_LAYERS = 4


def choose(correct, per_outcome: int = PER_OUTCOME) -> np.ndarray:
    """Positions of up to ``per_outcome`` right answers, then of up to as many wrong ones, in ``correct``
    (one bool per sample), each set at evenly spaced positions of its samples in order."""
    correct = np.asarray(correct, dtype=bool)
    picked: list[int] = []
    for outcome in (True, False):
        where = np.flatnonzero(correct == outcome)
        k = min(per_outcome, len(where))
        if k:  # k ≤ len(where): the rounded positions are at least one apart, so distinct
            picked += where[np.linspace(0, len(where) - 1, k).round().astype(int)].tolist()
    return np.array(picked, dtype=int)


def _compute(run: RunContext) -> xr.Dataset:
    cases, samples = answered_cases(run)
    chosen = choose(cases["correct"].values)
    # Scored candidates keep the chosen answer as ``pred``; greedy generations keep their ``text``.
    answers = cases["pred"] if "pred" in cases else cases["text"]
    labels = {
        "index": chosen,
        "correct": cases["correct"].values[chosen].astype(bool),
        "case": np.array([str(cases["case"].values[i]) for i in chosen], dtype=object),
        "gold": np.array([str(samples[i].answer) for i in chosen], dtype=object),
        "pred": np.array([str(answers.values[i]) for i in chosen], dtype=object),
    }
    ranking = [(la, h) for la, h, _ in top_sites(run.results["heads"].effect, absolute=True)]
    return attention_maps(run.vlm, [samples[i] for i in chosen], labels, ranking, batch_size=run.batch_size)


def _plan(p: Planner) -> StagePlan:
    samples = p.samples("cases")[: 2 * PER_OUTCOME]  # any of the cases: one image size, one prompt
    seq = p.seq(samples)
    fw = [Forward(n, seq, count=k, eager=True) for n, k in chunk_sizes(len(samples), p.bs).items()]
    return StagePlan("attention_maps", fw, batch=p.bs)


ATTENTION_MAPS = Stage(
    "attention_maps",
    inputs=("cases",),
    compute=_compute,
    plan=_plan,
    variables={"attention": ("site", "sample", "token"), "layer_mean": ("layer", "sample", "token")},
)


def key_heads(table: pd.DataFrame, ds: xr.Dataset, k: int = N_HEADS) -> list[tuple[int, int]]:
    """The ``k`` most important heads of the head table (``importance``: |head-patching effect|) that
    ``ds`` stores."""
    stored = set(zip(ds.site_layer.values.tolist(), ds.site_head.values.tolist()))
    ranked = table.sort_values("importance", ascending=False, kind="stable")
    heads = [(int(la), int(h)) for la, h in zip(ranked["layer"], ranked["head"]) if (la, h) in stored]
    return heads[:k]


def spread_layers(ds: xr.Dataset, k: int = N_LAYERS) -> list[int]:
    """Up to ``k`` layers of ``ds`` evenly spaced from the first to the last."""
    layers = ds.layer.values
    return sorted({int(layers[i]) for i in np.linspace(0, len(layers) - 1, min(k, len(layers))).round().astype(int)})


def _on_image(ds: xr.Dataset, layer: int, head: int | None, outcome: bool) -> float:
    """Mean over the stored samples of ``outcome`` of the attention on the whole image."""
    values = [
        float(np.nansum(overlays.sample_map(ds, i, layer, head)))
        for i in range(ds.sizes["sample"])
        if bool(ds["correct"].values[i]) == outcome
    ]
    return float(np.mean(values)) if values else float("nan")


def _values(ctx: ReportContext) -> dict:
    ds = ctx.results["attention_maps"]
    missing = [v for v in ("correct", "index", "image", "objects") if v not in ds]
    if missing:
        raise RunDirError(
            f"{ctx.out}/results/attention_maps.nc lacks {missing}: it was written by an older countlens; "
            f"delete it and rerun `countlens discover --out {ctx.out}` to recompute it"
        )
    heads, layers = key_heads(ctx.table, ds), spread_layers(ds)
    columns = [(la, h) for la, h in heads] + [(la, None) for la in layers]
    rows = {
        (head_label((la, h)) if h is not None else f"L{la} mean"): {
            "right": _on_image(ds, la, h, True),
            "wrong": _on_image(ds, la, h, False),
        }
        for la, h in columns
    }
    right = ds["correct"].values.astype(bool)
    return {
        "n_right": int(right.sum()),
        "n_wrong": int((~right).sum()),
        "per_outcome": PER_OUTCOME,
        "stored": ds.attrs.get("heads", "all"),
        "heads": ", ".join(head_label(h) for h in heads) or "none stored",
        "layers": ", ".join(str(la) for la in layers),
        "table": finite_markdown(pd.DataFrame(rows).T.round(3)),
    }


def _draw(ctx: ReportContext) -> None:
    ds = ctx.results["attention_maps"]
    overlays.plot_attention_on_image(
        ds, key_heads(ctx.table, ds), ctx.figures / "attention_on_image.png", spread_layers(ds)
    )


SECTION = Section("attention_maps.md.j2", _values, _draw)
