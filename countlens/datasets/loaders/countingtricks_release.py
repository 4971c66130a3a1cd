"""The MAS paper's released COUNTINGTRICKS images, read as its evaluation script reads them.

Expected layout of ``root`` (``vlm-count-eval/eval_accu_count/run.py`` of the paper's repository):
``images/<case>/<name>.png`` and a label per image, ``labels/<case>/<name>.json`` holding ``count``;
or, as the paper's generator writes its labels (``synthetic_data/generate.py``), one file per case,
``labels/<case>_labels.json``: a list of ``{"image_id": "<name>.png", "count", "circles": [{"x", "y",
"radius", …}]}``, whose circle centres become the samples' ``points``. Cases are the folders under
``images/`` (sorted), images their ``.png`` files in name order (as ``run.py`` sorts them: img_0,
img_1, img_10 …). ``run.py`` gives an image without a label the gold −1 and skips it; here a missing
label is refused, naming the image. The question defaults to ``run.py``'s ("How many red circle dots
in the image?", without its "PLEASE LOOK" prefix, which it glues to the question with no space).
"""

from __future__ import annotations

from pathlib import Path

from countlens.datasets.loaders.common import (
    CountSample,
    LoaderError,
    PathLike,
    check_limit,
    count_field,
    read_json,
    record_field,
)

QUESTION = "How many red circle dots in the image?"
_FIX = "pass the folder that holds the release's images/<case>/ and labels/"


def load_countingtricks_release(
    root: PathLike, cases: list[str] | None = None, *, question: str = QUESTION, limit: int | None = None
) -> list[CountSample]:
    """The release's images as `CountSample` (source "countingtricks-release", ``meta["case"]``), case by
    case; ``limit`` images per case at most."""
    check_limit(limit)
    root = Path(root)
    images = root / "images"
    if not images.is_dir():
        raise LoaderError(f"{root}: no images/ folder; {_FIX}")
    found = sorted(p.name for p in images.iterdir() if p.is_dir())
    names = found if cases is None else list(cases)
    missing = [c for c in names if c not in found]
    if missing:
        raise LoaderError(f"{images}: no folder for cases {missing}; it holds {found}")
    out = []
    for case in names:
        files = sorted(p for p in (images / case).iterdir() if p.suffix.lower() == ".png")
        if not files:
            raise LoaderError(f"{images / case}: the folder of case {case} holds no .png image; {_FIX}")
        merged = _merged_labels(root / "labels" / f"{case}_labels.json")
        for file in files[:limit] if limit is not None else files:
            count, points = _label(root, case, file, merged)
            out.append(
                CountSample(
                    image_path=file,
                    image_bytes=None,
                    question=question,
                    count=count,
                    points=points,
                    boxes=None,
                    source="countingtricks-release",
                    id=f"{case}/{file.name}",
                    meta={"case": case},
                )
            )
    return out


def _merged_labels(path: Path) -> dict[str, dict] | None:
    """The generator's per-case label list by image name, or None when there is no such file."""
    if not path.exists():
        return None
    data = read_json(path, _FIX)
    if not isinstance(data, list):
        raise LoaderError(f"{path}: expected a JSON list of labels, one per image")
    out = {}
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise LoaderError(f"{path}: label {i}: a label must be a JSON object")
        out[record_field(entry, "image_id", str, path, f"label {i}")] = entry
    return out


def _label(root: Path, case: str, image: Path, merged: dict | None) -> tuple[int, list | None]:
    own = root / "labels" / case / f"{image.stem}.json"
    if own.exists():
        entry, where = read_json(own, _FIX), own
        if not isinstance(entry, dict):
            raise LoaderError(f"{own}: expected a JSON object with 'count'")
    elif merged is not None and image.name in merged:
        entry, where = merged[image.name], root / "labels" / f"{case}_labels.json"
    else:
        raise LoaderError(
            f"{image}: no label (neither {own} nor an entry in labels/{case}_labels.json); "
            "copy the release's labels beside its images"
        )
    count = count_field(entry, "count", where, image.name)
    circles = record_field(entry, "circles", list, where, image.name, default=None)
    points = None
    if circles is not None:
        try:
            points = [[float(c["x"]), float(c["y"])] for c in circles]
        except (KeyError, TypeError, ValueError):
            raise LoaderError(f"{where}: {image.name}: each circle needs numeric 'x' and 'y'") from None
    return count, points
