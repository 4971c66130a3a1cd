"""FSC-147 (Ranjan et al., CVPR 2021): class-agnostic counting, 6135 images of 147 object classes.

Expected layout of ``root`` (as the dataset is distributed): ``annotation_FSC147_384.json``, a
dict from image name (``"2.jpg"``) to ``{"points": [[x, y], ...], "box_examples_coordinates":
[[[x, y] × 4], ...], "H": ..., "W": ..., ...}`` with one point per object in the pixels of the
384-px-high images; ``Train_Test_Val_FSC_147.json``, a dict from split name (``"train"``,
``"val"``, ``"test"``, also ``"val_coco"`` / ``"test_coco"``) to a list of image names; the images
in ``images_384_VarV2/<name>``; and optionally ``ImageClasses_FSC147.txt``, lines
``name<TAB>class``, whose class names the question (``"objects"`` when the file or the line is
absent). The count is the number of points. The three exemplar boxes of an image are not one box
per object, so they go to ``meta["exemplar_boxes"]`` ((3, 4) x0, y0, x1, y1), not to ``boxes``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from countlens.datasets.loaders.common import (
    CountSample,
    LoaderError,
    PathLike,
    check_limit,
    check_template,
    points_field,
    read_json,
    record_field,
    require_file,
    require_images,
)

ANNOTATIONS = "annotation_FSC147_384.json"
SPLITS = "Train_Test_Val_FSC_147.json"
CLASSES = "ImageClasses_FSC147.txt"
IMAGES = "images_384_VarV2"
DEFAULT_OBJECT = "objects"
_FIX = "download FSC-147 and pass the directory that holds its annotation files as root"


def load_fsc147(
    root: PathLike,
    split: str = "test",
    question: str = "How many {name} are there in the image?",
    *,
    image_dir: str = IMAGES,
    limit: int | None = None,
) -> list[CountSample]:
    """The images of one FSC-147 split as `CountSample`, in the split file's order; each image file
    must be there (a missing one is a `LoaderError` naming it).

    ``question`` is formatted with ``name``, the image's class (plural, as FSC-147 spells it).
    """
    check_limit(limit)
    root = Path(root)
    if not root.is_dir():
        raise LoaderError(f"{root}: FSC-147 root directory not found; {_FIX}")
    ann_file, split_file = root / ANNOTATIONS, root / SPLITS
    annotations = read_json(ann_file, _FIX)
    if not isinstance(annotations, dict):
        got = type(annotations).__name__
        raise LoaderError(f"{ann_file}: expected a JSON object from image name to annotation, got {got}")
    splits = read_json(split_file, _FIX)
    if not isinstance(splits, dict):
        got = type(splits).__name__
        raise LoaderError(f"{split_file}: expected a JSON object from split name to image names, got {got}")
    if split not in splits:
        raise LoaderError(f"{split_file}: unknown split {split!r}; this file has {', '.join(map(repr, splits))}")
    names = splits[split]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise LoaderError(f"{split_file}: split {split!r} must be a list of image names")
    classes = _read_classes(root / CLASSES)
    check_template(question, "name")

    out = []
    for name in names[:limit] if limit is not None else names:
        if name not in annotations:
            raise LoaderError(f"{ann_file}: image {name!r} of split {split!r} ({split_file.name}) has no annotation")
        record = annotations[name]
        rid = f"image {name!r}"
        if not isinstance(record, dict):
            raise LoaderError(f"{ann_file}: {rid}: annotation has type {type(record).__name__}, expected dict")
        points = points_field(record, "points", ann_file, rid)
        if points is None:
            raise LoaderError(f"{ann_file}: {rid}: field 'points' is missing")
        meta: dict = {"file": str(ann_file), "class": classes.get(name, DEFAULT_OBJECT)}
        exemplars = _exemplar_boxes(record, ann_file, rid)
        if exemplars is not None:
            meta["exemplar_boxes"] = exemplars
        for key in ("H", "W"):
            value = record_field(record, key, (int, float), ann_file, rid, default=None)
            if value is not None:
                meta[key] = value
        out.append(
            CountSample(
                image_path=root / image_dir / name,
                image_bytes=None,
                question=question.format(name=meta["class"]),
                count=len(points),
                points=points,
                boxes=None,
                source="fsc147",
                id=name,
                split=split,
                meta=meta,
            )
        )
    require_images(out, root / image_dir, f"images of split {split!r}", f"copy the whole {image_dir} folder there")
    return out


def _read_classes(path: Path) -> dict[str, str]:
    """Image name → class name from ``ImageClasses_FSC147.txt``; empty when the file is absent."""
    if not path.exists():
        return {}
    path = require_file(path)
    classes = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        name, sep, cls = line.partition("\t")
        if not sep or not cls.strip():
            raise LoaderError(f"{path}: line {n}: expected 'image name<TAB>class name', got {line!r}")
        classes[name.strip()] = cls.strip()
    return classes


def _exemplar_boxes(record: dict, file: Path, rid: str) -> np.ndarray | None:
    """The exemplar boxes (four corners each) as an (n, 4) x0, y0, x1, y1 array; None if absent."""
    boxes = record_field(record, "box_examples_coordinates", list, file, rid, default=None)
    if boxes is None:
        return None
    out = np.zeros((len(boxes), 4))
    for i, corners in enumerate(boxes):
        try:
            arr = np.asarray(corners, dtype=np.float64)
        except (TypeError, ValueError):
            arr = np.zeros(0)
        if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) == 0:
            raise LoaderError(
                f"{file}: {rid}: field 'box_examples_coordinates': item {i} is {corners!r}; "
                "expected a list of [x, y] corners"
            )
        out[i] = [*arr.min(0), *arr.max(0)]
    return out
