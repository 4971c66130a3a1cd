"""Counting evaluation: asking a VLM for a count by scoring (single-token and candidate) or by greedy generation.

Two ways to ask a VLM for a count. **Scoring** (`score`) reads the model's probabilities without
letting it write: single-token scoring takes the arg-max over the whole vocabulary at the last
prompt position (one forward; a wrong-format answer counts as wrong), and candidate scoring — for
answers of several tokens, as real tokenizers write "12" ("1", "2") — teacher-forces every candidate
answer and takes the most probable (`countlens.model.answers` says how sequences end and are scored).
**Generation** (`generate`, the papers' way) lets the model answer freely (greedy, a few tokens) and
parses its text (`countlens.analysis.parse`): the Pstd format "circle: 7" with `parse_shape_count`,
else the first count with `parse_count` ("I think there are 3 circles" → 3, "none" → 0, "I don't
know" → unparsed); a question of MMMU, MathVista or RealWorldQA is read by that benchmark's own rule
(`countlens.analysis.benchmark_answers`). Both return an `xr.Dataset` over ``sample`` with
``correct``, ``count`` (gold N, −1 for non-counting samples), ``pred_count`` (−1 when unparseable)
and ``parsed``, so the metrics (`countlens.analysis.metrics`: `summary`, `number_avoidance`,
`digit_in_conflict`) read either.

A sample is anything with ``image`` (PIL), ``question``, ``answer`` (its text: "7", "circle: 7",
"red"), ``task`` and ``meta`` (``count`` for counting samples; ``case``, ``shape``, ``distractor``
when known): `countlens.datasets.tasks.TaskSample` is one.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.analysis.benchmark_answers import has_rule, read_answer
from countlens.analysis.parse import PARSERS, parse_count, parse_shape_count
from countlens.errors import InputError
from countlens.model.adapt import module_of
from countlens.model.answers import read_rows
from countlens.model.arguments import require_vlm
from countlens.model.memory import MAX_ROWS
from countlens.model.vlm import check_samples
from countlens.progress import track
from countlens.reference.counting_to_four.parse import parse_count_as_reference
from countlens.results import provenance
from countlens.validate import require_count

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


class Sample(Protocol):
    question: str
    answer: str
    task: str
    meta: dict

    @property
    def image(self): ...


# ----------------------------------------------------------------------------- scoring and generation


def _check_samples(samples: Sequence[Sample], what: str, batch_size: int) -> None:
    check_samples(samples, what)
    require_count(batch_size, "batch_size")


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


def _provenance(vlm: VLM, samples: Sequence[Sample]) -> dict:
    return provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples)


def _steps(n: int, batch_size: int, progress: bool, what: str):
    steps = range(0, n, batch_size)
    if progress:
        steps = track(steps, description=f"{what} {n} samples")
    return steps


SCORE_METHODS: tuple[str, ...] = ("auto", "token", "candidates")


@torch.no_grad()
def score(
    vlm: VLM,
    samples: Sequence[Sample],
    batch_size: int = 32,
    progress: bool = False,
    method: str = "auto",
    candidates: Sequence[str] | None = None,
) -> xr.Dataset:
    """Per-sample predictions by scoring: an xr.Dataset over ``sample``; ``attrs["method"]`` says how.

    ``method``:
    - ``"token"`` — single-token scoring: the arg-max over the whole vocabulary at the last prompt
      position; every answer must be one token. Variables: pred (the arg-max token), correct, p_gold
      (softmax probability of the answer's token), pred_count / parsed (`parse_count` of the token).
    - ``"candidates"`` — candidate scoring: the teacher-forced log-probability of each candidate
      answer sequence (`countlens.model.answers`: terminated where the vocabulary splits numbers), arg-max
      over candidates. Candidates default to, for counting samples, the counts 0 … the largest gold
      count among ``samples``, written like each sample's own answer ("7" → "0" … "12"; "circle: 7"
      → "circle: 0" …); for other samples, the distinct gold answers of their task. ``candidates=``
      gives one list for every sample. Variables: pred (the winning candidate's text), correct,
      logp_gold, p_gold (its sequence probability), pred_count / parsed, p_candidates (the summed
      probability of the sample's candidates: how much the model answers in their form at all) and
      n_candidates.
    - ``"auto"`` (default) — ``"token"`` when every answer is a single token, else ``"candidates"``.
    All carry gold, task, count, case, shape and distractor.
    """
    require_vlm(vlm, "score")
    _check_samples(samples, "score", batch_size)
    if method not in SCORE_METHODS:
        raise InputError(f"unknown scoring method {method!r}; use one of {SCORE_METHODS}")
    if method == "auto":
        # A multiple-choice question is scored over its options, whatever their length.
        single = (
            candidates is None
            and not any(getattr(s, "choices", None) for s in samples)
            and all(len(vlm.answer_ids(str(s.answer))) == 1 for s in samples)
        )
        method = "token" if single else "candidates"
    if method == "token":
        if candidates is not None:
            raise InputError("candidates= is for method='candidates'; single-token scoring reads the whole vocabulary")
        return _score_tokens(vlm, samples, batch_size, progress)
    return _score_candidates(vlm, samples, candidate_sets(samples, candidates), batch_size, progress)


def _score_tokens(vlm: VLM, samples: Sequence[Sample], batch_size: int, progress: bool) -> xr.Dataset:
    preds, pred_text, p_gold, correct = [], [], [], []
    for i in _steps(len(samples), batch_size, progress, "scoring"):
        chunk = samples[i : i + batch_size]
        try:
            batch = vlm.prepare_samples(chunk, answers=True, single_token=True)
        except InputError as err:
            if "single token" not in str(err):
                raise
            raise InputError(f"{err}; or score with method='candidates'") from err
        # prepare pads on the left, so the last prompt position is the last position of every row.
        assert bool((batch.last == batch.inputs["input_ids"].shape[1] - 1).all())
        logits = (
            vlm.forward(batch, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        )  # Float[Tensor, "batch vocab"]
        gold_ids = batch.answer_token.to(logits.device)
        pred_ids = logits.argmax(-1)
        correct += (pred_ids == gold_ids).tolist()
        preds += vlm.token_strings(pred_ids.tolist())
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
        attrs={**_provenance(vlm, samples), "method": "single-token scoring"},
    )


def candidate_sets(samples: Sequence[Sample], candidates: Sequence[str] | None) -> list[dict[str, int]]:
    """Per sample, its candidate answers → their count (−1 for non-counting answers): ``candidates``
    for every sample; else a multiple-choice question's own ``choices``; else the counts 0 … the
    largest asked (counting), or the distinct gold answers of the sample's task."""
    if candidates is not None:
        cands = [str(c) for c in candidates]
        if len(set(cands)) < 2:
            raise InputError(f"candidates={list(candidates)!r}: give at least two distinct candidate answers")
        fixed = {c: _parsed(c) for c in cands}
        for i, s in enumerate(samples):
            if str(s.answer) not in fixed:
                raise InputError(
                    f"sample {i}'s gold answer {s.answer!r} is not among candidates {cands}; add it to candidates="
                )
        return [fixed] * len(samples)
    counts = [int((s.meta or {}).get("count", -1)) for s in samples]
    # Counts 0 … the largest gold count or Digit-in-Conflict distractor asked: a hinted number is
    # always among the candidates.
    top = max(counts + [int((s.meta or {}).get("distractor", -1)) for s in samples])
    by_task: dict[str, list[str]] = {}
    for s, n in zip(samples, counts):
        if n < 0 and not getattr(s, "choices", None):  # a question with options keeps them to itself
            by_task.setdefault(s.task, [])
            if str(s.answer) not in by_task[s.task]:
                by_task[s.task].append(str(s.answer))
    out = []
    for i, (s, n) in enumerate(zip(samples, counts)):
        choices = getattr(s, "choices", None)  # a multiple-choice question's own options
        if choices:
            if str(s.answer) not in choices:
                raise InputError(f"sample {i}'s answer {s.answer!r} is not among its choices {list(choices)}")
            out.append({str(c): (_parsed(str(c)) if n >= 0 else -1) for c in choices})
            continue
        if n < 0:
            if len(by_task[s.task]) < 2:
                raise InputError(
                    f"task {s.task!r} has one distinct answer ({by_task[s.task]}), so candidate "
                    "scoring has nothing to choose between; give candidates="
                )
            out.append({a: -1 for a in by_task[s.task]})
            continue
        head, sep, tail = str(s.answer).rpartition(str(n))
        if not sep:
            raise InputError(
                f"sample {i}'s answer {s.answer!r} does not write its count {n} in digits, so its "
                "candidates cannot be written like it; give candidates="
            )
        out.append({f"{head}{m}{tail}": m for m in range(top + 1)})
    return out


def _score_candidates(
    vlm: VLM, samples: Sequence[Sample], sets: list[dict[str, int]], batch_size: int, progress: bool
) -> xr.Dataset:
    if vlm.remote:
        raise InputError(f"{vlm.name} is a remote (NDIF) model; candidate scoring runs local models only")
    pred, logp_gold, pred_count, correct, mass = [], [], [], [], []
    for i in _steps(len(samples), batch_size, progress, "scoring candidates of"):
        chunk = list(range(i, min(i + batch_size, len(samples))))
        seqs = {j: _candidate_ids(vlm, sets[j], j) for j in chunk}
        rows = [(j, prefix) for j in chunk for prefix in read_rows(list(seqs[j].values()))]
        after = _forced_logprobs(vlm, samples, rows, batch_size)
        for j in chunk:
            scores = {text: _sequence_logprob(ids, after[j]) for text, ids in seqs[j].items()}
            best = max(scores, key=scores.get)  # ties: the first candidate (the smallest count)
            gold = str(samples[j].answer)
            pred.append(best)
            logp_gold.append(scores[gold])
            pred_count.append(sets[j][best] if sets[j][best] >= 0 else _parsed(best))
            correct.append(best == gold)
            mass.append(float(np.exp(list(scores.values())).sum()))
    lp = np.array(logp_gold)
    return xr.Dataset(
        {
            "pred": ("sample", np.array(pred, dtype=object)),
            "correct": ("sample", np.array(correct, dtype=bool)),
            "logp_gold": ("sample", lp),
            "p_gold": ("sample", np.exp(lp)),
            "pred_count": ("sample", np.array(pred_count)),
            "parsed": ("sample", np.array(pred_count) >= 0),
            "p_candidates": ("sample", np.array(mass)),
            "n_candidates": ("sample", np.array([len(s) for s in sets])),
            **_meta_vars(samples),
        },
        coords={"sample": np.arange(len(samples))},
        attrs={
            **_provenance(vlm, samples),
            "method": "candidate scoring",
            "answer_end": -1 if vlm.answer_end is None else int(vlm.answer_end),
            "candidates": ",".join(sorted({c for s in sets for c in s})),
        },
    )


def _parsed(text: str) -> int:
    c = parse_count(text)
    return -1 if c is None else c


def _candidate_ids(vlm: VLM, cands: dict[str, int], j: int) -> dict[str, list[int]]:
    ids = {text: vlm.answer_ids(text) for text in cands}
    seen: dict[tuple, str] = {}
    for text, seq in ids.items():
        if tuple(seq) in seen:
            raise InputError(
                f"sample {j}: candidates {seen[tuple(seq)]!r} and {text!r} tokenise identically "
                f"({seq}); give candidates the tokenizer tells apart"
            )
        seen[tuple(seq)] = text
    return ids


def _forced_logprobs(vlm: VLM, samples: Sequence[Sample], rows: list[tuple[int, tuple]], batch_size: int) -> dict:
    """For each sample of the (sample, prefix) rows, the next-token scores after every context its
    rows teacher-force: ``{j: {context: (Float[Tensor, "vocab"] logits, log-sum-exp)}}``, the bare
    prompt's context being ``()``. A token's log-probability is then logit − lse.

    Each sample's prompt runs once, with a KV cache; the cache is repeated for the sample's rows, and
    only the prefixes' few tokens run after it — not a full forward per candidate. Rows of one
    sample are padded to the chunk's most rows (repeating its last), prefixes on the right.
    """
    by_sample: dict[int, list[tuple]] = {}
    for j, prefix in rows:
        by_sample.setdefault(j, []).append(prefix)
    found: dict[int, dict] = {}
    order = list(by_sample)
    # Each sample's KV cache is repeated once per row: bound the continuation batch by MAX_ROWS rows.
    step = max(1, min(batch_size, MAX_ROWS // max(len(v) for v in by_sample.values())))
    for c in range(0, len(order), step):
        js = order[c : c + step]
        found |= _cached_rows(vlm, [samples[j] for j in js], js, [by_sample[j] for j in js])
    return found


def _cached_rows(vlm: VLM, chunk: Sequence[Sample], js: list[int], prefixes: list[list[tuple]]) -> dict:
    batch = vlm.prepare_samples(chunk)
    out = vlm.hf(**batch.inputs, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1].float().cpu()  # after the bare prompt
    width = max(len(p) for ps in prefixes for p in ps)
    if width == 0:  # single-token candidates: the prompt's own next-token distribution is all
        return {j: _normalised({(): first[b]}) for b, j in enumerate(js)}
    per = max(len(ps) for ps in prefixes)
    padded = [ps + [ps[-1]] * (per - len(ps)) for ps in prefixes]
    device, mask = vlm.device, batch.inputs["attention_mask"]
    ids = torch.full((len(js) * per, width), vlm.pad_id(), dtype=torch.long)
    tail = torch.zeros(len(js) * per, width, dtype=mask.dtype)
    for r, p in enumerate(p for ps in padded for p in ps):
        ids[r, : len(p)] = torch.tensor(p)
        tail[r, : len(p)] = 1
    cache = out.past_key_values
    # Each sample's cache once per row: an index per row, which also repeats a linear-attention layer's
    # conv and recurrent states (Qwen3.5), whose cache layers have no batch_repeat_interleave.
    cache.reorder_cache(torch.arange(len(js)).repeat_interleave(per))
    kwargs = {}
    if vlm.arch.spec.rope_deltas is not None:  # Qwen: 3-D positions continue from the prefill's offsets
        owner, _, attr = vlm.arch.spec.rope_deltas.rpartition(".")
        deltas = getattr(module_of(vlm.hf, owner), attr).repeat_interleave(per, 0)
        pos = mask.shape[1] + torch.arange(width, device=deltas.device)[None] + deltas
        kwargs["position_ids"] = pos[None].expand(3, -1, -1)
    # transformers ≥ 5.40 names the argument `cache` (and warns on `past_key_values`).
    kwargs["cache" if "cache" in inspect.signature(vlm.hf.forward).parameters else "past_key_values"] = cache
    answer_type = vlm.arch.spec.answer_token_type
    if answer_type is not None:  # continued tokens are an answer (PaliGemma: causal, after the prefix)
        kwargs[answer_type] = torch.ones_like(ids).to(device)
    full_mask = torch.cat([mask.repeat_interleave(per, 0), tail.to(device)], 1)
    logits = vlm.hf(input_ids=ids.to(device), attention_mask=full_mask, use_cache=False, **kwargs).logits.float().cpu()
    found = {}
    for b, j in enumerate(js):
        # Rows share their prefixes' first tokens ("circle", ":", " " before each digit): the scores
        # after a context are the same in every row that teacher-forces it, so each is kept once.
        contexts = {(): first[b]}
        for k, p in enumerate(padded[b]):
            for t in range(len(p)):
                contexts.setdefault(p[: t + 1], logits[b * per + k, t])
        found[j] = _normalised(contexts)
    return found


def _normalised(contexts: dict[tuple, Tensor]) -> dict[tuple, tuple[Tensor, float]]:
    """Each context's logits with their log-sum-exp, in one reduction over the vocabulary (not a
    log-softmax written out for every position of every row, once most of candidate scoring's time)."""
    keys = list(contexts)
    lse = torch.stack([contexts[c] for c in keys]).logsumexp(-1).tolist()
    return {c: (contexts[c], z) for c, z in zip(keys, lse)}


def _sequence_logprob(seq: list[int], after: dict[tuple, tuple[Tensor, float]]) -> float:
    """Σ_t log p(seq[t] | seq[:t]) from the scores after each of seq's contexts."""
    total = 0.0
    for t, token in enumerate(seq):
        logits, lse = after[tuple(seq[:t])]
        total += float(logits[token]) - lse
    return total


def _is_correct(text: str, count: int | None, sample: Sample) -> bool:
    """A counting answer (gold count in the sample's meta, or a gold of digits only) is right when its
    parsed count is the gold count; any other answer when its first word is the gold word (case and
    punctuation ignored)."""
    gold = str(sample.answer)
    want = int((sample.meta or {}).get("count", -1))
    if want < 0 and re.fullmatch(r"\s*[0-9]+\s*", gold):
        want = int(gold)
    if want >= 0:
        return count == want
    words = re.findall(r"[\w-]+", text.lower())
    return bool(words) and words[0] == gold.strip().lower()


@torch.no_grad()
def generate(
    vlm: VLM,
    samples: Sequence[Sample],
    max_new_tokens: int = 8,
    batch_size: int = 16,
    progress: bool = False,
    parser: str = "countlens",
) -> xr.Dataset:
    """Greedy free-form answers, parsed (the papers' protocol): an xr.Dataset over ``sample``.

    Each answer is parsed with `parse_shape_count` for the sample's shape (its meta ``shape``), which
    reads the Pstd format ("circle: 7") and otherwise the first count — or, with
    ``parser="paper-code"``, as the MAS paper's scripts read it
    (`countlens.reference.counting_to_four.parse`). Variables: text (the decoded new tokens, special
    tokens dropped), pred_count (−1 when unparseable), parsed, correct (see `_is_correct`; an unparsed
    counting answer is wrong and counted in `countlens.analysis.metrics.summary`'s ``unparsed``),
    gold, count, case, task, shape, distractor; for benchmark questions read by their own rule
    (`countlens.analysis.benchmark_answers.read_answer`: parsed and correct are that rule's), also
    extracted (what the rule read). A gold answer longer than ``max_new_tokens`` (as the model writes
    it, `countlens.model.answers`) is refused: the budget could never produce it — except a benchmark
    question's, which its rule reads from whatever is written (the caller sizes the budget).
    """
    require_vlm(vlm, "generate")
    _check_samples(samples, "generate", batch_size)
    if vlm.remote:
        raise InputError(f"{vlm.name} is a remote (NDIF) model; generate runs local models only — load it locally")
    require_count(max_new_tokens, "max_new_tokens")
    if parser not in PARSERS:
        raise InputError(f"unknown parser {parser!r}; use one of {PARSERS}")
    # A benchmark's answer is read by its rule, not matched whole: its length is the caller's budget.
    written = [s for s in samples if not has_rule(s)]
    need, longest = max((len(vlm.answer_ids(str(s.answer))), str(s.answer)) for s in written) if written else (0, "")
    if need > max_new_tokens:
        raise InputError(
            f"gold answer {longest!r} takes {need} tokens as {vlm.name or 'the model'} writes it, "
            f"more than max_new_tokens={max_new_tokens}; raise max_new_tokens to at least {need}"
        )
    texts: list[str] = []
    pad = vlm.hf.generation_config.pad_token_id
    pad = vlm.tokenizer.pad_token_id if pad is None else pad
    for i in _steps(len(samples), batch_size, progress, "generating"):
        chunk = samples[i : i + batch_size]
        batch = vlm.prepare_samples(chunk)
        out = vlm.hf.generate(**batch.inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        new = out[:, batch.inputs["input_ids"].shape[1] :]  # Int[Tensor, "batch new"]: left padding aligns prompts
        texts += [t.strip() for t in vlm.tokenizer.batch_decode(new, skip_special_tokens=True)]
    if parser == "paper-code":
        counts = [parse_count_as_reference(t) for t in texts]
    else:
        counts = [parse_shape_count(t, str((s.meta or {}).get("shape", ""))) for t, s in zip(texts, samples)]
    correct = [_is_correct(t, c, s) for t, c, s in zip(texts, counts, samples)]
    parsed = [c is not None for c in counts]
    # A general-reasoning benchmark's question is read by that benchmark's own rule.
    readings = [read_answer(t, s) for t, s in zip(texts, samples)]
    for i, r in enumerate(readings):
        if r is not None:
            counts[i], parsed[i], correct[i] = None, r.parsed, r.correct
    extracted = (
        {"extracted": ("sample", np.array(["" if r is None else r.answer for r in readings], dtype=object))}
        if any(r is not None for r in readings)
        else {}
    )
    return xr.Dataset(
        {
            "text": ("sample", np.array(texts, dtype=object)),
            **extracted,
            "pred_count": ("sample", np.array([-1 if c is None else c for c in counts])),
            "parsed": ("sample", np.array(parsed)),
            "correct": ("sample", np.array(correct, dtype=bool)),
            **_meta_vars(samples),
        },
        coords={"sample": np.arange(len(samples))},
        attrs={
            **_provenance(vlm, samples),
            "method": "greedy generation",
            "max_new_tokens": max_new_tokens,
            "parser": parser,
        },
    )
