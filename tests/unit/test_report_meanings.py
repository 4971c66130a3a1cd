"""The cases section says when a run has too few samples for what it would print: per-case
accuracies of single answers, and number avoidance's r over counts of one sample each (NaN) are not
findings. Rendered from synthetic results of the `cases`, `conflict_std` and `conflict` stages."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import xarray as xr

from countlens.datasets.countingtricks import CASES
from countlens.pipeline.report import _TEMPLATES
from countlens.pipeline.stages import cases as section


def _results(per_case: int, seed: int = 0) -> dict[str, xr.Dataset]:
    """Every case answered ``per_case`` times: counts 1–10 in turn, about half right."""
    rng = np.random.default_rng(seed)
    names = [n for n in CASES for _ in range(per_case)]
    n = len(names)
    count = np.arange(n) % 10 + 1
    correct = rng.random(n) < 0.5
    pred = np.where(correct, count, count + 1)
    cases = xr.Dataset(
        {
            "case": ("sample", np.array(names, dtype=object)),
            "count": ("sample", count),
            "pred_count": ("sample", pred),
            "parsed": ("sample", np.ones(n, bool)),
            "correct": ("sample", correct),
        }
    )
    conflict = cases.isel(sample=slice(0, 4)).assign(distractor=("sample", np.array([2, 3, 4, 5])))
    return {"cases": cases, "conflict_std": cases.isel(sample=slice(0, 4)), "conflict": conflict}


def _render(per_case: int) -> str:
    ctx = SimpleNamespace(model="toy", spec={"n_per_case": per_case}, results=_results(per_case))
    return _TEMPLATES.get_template("sections/cases.md.j2").render(number=1, **section._values(ctx))


def test_one_sample_per_case_is_said_and_r_is_not_printed_as_a_finding():
    text = _render(1)
    assert "With 1 image per case these accuracies are single answers, not rates" in text
    assert "Number avoidance (Pearson r between the count and its accuracy): not measured:" in text
    assert "nan" not in text.lower()


def test_enough_samples_print_r():
    text = _render(10)  # 32 cases × 10: 32 samples at each count
    assert "single answers" not in text and "not measured" not in text
    assert "Number avoidance: Pearson r between the count and its accuracy = **" in text
