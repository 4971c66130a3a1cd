"""Which objects does the model count? Each object's exact effect on the count answer, by placement.

``objects`` takes up to `PER_CASE` of the run's COUNTINGTRICKS scenes per case (the ``cases`` stage's
samples, at evenly spaced positions of each case's samples: `pick`, so the plan knows them before any
answer) and measures every object's effect with `countlens.circuits.objects.effects` at the input of
layer 0 (``site=Residual(-1)``: the projected image-token embeddings, before any layer has mixed the
tokens) against the scene drawn again without that object (``reference="removed"``: one object
fewer, so the patch asks what that object's own tokens carry, not what the empty image does). It
stores the effects beside the run's own answers on those scenes (section 1's ``correct``: right or
wrong as the run scored them) and, for up to `PER_OUTCOME` scenes answered right and as many answered
wrong (`countlens.pipeline.stages.attention_maps.choose`), their images and object labels. The
report's section draws those scenes with each object outlined in its effect's colour, the effect
against the object's offset from the nearest cell centre, and the misses table
(`countlens.analysis.object_misses.run_misses`: wrongly counted = answered wrong in section 1) by placement
class, size and contact. A model on which no object can be measured (no object list, no token for
any object) records why (``refused``) and the report says so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import xarray as xr

from countlens.analysis import plots
from countlens.analysis.attention_maps import downsampled
from countlens.analysis.object_misses import PLACEMENT_ROWS, run_misses, shown_rows
from countlens.analysis.tables import finite_markdown
from countlens.circuits.objects.effects import object_effects, scene_chunks
from countlens.circuits.sites import Residual
from countlens.errors import NoObjectTokensError
from countlens.pipeline.costs import Forward, Planner, StagePlan
from countlens.pipeline.stages.attention_maps import choose
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage
from countlens.pipeline.stages.cases import answered_cases

#: Scenes measured per COUNTINGTRICKS case (evenly spaced over the case's samples).
PER_CASE = 4
#: Scenes drawn per outcome (answered right, answered wrong) in the report's figure.
PER_OUTCOME = 4
REFERENCE, SITE = "removed", Residual(-1)


def pick(cases: Sequence[str], per_case: int = PER_CASE, usable: Sequence[bool] | None = None) -> np.ndarray:
    """Positions (in run order) of up to ``per_case`` samples of each case of ``cases`` (one case name
    per sample), each case's at evenly spaced positions of its samples; only the ``usable`` ones (a scene
    with objects: an empty scene has nothing to measure)."""
    cases = np.asarray([str(c) for c in cases])
    ok = np.ones(len(cases), dtype=bool) if usable is None else np.asarray(usable, dtype=bool)
    picked: list[int] = []
    for case in dict.fromkeys(cases[ok].tolist()):
        where = np.flatnonzero((cases == case) & ok)
        k = min(per_case, len(where))
        picked += where[np.linspace(0, len(where) - 1, k).round().astype(int)].tolist()
    return np.array(sorted(picked), dtype=int)


def _case_names(samples: Sequence) -> list[str]:
    return [str((s.meta or {}).get("case", "")) for s in samples]


def _with_objects(samples: Sequence) -> list[bool]:
    return [bool(getattr(getattr(s, "scene", None), "objects", None)) for s in samples]


def _compute(run: RunContext) -> xr.Dataset:
    cases, samples = answered_cases(run)
    index = pick(_case_names(samples), usable=_with_objects(samples))
    if not len(index):
        return xr.Dataset(attrs={"refused": "no scene of the run's cases draws an object"})
    chosen = [samples[i] for i in index]
    try:
        ds = object_effects(run.vlm, chosen, reference=REFERENCE, site=SITE, batch_size=run.batch_size)
    except NoObjectTokensError as refused:  # no object owns a token of this model's inputs: the report says why
        return xr.Dataset(attrs={"refused": str(refused)})
    answers = cases["pred"] if "pred" in cases else cases["text"]
    right = cases["correct"].values[index].astype(bool)
    ds["index"] = ("scene", index)
    ds["answered_right"] = ("scene", right)
    ds["gold"] = ("scene", np.array([str(samples[i].answer) for i in index], dtype=str))
    ds["pred"] = ("scene", np.array([str(answers.values[i]) for i in index], dtype=str))
    drawn = choose(right, PER_OUTCOME)
    pictures = [downsampled(chosen[s]) for s in drawn]
    h = max((p[0].shape[0] for p in pictures), default=0)
    w = max((p[0].shape[1] for p in pictures), default=0)
    image = np.zeros((len(drawn), h, w, 3), np.uint8)
    labels = np.zeros((len(drawn), h, w), np.uint8)
    for k, (im, lab) in enumerate(pictures):
        image[k, : im.shape[0], : im.shape[1]], labels[k, : lab.shape[0], : lab.shape[1]] = im, lab
    ds["drawn_scene"] = ("drawn", drawn)
    ds["image"] = (("drawn", "y", "x", "rgb"), image)
    ds["labels"] = (("drawn", "y", "x"), labels)
    ds["image_height"] = ("drawn", np.array([p[0].shape[0] for p in pictures], np.int32))
    ds["image_width"] = ("drawn", np.array([p[0].shape[1] for p in pictures], np.int32))
    ds.attrs.update(per_case=PER_CASE, per_outcome=PER_OUTCOME, wrong="answered wrong in the cases stage")
    return ds


def _plan(p: Planner) -> StagePlan:
    """S clean forwards, N reference forwards (each cached at the input of layer 0) and N patched ones,
    for the S picked scenes and their N objects, in `object_effects`'s chunks of whole scenes."""
    samples = p.samples("cases")
    chosen = [samples[i] for i in pick(_case_names(samples), usable=_with_objects(samples))]
    if not chosen:  # no scene draws an object: the stage only says so
        return StagePlan("objects", [], kept=0, batch=p.bs, notes=["no scene of the run's cases draws an object"])
    counts = [len(s.scene.objects) for s in chosen]
    seq = p.seq(chosen, forced=True)  # the answer's first tokens forced: the most object_effects forces
    shapes: Counter = Counter()
    chunks = scene_chunks(counts, [[True] * n for n in counts], p.bs)
    for chunk in chunks:
        objects = sum(counts[s] for s in chunk)
        shapes[len(chunk)] += 1  # the clean run
        if objects:
            shapes[objects] += 2  # the reference run, then the patched run
    fw = [Forward(rows, seq, count=k) for rows, k in sorted(shapes.items())]
    kept = max(shapes) * seq * p.w.d_model * p.w.act_bytes  # the reference run's input of layer 0
    notes = [f"{len(chosen)} scenes, {sum(counts)} objects: {len(chunks)} chunks of whole scenes"]
    return StagePlan("objects", fw, kept=kept, batch=p.bs, notes=notes)


