"""Metrics of a counting result (`countlens.analysis.evaluate.score` or `generate`): accuracy, MAE and
the unparsed share (`summary`), whether the scores measure anything (`unanswered`), the number-avoidance
correlation and the Digit-in-Conflict drop.

- `summary`: accuracy, MAE |pred − N| over *parsed* counting answers, the ``unparsed`` share of
  counting answers, and n — overall or per case / count / shape.
- `number_avoidance`: per-count accuracy and its Pearson r with N (the "Counting to Four" paper
  reports r ≈ −0.78: larger numbers are avoided, a language prior rather than visual difficulty).
- `digit_in_conflict`: the accuracy drop when the prompt carries a wrong hint (N±1, N±2) and the share
  of answers that repeat the hinted digit.

Both kinds of result carry ``correct``, ``count`` (gold N, −1 for non-counting samples) and, from
generation, ``pred_count`` and ``parsed``; a `score` result's count is read from its ``pred`` token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr

from countlens.analysis.parse import parse_count, token_text
from countlens.errors import InputError
from countlens.validate import require_dataset, require_text


def accuracy(ds: xr.Dataset, by: str) -> pd.DataFrame:
    """Accuracy and sample count grouped by one variable of a `score` result (e.g. "task", "count")."""
    _require(ds, "correct", by)
    df = ds[["correct", by]].to_dataframe()
    out = df.groupby(by)["correct"].agg(["mean", "size"]).rename(columns={"mean": "accuracy", "size": "n"})
    return out


def _require(ds: xr.Dataset, *names: str) -> None:
    require_dataset(ds, "the result (a score() or generate() Dataset)")
    for name in names:
        require_text(name, "a variable name")
    missing = [n for n in names if n not in ds.variables]
    if missing:
        raise InputError(
            f"the result has no variable {', '.join(map(repr, missing))}; it has {sorted(map(str, ds.data_vars))}. "
            "Use a result of score() or generate(), or group by one of its variables"
        )


def predicted_counts(ds: xr.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(pred_count, parsed) of a result: its own variables, or parsed from a `score` result's ``pred`` tokens."""
    if "pred_count" in ds and "parsed" in ds:
        return ds["pred_count"].values.astype(int), ds["parsed"].values.astype(bool)
    _require(ds, "pred")
    counts = [parse_count(token_text(t)) for t in ds["pred"].values]
    return np.array([-1 if c is None else c for c in counts]), np.array([c is not None for c in counts])


def _frame(ds: xr.Dataset) -> pd.DataFrame:
    _require(ds, "correct", "count")
    pred, parsed = predicted_counts(ds)
    count = ds["count"].values.astype(int)
    is_count = count >= 0
    return pd.DataFrame(
        {
            "correct": ds["correct"].values.astype(bool),
            "count_sample": is_count,
            "abs_err": np.where(is_count & parsed, np.abs(pred - count), np.nan),
            "unparsed": np.where(is_count, ~parsed, np.nan),
        }
    )


def _summarise(df: pd.DataFrame) -> pd.Series:
    return pd.Series(
        {
            "accuracy": df["correct"].mean(),
            "mae": df["abs_err"].mean(),  # NaN-skipping: parsed counting answers only
            "unparsed": df["unparsed"].mean(),  # NaN-skipping: counting samples only
            "n": len(df),
        }
    )


def summary(ds: xr.Dataset, by: str | None = None) -> pd.DataFrame:
    """Accuracy, MAE, unparsed share and n — one row ("all"), or one per value of ``by``.

    ``accuracy`` and ``n`` cover every sample of the group; ``mae`` (mean |pred_count − count|) covers
    the counting samples (count ≥ 0) whose answer parsed, and ``unparsed`` is the share of counting
    samples whose answer held no count (NaN where a group has no counting samples). Works on
    `score` results (their ``pred`` tokens are parsed) and `generate` results.
    """
    df = _frame(ds)
    if by is None:
        out = _summarise(df).to_frame("all").T
    else:
        _require(ds, by)
        df[by] = ds[by].values
        out = pd.DataFrame({k: _summarise(g.drop(columns=by)) for k, g in df.groupby(by, sort=True)}).T
        out.index.name = by
    return out.astype({"n": int})


#: `unanswered`'s thresholds: the median probability of the candidate answers' form, and the
#: share of unparsed answers, beyond which a model is taken not to answer the prompt.
FORM_MASS_MIN = 0.1
UNPARSED_MAX = 0.5


