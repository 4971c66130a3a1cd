"""Counting evaluation: single-token scoring, greedy generation, answer parsing and the papers' metrics.

Two ways to ask a VLM for a count. **Scoring** (`score`) reads the next-token logits at the last
prompt position and takes the arg-max over the whole vocabulary: one forward pass, and the model
may answer any token, so a wrong-format answer counts as wrong. **Generation** (`generate`) lets the
model answer freely (greedy, a few tokens) and parses the first count in its text with
`parse_count` ("I think there are 3 circles" → 3, "none" → 0, "I don't know" → unparsed).
Both return an `xr.Dataset` over ``sample`` with ``correct``, ``count`` (gold N, −1 for non-counting
samples), ``pred_count`` (−1 when unparseable) and ``parsed``, so the metrics below read either:

- `summary`: accuracy, MAE |pred − N| over *parsed* counting answers, the ``unparsed`` share of
  counting answers, and n — overall or per case / count / shape.
- `number_avoidance`: per-count accuracy and its Pearson r with N (the "Counting to Four" paper
  reports r ≈ −0.78: larger numbers are avoided, a language prior rather than visual difficulty).
- `digit_in_conflict`: the accuracy drop when the prompt carries a wrong hint (N±1, N±2) and the share
  of answers that repeat the hinted digit.

A sample is anything with ``image`` (PIL), ``question``, ``answer`` (a word; a single token for
`score`), ``task`` and ``meta`` (``count`` for counting samples; ``case``, ``shape``, ``distractor``
when known): `countlens.datasets.tasks.TaskSample` is one.
"""

from __future__ import annotations

import re
from typing import Protocol, Sequence

import numpy as np
import pandas as pd
import torch
import xarray as xr

from countlens.errors import InputError

_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
          "sixteen seventeen eighteen nineteen").split()
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80,
         "ninety": 90}
#: Number words → value ("zero" … "nineteen", the tens; "twenty-one"-style compounds are parsed too).
NUMBER_WORDS: dict[str, int] = {w: i for i, w in enumerate(_UNITS)} | _TENS
#: Whole words that mean a count of zero.
ZERO_WORDS: tuple[str, ...] = ("no", "none")

_COUNT_RE = re.compile(
    r"\b(?:(?P<digits>[0-9]+)"
    rf"|(?P<tens>{'|'.join(_TENS)})(?:[-\s](?P<unit>{'|'.join(_UNITS[1:10])}))?"
    rf"|(?P<word>{'|'.join(sorted(_UNITS, key=len, reverse=True))})"
    rf"|(?P<zero>{'|'.join(ZERO_WORDS)}))\b",
    re.IGNORECASE,
)
# Sub-word markers of byte-level BPE ("Ġ") and SentencePiece ("▁") tokenizers.
_TOKEN_MARKERS = str.maketrans({"Ġ": " ", "▁": " ", "Ċ": "\n"})


class Sample(Protocol):
    question: str
    answer: str
    task: str
    meta: dict

    @property
    def image(self): ...


# ----------------------------------------------------------------------------- parsing


def parse_count(text: str) -> int | None:
    """The first count in ``text``, or None when there is none.

    Matches whole words only (word boundaries): digit strings ("12." → 12), number words "zero" …
    "nineteen" and the tens ("twenty", "thirty-two" → 32), and "no" / "none" → 0. The first
    count-bearing word wins ("4 or 5" → 4; "no, 3" → 0). "nothing", "nonexistent", "know" or
    "someone" hold no count; "I don't know" → None.
    """
    if not isinstance(text, str):
        raise InputError(f"parse_count got a {type(text).__name__}; give the answer text as a string")
    m = _COUNT_RE.search(text)
    if m is None:
        return None
    if m["digits"]:
        return int(m["digits"])
    if m["tens"]:
        return _TENS[m["tens"].lower()] + (NUMBER_WORDS[m["unit"].lower()] if m["unit"] else 0)
    if m["word"]:
        return NUMBER_WORDS[m["word"].lower()]
    return 0


def token_text(token: str) -> str:
    """A vocabulary token as text: sub-word markers ("Ġ12", "▁twelve") turned back into spaces."""
    return str(token).translate(_TOKEN_MARKERS)


# ----------------------------------------------------------------------------- scoring and generation


def _check_samples(samples: Sequence[Sample]) -> None:
    if len(samples) == 0:
        raise InputError("no samples to evaluate; give a non-empty list")


def _meta_vars(samples: Sequence[Sample]) -> dict[str, tuple[str, np.ndarray]]:
    """The per-sample variables every result carries: gold, task, count, case, shape, distractor."""
    meta = [s.meta or {} for s in samples]
    return {
        "gold": ("sample", np.array([str(s.answer) for s in samples], dtype=object)),
        "task": ("sample", np.array([s.task for s in samples], dtype=object)),
        "count": ("sample", np.array([int(m.get("count", -1)) for m in meta])),
        "case": ("sample", np.array([str(m.get("case", "")) for m in meta], dtype=object)),
        "shape": ("sample", np.array([str(m.get("shape", "")) for m in meta], dtype=object)),
        "distractor": ("sample", np.array([int(m.get("distractor", -1)) for m in meta])),
    }


def _steps(n: int, batch_size: int, progress: bool, what: str):
    if batch_size < 1:
        raise InputError(f"batch_size must be ≥ 1, got {batch_size}")
    steps = range(0, n, batch_size)
    if progress:
        from rich.progress import track

        steps = track(steps, description=f"{what} {n} samples")
    return steps


