"""TallyQA (Acharya et al., AAAI 2019): counting questions on Visual Genome and COCO images.

Expected input: TallyQA's ``test.json`` (or ``train.json``), a JSON list of records, or a JSONL
file of the same records, each with ``image`` (a path relative to ``image_root``, e.g.
``"VG_100K/2410.jpg"`` or ``"train2014/COCO_train2014_….jpg"``, so ``image_root`` is the directory
that holds the Visual Genome and COCO image folders), ``question`` (str), ``answer`` (int ≥ 0),
``issimple`` (bool; only ``test.json`` has it), and optionally ``question_id``, ``image_id`` and
``data_source``. ``simple_only`` keeps the simple questions ("how many dogs?") and drops the
complex ones ("how many dogs are lying down?"); it needs ``issimple`` on every record.
"""

from __future__ import annotations

from pathlib import Path

from countlens.datasets.loaders.common import (
    CountSample,
    LoaderError,
    PathLike,
    check_limit,
    count_field,
    read_records,
    record_field,
)


def load_tallyqa(
    path: PathLike, image_root: PathLike, simple_only: bool = False, *, limit: int | None = None
) -> list[CountSample]:
    """The records of a TallyQA JSON or JSONL file as `CountSample`, in file order.

    ``limit`` counts the kept records (after ``simple_only``).
    """
    check_limit(limit)
    path = Path(path)
    root = Path(image_root)
    if not root.is_dir():
        raise LoaderError(
            f"{root}: TallyQA image root not found; pass the directory that holds VG_100K*/ and the COCO folders"
        )
    records = read_records(path, "pass TallyQA's test.json or train.json")
    fix = "simple_only needs it; TallyQA marks simple questions in test.json only, so use simple_only=False here"
    out: list[CountSample] = []
    for i, (rid, record) in enumerate(records):
        if limit is not None and len(out) >= limit:
            break
        image = record_field(record, "image", str, path, rid)
        question = record_field(record, "question", str, path, rid)
        count = count_field(record, "answer", path, rid)
        if simple_only:
            issimple = record_field(record, "issimple", bool, path, rid, fix=fix)
        else:
            issimple = record_field(record, "issimple", bool, path, rid, default=None)
        if simple_only and not issimple:
            continue
        question_id = record_field(record, "question_id", (int, str), path, rid, default=None)
        image_id = record_field(record, "image_id", (int, str), path, rid, default=None)
        source = record_field(record, "data_source", str, path, rid, default=None)
        out.append(
            CountSample(
                image_path=root / image,
                image_bytes=None,
                question=question,
                count=count,
                points=None,
                boxes=None,
                source="tallyqa",
                id=str(question_id if question_id is not None else i),
                split=None,
                meta={
                    "file": str(path),
                    "issimple": issimple,
                    "question_id": question_id,
                    "image_id": image_id,
                    "data_source": source,
                },
            )
        )
    return out