OBJECTS = Stage(
    "objects",
    inputs=("cases",),
    compute=_compute,
    plan=_plan,
    variables={
        "effect": ("scene", "object"),
        "placement": ("scene", "object"),
        "offset": ("scene", "object"),
        "answered_right": ("scene",),
        "image": ("drawn", "y", "x", "rgb"),
        "labels": ("drawn", "y", "x"),
    },
)


def _values(ctx: ReportContext) -> dict:
    ds = ctx.results["objects"]
    if "refused" in ds.attrs:
        return {"refused": ds.attrs["refused"]}
    table = run_misses(ds)
    live = ds["exists"] & (ds["n_tokens"] > 0)
    right = ds["answered_right"].values.astype(bool)
    drawn = right[ds["drawn_scene"].values]
    other = [str(g) for g in table.group.values if str(g).startswith(("size:", "contact:"))]
    return {
        "refused": "",
        "n_scenes": int(ds.sizes["scene"]),
        "n_cases": len(set(ds["case"].values.tolist())),
        "per_case": int(ds.attrs.get("per_case", PER_CASE)),
        "n_objects": int(live.sum()),
        "hidden": int(table.attrs["hidden"]),
        "n_wrong": int((~right).sum()),
        "drawn_right": int(drawn.sum()),
        "drawn_wrong": int((~drawn).sum()),
        "normalised": float(ds["normalised"].where(live).mean()),
        "placement_table": finite_markdown(shown_rows(table, PLACEMENT_ROWS).rename_axis("placement")),
        "other_table": finite_markdown(shown_rows(table, other).rename_axis("size (patches) / contact")),
        "ci": table.attrs["ci"],
    }


def _draw(ctx: ReportContext) -> None:
    ds = ctx.results["objects"]
    if "refused" in ds.attrs:
        return
    plots.plot_object_scenes(ds, ctx.figures / "object_effects.png")
    plots.plot_effect_by_offset(ds, ctx.figures / "object_offset.png")


SECTION = Section("objects.md.j2", _values, _draw, stages=("objects",))
