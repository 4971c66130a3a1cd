"""Counting evaluation by single-token answer scoring.

A sample is anything with ``image`` (PIL), ``question``, ``answer`` (a single-token word), ``task``
and ``meta`` (``count`` for counting samples): `countlens.datasets.tasks.TaskSample` is one. The
prediction is the arg-max of the next-token logits at the last prompt position over the whole
vocabulary — the model may answer any token, so a wrong-format answer counts as wrong.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import pandas as pd
import torch
import xarray as xr

from countlens.errors import InputError


class Sample(Protocol):
    question: str
    answer: str
    task: str
    meta: dict

    @property
    def image(self): ...


@torch.no_grad()
def score(vlm, samples: Sequence[Sample], batch_size: int = 32, progress: bool = False) -> xr.Dataset:
    """Per-sample predictions: an xr.Dataset over ``sample`` with pred, gold, correct, task, count, p_gold."""
    if len(samples) == 0:
        raise InputError("no samples to evaluate; give a non-empty list")
    preds, p_gold, correct = [], [], []
    steps = range(0, len(samples), batch_size)
    if progress:
        from rich.progress import track

        steps = track(steps, description=f"scoring {len(samples)} samples")
    for i in steps:
        chunk = samples[i : i + batch_size]
        batch = vlm.prepare([s.image for s in chunk], [s.question for s in chunk], [s.answer for s in chunk])
        # prepare pads on the left, so the last prompt position is the last position of every row.
        assert bool((batch.last == batch.inputs["input_ids"].shape[1] - 1).all())
        logits = vlm.forward(batch, logits_to_keep=1).logits[:, -1].float()
        gold_ids = batch.answer_token.to(logits.device)
        pred_ids = logits.argmax(-1)
        correct += (pred_ids == gold_ids).tolist()
        preds += vlm.tokenizer.convert_ids_to_tokens(pred_ids.tolist())
        p_gold += logits.softmax(-1)[torch.arange(len(chunk)), gold_ids].tolist()
    return xr.Dataset(
        {
            "pred": ("sample", np.array(preds, dtype=object)),
            "gold": ("sample", np.array([s.answer for s in samples], dtype=object)),
            "correct": ("sample", np.array(correct, dtype=bool)),
            "p_gold": ("sample", np.array(p_gold)),
            "task": ("sample", np.array([s.task for s in samples], dtype=object)),
            "count": ("sample", np.array([int(s.meta.get("count", -1)) for s in samples])),
            "case": ("sample", np.array([str(s.meta.get("case", "")) for s in samples], dtype=object)),
        },
        coords={"sample": np.arange(len(samples))},
        attrs={"model": vlm.name, "arch": vlm.arch.name},
    )


def accuracy(ds: xr.Dataset, by: str) -> pd.DataFrame:
    """Accuracy and sample count grouped by one variable of a `score` result (e.g. "task", "count")."""
    df = ds[["correct", by]].to_dataframe()
    out = df.groupby(by)["correct"].agg(["mean", "size"]).rename(columns={"mean": "accuracy", "size": "n"})
    return out
