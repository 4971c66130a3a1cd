"""RealWorldQA (xAI, 2024): questions about photographs of real-world scenes, most of them spatial
(which way a road turns, which object is closer) — one of Counting Circuits' general-reasoning columns.

Expected input: the Hugging Face copy, parquet files with one row per question (``data/test-*.parquet``;
``path`` is one file or a folder searched for ``*.parquet`` at any depth), or a JSON / JSONL file of
records. Columns: ``image`` (``{"bytes", "path"}``, bytes, or a path relative to the file's folder),
``question`` (its options, if any, written inside it as ``A. …`` lines, with the benchmark's instruction
such as "Please answer directly with only the letter of the correct option and nothing else.") and
``answer`` (the option letter, or a word or number). RealWorldQA has no id column: a sample's id is its
file and row. A question whose text lists options has them as ``choices`` (their letters; the texts in
``meta["options"]``) and must have its answer among them. Answers are read by countlens's own rule
(`countlens.analysis.benchmark_answers`: RealWorldQA publishes none).
"""

from __future__ import annotations

import re
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

_FIX = "pass RealWorldQA's parquet files (a file, or the folder holding data/test-*.parquet) or a JSON/JSONL file"
_OPTION = re.compile(r"^\s*([A-Z])\.\s+(.+?)\s*$", re.MULTILINE)


def load_realworldqa(path: PathLike, *, limit: int | None = None) -> list[QuestionSample]:
    """The questions of a local RealWorldQA copy as `QuestionSample` (task "reasoning"), files in name order."""
    check_limit(limit)
    files = annotation_files(path, "*.parquet", _FIX)
    out = []
    for file in files:
        if limit is not None and len(out) >= limit:
            break
        records = read_records(file, _FIX)
        for rid, record in records[: None if limit is None else limit - len(out)]:
            out.append(_sample(record, file, rid, name=file.name if len(files) > 1 else ""))
    require_images_per_file(out, files, _FIX)
    return out


def options_in(question: str) -> list[tuple[str, str]]:
    """The lettered options a question lists on lines of their own ("A. Left"), when they run A, B, …"""
    found = _OPTION.findall(question)
    marks = [m for m, _ in found]
    return found if len(found) >= 2 and marks == [chr(ord("A") + i) for i in range(len(found))] else []


def _sample(record: dict, file: Path, rid: str, name: str) -> QuestionSample:
    question = record_field(record, "question", str, file, rid)
    answer = str(record_field(record, "answer", (str, int, float), file, rid)).strip()
    image_path, image_bytes = image_field(record, ("image",), file.parent, file, rid)
    options = options_in(question)
    meta = {"file": str(file)}
    choices = None
    if options:
        choices = tuple(m for m, _ in options)
        meta["options"] = [text for _, text in options]
        if answer.rstrip(".") not in choices:
            raise LoaderError(
                f"{file}: {rid}: the answer {answer!r} is not the letter of one of the options the question lists "
                f"({', '.join(choices)})"
            )
        answer = answer.rstrip(".")
    return QuestionSample(
        image_path=image_path,
        image_bytes=image_bytes,
        question=question,
        answer=answer,
        task="reasoning",
        source="realworldqa",
        id=f"{name}:{rid}" if name else rid,
        choices=choices,
        meta=meta,
    )
