"""CountBench (Paiss et al., ICCV 2023): 540 web images of 2–10 objects with a counting question.

Expected input: a JSONL or parquet file (as the Hugging Face ``CountBenchQA`` copy stores it), one
record per image, with ``image`` (a path relative to ``image_root``, default the file's directory,
or raw bytes, or a ``{"bytes": ..., "path": ...}`` dict as Hugging Face stores images in parquet),
``question`` (str), ``number`` (int ≥ 0, the count), and optionally ``text`` (the caption, kept in
``meta``) and ``id``. CountBench has no points or boxes.
"""

from __future__ import annotations

from pathlib import Path

from countlens.datasets.loaders.common import (
    CountSample,
    PathLike,
    check_limit,
    count_field,
    image_field,
    read_records,
    record_field,
)


def load_countbench(
    path: PathLike, image_root: PathLike | None = None, *, limit: int | None = None
) -> list[CountSample]:
    """The records of a CountBench JSONL or parquet file as `CountSample`, in file order."""
    check_limit(limit)
    path = Path(path)
    records = read_records(path, "pass the JSONL or parquet file of a local CountBench copy")
    root = Path(image_root) if image_root is not None else path.parent
    out = []
    for i, (rid, record) in enumerate(records[:limit] if limit is not None else records):
        image_path, image_bytes = image_field(record, ("image",), root, path, rid)
        question = record_field(record, "question", str, path, rid)
        count = count_field(record, "number", path, rid)
        sample_id = record_field(record, "id", (str, int), path, rid, default=i)
        meta: dict = {"file": str(path)}
        text = record_field(record, "text", str, path, rid, default=None)
        if text is not None:
            meta["text"] = text
        out.append(
            CountSample(
                image_path=image_path,
                image_bytes=image_bytes,
                question=question,
                count=count,
                points=None,
                boxes=None,
                source="countbench",
                id=str(sample_id),
                split=None,
                meta=meta,
            )
        )
    return out
