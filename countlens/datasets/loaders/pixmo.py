"""PixMo-Count (Deitke et al., 2024, the Molmo data): natural images with a point per counted object.

Expected input: one file per split, JSONL (one object per line) or parquet (as the Hugging Face
dataset stores it), one record per image, with ``image`` — a path relative to ``image_root``
(default: the file's directory), raw bytes, or a ``{"bytes": ..., "path": ...}`` dict as Hugging
Face stores images in parquet — or ``image_path`` (a path); ``count`` (int ≥ 0); optionally
``points`` (a list of ``{"x": x, "y": y}`` or ``[x, y]`` in pixels); optionally ``label`` (the
object name, plural, for the question; ``"objects"`` when absent); and optionally ``id``. The
hub copy lists image URLs only: download the images first and write their local paths (or bytes).
``split`` labels every sample (a file holds one split); without it a record's own ``split`` is used.
"""

from __future__ import annotations

from pathlib import Path

from countlens.datasets.loaders.common import (
    CountSample,
    PathLike,
    check_limit,
    check_template,
    count_field,
    image_field,
    points_field,
    read_records,
    record_field,
)

QUESTION = "How many {label} are there in the image?"
DEFAULT_OBJECT = "objects"


def load_pixmo_count(
    path: PathLike,
    image_root: PathLike | None = None,
    split: str | None = None,
    *,
    question: str = QUESTION,
    limit: int | None = None,
) -> list[CountSample]:
    """The records of a PixMo-Count JSONL or parquet file as `CountSample`, in file order."""
    check_limit(limit)
    check_template(question, "label")
    path = Path(path)
    records = read_records(path, "pass the JSONL or parquet file of a local PixMo-Count copy")
    root = Path(image_root) if image_root is not None else path.parent
    out = []
    for i, (rid, record) in enumerate(records[:limit] if limit is not None else records):
        image_path, image_bytes = image_field(record, ("image", "image_path"), root, path, rid)
        count = count_field(record, "count", path, rid)
        points = points_field(record, "points", path, rid)
        label = record_field(record, "label", str, path, rid, default=DEFAULT_OBJECT)
        sample_id = record_field(record, "id", (str, int), path, rid, default=i)
        row_split = record_field(record, "split", str, path, rid, default=None)
        meta = {"file": str(path), "label": label}
        if "image_url" in record:
            meta["image_url"] = record["image_url"]
        out.append(
            CountSample(
                image_path=image_path,
                image_bytes=image_bytes,
                question=question.format(label=label),
                count=count,
                points=points,
                boxes=None,
                source="pixmo_count",
                id=str(sample_id),
                split=split if split is not None else row_split,
                meta=meta,
            )
        )
    return out
