"""The held-out evaluation of `countlens eval`: a model scored on task scenes no training saw, and
its accuracy written up as markdown.

`held_out_scores` draws the scenes (`countlens.datasets.tasks`: ``n`` counting scenes, ``n // 4``
of each other task, from an evaluation seed) and scores them (`countlens.analysis.score`), adding
each sample's scene kind; `accuracy_report` turns the scores into ``accuracy.md``: counting up to
ten, then accuracy per task, per scene kind and per count; `write_held_out` saves both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from countlens.analysis import accuracy, score
from countlens.datasets.tasks import TASKS, scene_kind, task_samples

if TYPE_CHECKING:
    import xarray as xr

    from countlens.model.vlm import VLM

#: The columns of each accuracy table: the group, its accuracy, its number of samples.
_FLOATFMT = ("g", ".3f", "g")


def held_out_scores(vlm: VLM, n: int, seed: int, batch_size: int) -> xr.Dataset:
    """The scores over ``sample`` of ``n`` counting scenes and ``max(1, n // 4)`` scenes of each other
    task (seed ``seed``, at the model's image size), with each sample's ``scene`` kind."""
    size = vlm.geometry.image_height
    samples = task_samples("count", n, seed, image_size=size)
    samples += [s for t in TASKS if t != "count" for s in task_samples(t, max(1, n // 4), seed, image_size=size)]
    ds = score(vlm, samples, batch_size=batch_size, progress=True)
    return ds.assign(scene=("sample", np.array([scene_kind(s) for s in samples], dtype=object)))


def accuracy_report(ds: xr.Dataset, model: str, seed: int) -> str:
    """``accuracy.md`` of scores from `held_out_scores`: counting with N ≤ 10, then tables per task,
    per scene kind (counting, N ≤ 10) and per count."""
    by_task = accuracy(ds, "task")
    counting = ds.where(ds.task == "count", drop=True)
    up_to_ten = counting.where(counting["count"] <= 10, drop=True)
    by_scene = accuracy(up_to_ten, "scene")
    by_count = accuracy(counting, "count")
    by_count.index = by_count.index.astype(int)
    upto10 = float(up_to_ten.correct.mean())
    return (
        f"# Held-out accuracy of {model} (seed {seed})\n\n"
        f"Counting, N ≤ 10: **{upto10:.3f}**\n\n## Per task\n\n{by_task.to_markdown(floatfmt=_FLOATFMT)}\n\n"
        f"## Counting with N ≤ 10, per scene kind\n\n{by_scene.to_markdown(floatfmt=_FLOATFMT)}\n\n"
        f"## Counting, per N\n\n{by_count.to_markdown(floatfmt=_FLOATFMT)}\n"
    )


def write_held_out(out: str | Path, ds: xr.Dataset, report: str) -> None:
    """``out/samples.csv`` (one row per scored sample) and ``out/accuracy.md`` (``report``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ds.to_dataframe().to_csv(out / "samples.csv")
    (out / "accuracy.md").write_text(report)
