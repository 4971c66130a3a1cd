"""MMMU (Yue et al., CVPR 2024): college-level questions over 30 subjects — one of Counting Circuits'
general-reasoning columns.

Expected input: the Hugging Face copy, one parquet file per subject and split
(``<Subject>/validation-00000-of-00001.parquet``); ``path`` is one such file or a folder searched
for ``<split>-*.parquet`` at any depth (the whole copy, or one subject). Columns: ``id``,
``question``, ``options`` (a Python-literal list of strings, ``[]`` for an open question),
``answer`` (the option letter, or for an open question the answer text or a literal list of
accepted answers), ``question_type`` (``multiple-choice`` or ``open``), ``image_1`` … ``image_7``
(``{"bytes", "path"}`` or null) and, kept in ``meta``, ``subfield``, ``topic_difficulty``,
``img_type``. The test split hides its answers (``?``) and is refused.

A sample holds one image, so a question that shows several (``<image 2>`` … in its text or options,
or more than one image column filled) is left out and counted in the ``log``; a question that names
an image its row lacks is refused. The ``question`` of a sample is the prompt of MMMU's own LLaVA
evaluation: the question, then for multiple choice the options as ``(A) …`` lines and "Answer with
the option's letter from the given choices directly.", for an open question "Answer the question
using a single word or phrase." (``<image 1>`` is left in the text as MMMU writes it). Answers are
read by `countlens.analysis.benchmark_answers` (MMMU's rules).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

from countlens.datasets.loaders.common import (
    LoaderError,
    PathLike,
    QuestionSample,
    annotation_files,
    check_limit,
    image_field,
    read_records,
    record_field,
    require_images_per_file,
)

QUESTION_TYPES: tuple[str, ...] = ("multiple-choice", "open")
IMAGE_COLUMNS: tuple[str, ...] = tuple(f"image_{i}" for i in range(1, 8))
CHOICE_PROMPT = "Answer with the option's letter from the given choices directly."
OPEN_PROMPT = "Answer the question using a single word or phrase."
_FIX = "pass MMMU's parquet files as Hugging Face stores them (a <split>-*.parquet file, or a folder holding them)"


def load_mmmu(
    path: PathLike, split: str = "validation", *, limit: int | None = None, log: Callable[[str], None] | None = None
) -> list[QuestionSample]:
    """The single-image questions of a local MMMU copy as `QuestionSample` (task "reasoning"), files in
    name order; ``limit`` applies after multi-image questions are left out (``log`` says how many)."""
    check_limit(limit)
    files = annotation_files(path, f"{split}-*.parquet", _FIX)
    out, seen, multi = [], set(), 0
    for file in files:
        if limit is not None and len(out) >= limit:
            break
        for rid, record in read_records(file, _FIX):
            if limit is not None and len(out) >= limit:
                break
            sample = _sample(record, file, rid, split)
            if sample is None:
                multi += 1
                continue
            if sample.id in seen:
                raise LoaderError(f"{file}: {rid}: id {sample.id!r} appears twice; each question once")
            seen.add(sample.id)
            out.append(sample)
    require_images_per_file(out, files, _FIX)
    if multi and log is not None:
        log(f"MMMU: {multi} questions with several images left out (a sample holds one image)")
    return out


def _sample(record: dict, file: Path, rid: str, split: str) -> QuestionSample | None:
    """One record as a sample, or None when it shows several images."""
    qid = str(record_field(record, "id", (str, int), file, rid))
    question = record_field(record, "question", str, file, rid)
    qtype = record_field(record, "question_type", str, file, rid)
    if qtype not in QUESTION_TYPES:
        raise LoaderError(f"{file}: {rid}: question_type {qtype!r} is not one of {QUESTION_TYPES}")
    options = _options(record_field(record, "options", (str, list), file, rid), file, rid)
    answer = str(record_field(record, "answer", (str, int, float), file, rid)).strip()
    if answer == "?":
        raise LoaderError(
            f"{file}: {rid}: the answer is hidden ('?'), as in MMMU's test split; load 'validation' or 'dev'"
        )
    named = {int(n) for n in re.findall(r"<image (\d+)>", " ".join([question, *options]))}
    filled = {i + 1 for i, c in enumerate(IMAGE_COLUMNS) if record.get(c) is not None}
    if len(named | filled) > 1:
        return None
    number = next(iter(named or filled), None)
    if number is None or number not in filled:
        shown = f"<image {number}>" if number is not None else "an image"
        raise LoaderError(f"{file}: {rid}: the question shows {shown} but its row has no image_{number or 1}")
    image_path, image_bytes = image_field(record, (f"image_{number}",), file.parent, file, rid)
    meta = {
        "file": str(file),
        "question_type": qtype,
        "raw_question": question,
        **{k: record.get(k) for k in ("subfield", "topic_difficulty", "img_type") if record.get(k) is not None},
    }
    if qtype == "multiple-choice":
        marks = [chr(ord("A") + i) for i in range(len(options))]
        if len(options) < 2 or answer not in marks:
            raise LoaderError(
                f"{file}: {rid}: the answer {answer!r} is not the letter of one of its {len(options)} options "
                f"({', '.join(marks) or 'none'})"
            )
        listed = "\n".join(f"({m}) {o}" for m, o in zip(marks, options))
        prompt, choices = f"{question}\n\n{listed}\n\n{CHOICE_PROMPT}", tuple(marks)
        meta["options"] = list(options)
    else:
        accepted = _accepted(answer, file, rid)
        answer, choices, prompt = accepted[0], None, f"{question}\n\n{OPEN_PROMPT}"
        meta["answers"] = accepted
    return QuestionSample(
        image_path=image_path,
        image_bytes=image_bytes,
        question=prompt,
        answer=answer,
        task="reasoning",
        source="mmmu",
        id=qid,
        choices=choices,
        split=split,
        meta=meta,
    )


def _options(value, file: Path, rid: str) -> list[str]:
    """The ``options`` column: a Python-literal list of strings (as MMMU stores it) or a list."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise LoaderError(f"{file}: {rid}: field 'options' {value[:60]!r} is not a list literal") from None
    if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
        raise LoaderError(f"{file}: {rid}: field 'options' must be a list of strings")
    return value


def _accepted(answer: str, file: Path, rid: str) -> list[str]:
    """An open question's accepted answers: MMMU writes several as a list literal."""
    if answer.startswith("["):
        try:
            value = ast.literal_eval(answer)
        except (ValueError, SyntaxError):
            value = None
        if not isinstance(value, list) or not value or not all(isinstance(a, (str, int, float)) for a in value):
            raise LoaderError(f"{file}: {rid}: the answer {answer[:60]!r} is neither a text nor a list of answers")
        return [str(a) for a in value]
    if not answer:
        raise LoaderError(f"{file}: {rid}: the answer is empty")
    return [answer]