def unanswered(ds: xr.Dataset) -> str | None:
    """A sentence saying why the scores in ``ds`` (`score` or `generate`) measure nothing, or None.

    A model that does not answer in the prompt's form still gets a "prediction" from scoring (the
    least unlikely candidate), so accuracy alone cannot show it. Flagged when accuracy is at chance
    (at most 1.5 × the mean of 1 / candidates per sample; for token scoring and generation, 1 / the
    distinct gold answers) and the model puts little weight on the answer form: a median candidate
    probability below `FORM_MASS_MIN`, or more than `UNPARSED_MAX` of its answers holding no count."""
    acc = float(ds.correct.mean())
    if "p_candidates" in ds:
        chance = float((1.0 / ds.n_candidates).mean())
        mass = float(np.median(ds.p_candidates))
        off_form = mass < FORM_MASS_MIN
        why = f"the median probability of the candidate answers is {mass:.2g}"
    else:
        chance = 1.0 / max(1, len(set(ds.gold.values.tolist())))
        unparsed = float(summary(ds).loc["all", "unparsed"])
        unparsed = unparsed if np.isfinite(unparsed) else 0.0
        off_form = unparsed > UNPARSED_MAX
        why = f"{unparsed:.0%} of its answers hold no count"
    if off_form and acc <= 1.5 * chance:
        return (
            f"the model does not answer this prompt: accuracy {acc:.3f} is at chance ({chance:.3f}) and {why}; "
            "the results below measure nothing about counting — use a prompt style it answers (--prompt)"
        )
    return None


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def number_avoidance(ds: xr.Dataset) -> dict:
    """Per-count accuracy of the counting samples and its Pearson r with the count.

    Returns ``{"r", "per_count": {N: accuracy}, "n": {N: samples}}``. r is computed across the
    distinct counts (each count one point, as in the paper's accuracy-vs-N plot), NaN when fewer than
    two counts or a constant accuracy make it undefined.
    """
    _require(ds, "correct", "count")
    count = ds["count"].values.astype(int)
    keep = count >= 0
    if not keep.any():
        raise InputError("number_avoidance needs counting samples (count ≥ 0); the result has none")
    df = pd.DataFrame({"count": count[keep], "correct": ds["correct"].values[keep].astype(float)})
    per = df.groupby("count")["correct"].agg(["mean", "size"])
    return {
        "r": _pearson(per.index.to_numpy(float), per["mean"].to_numpy()),
        "per_count": {int(k): float(v) for k, v in per["mean"].items()},
        "n": {int(k): int(v) for k, v in per["size"].items()},
    }


def digit_in_conflict(std_ds: xr.Dataset, conflict_ds: xr.Dataset, distractors: Sequence[int] | None = None) -> dict:
    """How much a wrong hinted digit hurts: accuracies, their drop, and how often the hint is repeated.

    ``distractors`` are the hinted digits, one per sample of ``conflict_ds`` (default: its
    ``distractor`` variable, from the samples' meta). Returns ``accuracy_std``, ``accuracy_conflict``,
    ``drop`` (std − conflict, in accuracy units), ``distractor_share`` (share of all conflict answers
    whose count equals the hint; unparsed answers never do), ``distractor_share_of_errors`` (the same
    among wrong answers; NaN when none are wrong) and the two sample counts.
    """
    _require(std_ds, "correct")
    _require(conflict_ds, "correct")
    if distractors is None:
        _require(conflict_ds, "distractor")
        distractors = conflict_ds["distractor"].values
    hint = np.asarray(distractors, dtype=int)
    if hint.shape != (conflict_ds.sizes["sample"],):
        raise InputError(
            f"got {hint.size} distractors for {conflict_ds.sizes['sample']} conflict samples; "
            "give one distractor digit per sample of conflict_ds, in order"
        )
    pred, parsed = predicted_counts(conflict_ds)
    repeated = parsed & (pred == hint)
    wrong = ~conflict_ds["correct"].values.astype(bool)
    acc_std, acc_conf = float(std_ds["correct"].mean()), float(conflict_ds["correct"].mean())
    return {
        "accuracy_std": acc_std,
        "accuracy_conflict": acc_conf,
        "drop": acc_std - acc_conf,
        "distractor_share": float(repeated.mean()),
        "distractor_share_of_errors": float(repeated[wrong].mean()) if wrong.any() else float("nan"),
        "n_std": int(std_ds.sizes["sample"]),
        "n_conflict": int(conflict_ds.sizes["sample"]),
    }
