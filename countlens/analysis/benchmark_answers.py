"""Reading a generated answer the way each general-reasoning benchmark reads it: MMMU, MathVista, RealWorldQA.

A benchmark's accuracy depends on how a free-form answer is read as much as on the model, so each
column is read by its benchmark's own published rule, written here from the benchmark's evaluation
code, and countlens says where it has to depart from it:

- **MMMU** (Yue et al., CVPR 2024; its ``eval/eval_utils.py``). A multiple-choice answer: strip
  ``, . ! ? ; : '`` from both ends and pad with spaces; the letters written ``(A)``, else `` A ``, else
  (answers of more than five words) the options whose text appears; of several, the one written last.
  *Departure*: where nothing is found MMMU picks a random option; countlens counts the answer as
  unread and wrong (MMMU's accuracy would add 1/options per such answer, in expectation). An open
  answer: the tail after the last key phrase ("is", "so", "therefore", "answer" … and "=" in the last
  sentence) of each line, plus every number in it, normalised (numbers rounded to 2 decimals, text
  lower-cased); right when a normalised gold number is among them or a gold text is inside one.
- **MathVista** (Lu et al., ICLR 2024; its ``evaluation/extract_answer.py`` and ``calculate_score.py``).
  Extraction: the answer itself when it is an option, an integer or a float; ``The answer is "…".``;
  then MathVista asks GPT-4 with few-shot examples — *countlens's own rule replaces that step*: a
  letter written ``(B)`` or alone, the text after "answer is" / "answer:", for number answers the
  last number written, else the whole answer. Normalisation, as MathVista's: a letter becomes its
  option, other multiple-choice text the option nearest in edit distance; integers ``int(float(x))``,
  floats rounded to the question's precision; right when equal to the gold string. An answer read
  only by the edit-distance fallback counts as unread (it is still scored, as MathVista scores it).
- **RealWorldQA** (xAI, 2024) publishes no evaluation code: *countlens's own rule*. Questions that
  list lettered options are read as MMMU reads multiple choice (no random pick); the others are
  right when the first number equals a number gold (within 1e-6) or the first word is the gold word
  (case and punctuation ignored).

`read_answer` returns a `Reading` (what was read, whether anything was, and whether it is right) for
a sample whose ``source`` has a rule, else None; `countlens.analysis.evaluate.generate` uses it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """An answer as a benchmark reads it: ``answer`` (the letter, option, number or text compared with
    the gold; "" when nothing was read), ``parsed`` (the rule found an answer in the benchmark's
    form) and ``correct``."""

    answer: str
    parsed: bool
    correct: bool


def letters(n: int) -> list[str]:
    """The first ``n`` option letters: A, B, …"""
    return [chr(ord("A") + i) for i in range(n)]


# ----------------------------------------------------------------------------- MMMU

_STRIPPED = ",.!?;:'"


def mmmu_choice(text: str, choices: Sequence[str], options: Sequence[str]) -> str | None:
    """The letter MMMU reads from a multiple-choice answer, or None (MMMU would pick one at random).

    ``choices``: the letters; ``options``: their texts, in the same order."""
    padded = f" {text.strip(_STRIPPED)} "
    found = [c for c in choices if f"({c})" in padded]
    where = [padded.rfind(f"({c})") for c in found]
    if not found:
        found = [c for c in choices if f" {c} " in padded]
        where = [padded.rfind(f" {c} ") for c in found]
    if not found and len(padded.split()) > 5:
        lower = padded.lower()
        found = [c for c, option in zip(choices, options) if option.lower() in lower]
        where = [lower.rfind(option.lower()) for c, option in zip(choices, options) if c in found]
    if not found:
        return None
    return found[max(range(len(found)), key=lambda i: (where[i], -i))]  # the last written; ties: the first


def _mmmu_normalise(text: str) -> list[str | float]:
    text = text.strip()
    try:
        return [round(float(text.replace(",", "")), 2)]
    except ValueError:
        text = text.lower()
        return [f" {text}", f"{text} "] if len(text) == 1 else [text]


_NUMBER_PATTERNS = (
    r"-?\b\d{1,3}(?:,\d{3})+\b",  # with thousands separators
    r"-?\d+(?:\.\d+)?[eE][+-]?\d+",  # scientific
    r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])",  # plain
)
_KEY_PHRASES = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")


def mmmu_open(text: str) -> list[str | float]:
    """MMMU's reading of an open answer: the candidate strings and numbers, normalised."""
    text = text.strip().strip(".").lower()
    lines = re.split(r"\.\s(?=[A-Z])|\n", text)
    keys = []
    for i, line in enumerate(lines):
        phrases = _KEY_PHRASES + (("=",) if i == len(lines) - 1 else ())
        shortest = ""
        for phrase in (p for p in phrases if p in line):
            tail = line.split(phrase)[-1].strip()
            if not shortest or len(tail) < len(shortest):  # as MMMU's: an empty tail is replaced
                shortest = tail
        if shortest and shortest not in tuple(_STRIPPED):
            keys.append(shortest)
    keys = keys or [text]
    found = list(keys)
    for key in keys:
        for pattern in _NUMBER_PATTERNS:
            found += re.findall(pattern, key)
    out: list[str | float] = []
    for item in found:
        out += [x for x in _mmmu_normalise(item) if x not in out]
    return out


