"""MathVista (Lu et al., ICLR 2024): mathematical reasoning over images — Counting Circuits' math
task and one of its general-reasoning columns.

Expected input: the ``testmini`` (or ``test``) split as Hugging Face stores it, a parquet file with
one row per question, or the original release's JSON (an object from ``pid`` to record, or a list
of records); ``path`` may also be the folder that holds ``testmini*.parquet`` or ``testmini.json``.
Each record has ``pid``, ``question``, ``answer`` (a string, as the benchmark writes it),
``question_type`` (``multi_choice`` or ``free_form``), ``answer_type`` (``text``, ``integer``,
``float`` or ``list``), ``choices`` (the options of a multiple-choice question, which must hold its
answer), optionally ``precision`` (decimal places of a float answer) and ``unit``, and its image as
``decoded_image`` (``{"bytes": ...}``, parquet) or ``image`` (a path relative to ``image_root``,
default the file's folder).
"""

from __future__ import annotations

from pathlib import Path

from countlens.datasets.loaders.common import (
    LoaderError,
    PathLike,
    QuestionSample,
    check_limit,
    image_field,
    read_json,
    read_records,
    record_field,
    require_images,
)

QUESTION_TYPES: tuple[str, ...] = ("multi_choice", "free_form")
ANSWER_TYPES: tuple[str, ...] = ("text", "integer", "float", "list")
_FIX = "pass MathVista's testmini parquet or JSON file (or the folder that holds it)"


def load_mathvista(
    path: PathLike, image_root: PathLike | None = None, *, limit: int | None = None
) -> list[QuestionSample]:
    """The questions of a local MathVista copy as `QuestionSample` (task "math"), in file order."""
    check_limit(limit)
    file = _find(Path(path))
    records = _records(file)
    root = Path(image_root) if image_root is not None else file.parent
    out, seen = [], set()
    for i, (rid, record) in enumerate(records[:limit] if limit is not None else records):
        # `query` is the benchmark's prompt: the question with its hint and, for multiple choice, its
        # options; the bare `question` lacks the options, so it is used only where there is no query.
        question = record_field(record, "query", str, file, rid, default=None) or record_field(
            record, "question", str, file, rid
        )
        answer = str(record_field(record, "answer", (str, int, float), file, rid))
        qtype = record_field(record, "question_type", str, file, rid)
        atype = record_field(record, "answer_type", str, file, rid)
        for name, value, allowed in (("question_type", qtype, QUESTION_TYPES), ("answer_type", atype, ANSWER_TYPES)):
            if value not in allowed:
                raise LoaderError(f"{file}: {rid}: {name} {value!r} is not one of {allowed}")
        choices = record_field(record, "choices", list, file, rid, default=None)
        if qtype == "multi_choice":
            if not choices or not all(isinstance(c, str) for c in choices):
                raise LoaderError(f"{file}: {rid}: a multi_choice question needs 'choices', a list of strings")
            if answer not in choices:
                raise LoaderError(f"{file}: {rid}: the answer {answer!r} is not among the choices {choices}")
        image_path, image_bytes = image_field(record, ("decoded_image", "image"), root, file, rid)
        pid = str(record_field(record, "pid", (str, int), file, rid, default=i))
        if pid in seen:
            raise LoaderError(f"{file}: {rid}: pid {pid!r} appears twice; each question once")
        seen.add(pid)
        meta = {
            "file": str(file),
            "question_type": qtype,
            "answer_type": atype,
            "precision": record_field(record, "precision", (int, float), file, rid, default=None),
            "unit": record_field(record, "unit", str, file, rid, default=None),
        }
        out.append(
            QuestionSample(
                image_path=image_path,
                image_bytes=image_bytes,
                question=question,
                answer=answer,
                task="math",
                source="mathvista",
                id=pid,
                choices=tuple(choices) if qtype == "multi_choice" else None,
                meta=meta,
            )
        )
    require_images(out, root, "images", "copy MathVista's images folder beside the file (or give image_root)")
    return out


def _find(path: Path) -> Path:
    """The annotation file: ``path`` itself, or the testmini file in the folder ``path``."""
    if path.is_dir():
        found = sorted(path.glob("testmini*.parquet")) or sorted(path.glob("testmini.json"))
        if len(found) != 1:
            raise LoaderError(
                f"{path}: {len(found)} testmini*.parquet / testmini.json files here (the Hugging Face copy keeps "
                f"them in data/); {_FIX}"
            )
        return found[0]
    return path


def _records(file: Path) -> list[tuple[str, dict]]:
    """Records with descriptors; the original JSON release is an object from pid to record."""
    if file.suffix.lower() == ".json":
        data = read_json(file, _FIX)
        if isinstance(data, dict):
            out = []
            for pid, record in data.items():
                if not isinstance(record, dict):
                    raise LoaderError(f"{file}: pid {pid!r}: a record must be a JSON object")
                out.append((f"pid {pid!r}", {**record, "pid": record.get("pid") or pid}))
            return out
    return read_records(file, _FIX)