@torch.no_grad()
def score(vlm, samples: Sequence[Sample], batch_size: int = 32, progress: bool = False) -> xr.Dataset:
    """Per-sample single-token predictions: an xr.Dataset over ``sample``.

    Variables: pred (the arg-max token), gold, correct (pred is the answer's token), p_gold, task,
    count, case, shape, distractor, pred_count / parsed (`parse_count` of the predicted token).
    """
    _check_samples(samples)
    preds, pred_text, p_gold, correct = [], [], [], []
    for i in _steps(len(samples), batch_size, progress, "scoring"):
        chunk = samples[i : i + batch_size]
        batch = vlm.prepare([s.image for s in chunk], [s.question for s in chunk], [s.answer for s in chunk])
        # prepare pads on the left, so the last prompt position is the last position of every row.
        assert bool((batch.last == batch.inputs["input_ids"].shape[1] - 1).all())
        logits = vlm.forward(batch, logits_to_keep=1).logits[:, -1].float()  # Float[Tensor, "batch vocab"]
        gold_ids = batch.answer_token.to(logits.device)
        pred_ids = logits.argmax(-1)
        correct += (pred_ids == gold_ids).tolist()
        preds += vlm.tokenizer.convert_ids_to_tokens(pred_ids.tolist())
        pred_text += [vlm.tokenizer.decode([t]) for t in pred_ids.tolist()]
        p_gold += logits.softmax(-1)[torch.arange(len(chunk)), gold_ids].tolist()
    counts = [parse_count(t) for t in pred_text]
    return xr.Dataset(
        {
            "pred": ("sample", np.array(preds, dtype=object)),
            "correct": ("sample", np.array(correct, dtype=bool)),
            "p_gold": ("sample", np.array(p_gold)),
            "pred_count": ("sample", np.array([-1 if c is None else c for c in counts])),
            "parsed": ("sample", np.array([c is not None for c in counts])),
            **_meta_vars(samples),
        },
        coords={"sample": np.arange(len(samples))},
        attrs={"model": vlm.name, "arch": vlm.arch.name, "method": "single-token scoring"},
    )


def _is_correct(text: str, count: int | None, gold: str) -> bool:
    """A counting answer is right when its first count is the gold number; any other answer when its
    first word is the gold word (case and punctuation ignored)."""
    want = parse_count(gold) if re.fullmatch(r"\s*[0-9]+\s*", gold) else None
    if want is not None:
        return count == want
    words = re.findall(r"[\w-]+", text.lower())
    return bool(words) and words[0] == gold.strip().lower()


@torch.no_grad()
def generate(vlm, samples: Sequence[Sample], max_new_tokens: int = 8, batch_size: int = 16,
             progress: bool = False) -> xr.Dataset:
    """Greedy free-form answers, parsed: an xr.Dataset over ``sample``.

    Variables: text (the decoded new tokens, special tokens dropped), pred_count (−1 when
    unparseable), parsed, correct (see `_is_correct`), gold, count, case, task, shape, distractor.
    """
    _check_samples(samples)
    if vlm.remote:
        raise InputError(f"{vlm.name} is a remote (NDIF) model; generate runs local models only — load it locally")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    texts: list[str] = []
    pad = vlm.hf.generation_config.pad_token_id
    pad = vlm.tokenizer.pad_token_id if pad is None else pad
    for i in _steps(len(samples), batch_size, progress, "generating"):
        chunk = samples[i : i + batch_size]
        batch = vlm.prepare([s.image for s in chunk], [s.question for s in chunk])
        out = vlm.hf.generate(**batch.inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        new = out[:, batch.inputs["input_ids"].shape[1] :]  # Int[Tensor, "batch new"]: left padding aligns prompts
        texts += [t.strip() for t in vlm.tokenizer.batch_decode(new, skip_special_tokens=True)]
    counts = [parse_count(t) for t in texts]
    correct = [_is_correct(t, c, str(s.answer)) for t, c, s in zip(texts, counts, samples)]
    return xr.Dataset(
        {
            "text": ("sample", np.array(texts, dtype=object)),
            "pred_count": ("sample", np.array([-1 if c is None else c for c in counts])),
            "parsed": ("sample", np.array([c is not None for c in counts])),
            "correct": ("sample", np.array(correct, dtype=bool)),
            **_meta_vars(samples),
        },
        coords={"sample": np.arange(len(samples))},
        attrs={"model": vlm.name, "arch": vlm.arch.name, "method": "greedy generation",
               "max_new_tokens": max_new_tokens},
    )


# ----------------------------------------------------------------------------- metrics


def accuracy(ds: xr.Dataset, by: str) -> pd.DataFrame:
    """Accuracy and sample count grouped by one variable of a `score` result (e.g. "task", "count")."""
    _require(ds, "correct", by)
    df = ds[["correct", by]].to_dataframe()
    out = df.groupby(by)["correct"].agg(["mean", "size"]).rename(columns={"mean": "accuracy", "size": "n"})
    return out


def _require(ds: xr.Dataset, *names: str) -> None:
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
    return pd.DataFrame({
        "correct": ds["correct"].values.astype(bool),
        "count_sample": is_count,
        "abs_err": np.where(is_count & parsed, np.abs(pred - count), np.nan),
        "unparsed": np.where(is_count, ~parsed, np.nan),
    })


def _summarise(df: pd.DataFrame) -> pd.Series:
    return pd.Series({
        "accuracy": df["correct"].mean(),
        "mae": df["abs_err"].mean(),  # NaN-skipping: parsed counting answers only
        "unparsed": df["unparsed"].mean(),  # NaN-skipping: counting samples only
        "n": len(df),
    })


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