def mmmu_open_correct(gold: Sequence[str], predictions: Sequence[str | float]) -> bool:
    """MMMU's judgement of an open answer: a gold number among the predicted numbers, or a gold text
    inside a predicted string."""
    wanted = [x for g in gold for x in _mmmu_normalise(g)]
    for p in predictions:
        if isinstance(p, str) and any(isinstance(w, str) and w in p for w in wanted):
            return True
        if not isinstance(p, str) and p in wanted:
            return True
    return False


def read_mmmu(text: str, sample) -> Reading:
    if sample.choices:
        letter = mmmu_choice(text, sample.choices, sample.meta["options"])
        return Reading(letter or "", letter is not None, letter == sample.answer)
    predictions = mmmu_open(text)
    golds = sample.meta.get("answers") or [sample.answer]
    shown = "; ".join(str(p) for p in predictions)
    return Reading(shown, bool(text.strip()), mmmu_open_correct(golds, predictions))


# ----------------------------------------------------------------------------- MathVista


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def mathvista_extract(text: str, sample) -> tuple[str, bool]:
    """The extraction MathVista's pipeline would hand to its normaliser, and whether a rule found it
    (MathVista's deterministic steps, then countlens's own in place of GPT-4)."""
    meta, text = sample.meta, text.strip()
    if not text:
        return "", False
    if sample.choices and text in sample.choices:
        return text, True
    if meta["answer_type"] == "integer" and re.fullmatch(r"[+-]?\d+", text):
        return str(int(text)), True
    if meta["answer_type"] == "float" and _number(text) is not None:
        return str(float(text)), True
    quoted = re.search(r'The answer is "(.*)"\.', text)
    if quoted:
        return quoted.group(1), True
    tail = re.split(r"answer\s*(?:is|:)\s*", text, flags=re.IGNORECASE)[-1].strip().rstrip(".")
    if sample.choices:
        marks = letters(len(sample.choices))
        letter = re.search(r"\(([A-Za-z])\)", tail) or re.fullmatch(r"\s*([A-Z])[.):]?\s*", tail)
        if letter and letter.group(1).upper() in marks:
            return letter.group(1).upper(), True
        option = next((c for c in sample.choices if c.lower() in tail.lower()), None)
        return (option, True) if option else (tail, False)
    if meta["answer_type"] in ("integer", "float"):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", tail.replace(",", ""))
        return (numbers[-1], True) if numbers else (tail, False)
    return tail, bool(tail)


def mathvista_normalise(extraction: str, sample) -> str | None:
    """MathVista's normalisation of an extraction to the gold's form (None: no number in it)."""
    meta = sample.meta
    if meta["question_type"] == "multi_choice":
        letter = re.findall(r"\(([a-zA-Z])\)", extraction)
        extraction = letter[0].upper() if letter else extraction.strip()
        marks = letters(len(sample.choices))
        if extraction in marks:
            return sample.choices[marks.index(extraction)]
        distances = [edit_distance(extraction, c) for c in sample.choices]
        return sample.choices[distances.index(min(distances))]
    value = _number(extraction)
    if meta["answer_type"] == "integer":
        return None if value is None else str(int(value))
    if meta["answer_type"] == "float":
        precision = int(meta.get("precision") or 0)
        return None if value is None else str(round(value, precision))
    return extraction


def read_mathvista(text: str, sample) -> Reading:
    extraction, found = mathvista_extract(text, sample)
    prediction = mathvista_normalise(extraction, sample)
    return Reading(prediction or "", found and prediction is not None, prediction == sample.answer)


# ----------------------------------------------------------------------------- RealWorldQA


def read_realworldqa(text: str, sample) -> Reading:
    if sample.choices:
        letter = mmmu_choice(text, sample.choices, sample.meta["options"])
        return Reading(letter or "", letter is not None, letter == sample.answer)
    gold = sample.answer.strip()
    if _number(gold) is not None:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        first = numbers[0] if numbers else ""
        return Reading(first, bool(numbers), bool(numbers) and abs(float(first) - float(gold)) < 1e-6)
    words = re.findall(r"[\w-]+", text.lower())
    first = words[0] if words else ""
    return Reading(first, bool(words), first == gold.lower().strip(_STRIPPED))


#: The benchmarks with a reading rule, by a loaded sample's ``source``.
READERS: dict[str, Callable[[str, object], Reading]] = {
    "mmmu": read_mmmu,
    "mathvista": read_mathvista,
    "realworldqa": read_realworldqa,
}


def read_answer(text: str, sample) -> Reading | None:
    """``text`` read by the rule of the benchmark ``sample`` comes from, or None when it has none."""
    reader = READERS.get(getattr(sample, "source", None))
    return None if reader is None else reader(text, sample)


def has_rule(sample) -> bool:
    """Whether ``sample`` comes from a benchmark with a reading rule here."""
    return getattr(sample, "source", None) in READERS


def writes_a_letter(sample) -> bool:
    """Whether the model is asked to answer ``sample`` with an option letter (not its gold text)."""
    return has_rule(sample) and bool(getattr(sample, "choices", None))
