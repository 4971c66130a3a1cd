"""PASCAL VOC 2007 (Everingham et al.): 20 object classes with boxes — the MAS paper's probing data.

Expected layout of ``root`` (``VOCdevkit/VOC2007`` as distributed): ``ImageSets/Main/<split>.txt``
(one image id per line, its first word), ``Annotations/<id>.xml`` (``size`` and one ``object`` per
box: ``name``, ``difficult``, ``bndbox`` with ``xmin``, ``ymin``, ``xmax``, ``ymax``) and
``JPEGImages/<id>.jpg``. As the paper's code (``models_probing/datasets/voc_custom.py``) reads it:
difficult objects are kept, boxes with no extent dropped, and each image is letterboxed to a square
of ``side`` pixels (512: scaled to fit, bilinear, centred on grey 114) with its boxes moved with it.
The code trains on a non-standard ``train_test.txt`` list and colour-jitters every image, the test
set's included; here ``split`` names a standard list and images are not jittered.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from countlens.datasets.loaders.common import LoaderError, PathLike, check_limit, decode_image

VOC_CLASSES: tuple[str, ...] = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)
#: The question the paper's code gives the model when it reads the LLM tap.
QUESTION = "Describe the objects in this image."
_FIX = "pass the VOC2007 folder that holds ImageSets/, Annotations/ and JPEGImages/"


@dataclass(frozen=True)
class DetectionSample:
    """One letterboxed image with its boxes (``boxes``: (n, 4) x0, y0, x1, y1 in the letterboxed
    image's pixels) and their class indices (``labels``, into ``classes``)."""

    image_path: Path
    boxes: np.ndarray = field(repr=False)
    labels: np.ndarray = field(repr=False)
    id: str
    side: int = 512
    classes: tuple[str, ...] = VOC_CLASSES
    question: str = QUESTION
    answer: str = "objects"
    task: str = "detection"
    source: str = "voc2007"
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def image(self) -> Image.Image:
        """The image letterboxed to ``side`` × ``side`` (as the code's ``_letterbox``)."""
        try:
            with Image.open(self.image_path) as im:
                image = decode_image(im, self.source)
        except (OSError, Image.DecompressionBombError) as err:
            raise LoaderError(f"{self.image_path}: not a readable image ({err})") from None
        scale, (pw, ph) = _letterbox(image.width, image.height, self.side)
        resized = image.resize((int(image.width * scale), int(image.height * scale)), Image.BILINEAR)
        canvas = Image.new("RGB", (self.side, self.side), (114, 114, 114))
        canvas.paste(resized, (pw, ph))
        return canvas


def _letterbox(width: int, height: int, side: int) -> tuple[float, tuple[int, int]]:
    """The scale and the (x, y) offset that fit a width × height image centred in a side × side square."""
    scale = min(side / width, side / height)
    return scale, ((side - int(width * scale)) // 2, (side - int(height * scale)) // 2)


def load_voc2007(
    root: PathLike, split: str = "test", *, side: int = 512, limit: int | None = None
) -> list[DetectionSample]:
    """The images of one VOC2007 list as `DetectionSample`, in the list's order."""
    check_limit(limit)
    root = Path(root)
    listing = root / "ImageSets" / "Main" / f"{split}.txt"
    if not listing.is_file():
        raise LoaderError(f"{listing}: not found; {_FIX} (split is one of its lists: train, val, trainval, test)")
    ids = [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]
    if not ids:  # a list cut short in the copy: no probe can be fitted or scored on no images
        raise LoaderError(
            f"{listing}: VOC2007's {split!r} list names no images; the copy is incomplete — {_FIX}, with its "
            f"ImageSets/Main/{split}.txt as the original lists it"
        )
    out = []
    for image_id in ids[:limit] if limit is not None else ids:
        xml = root / "Annotations" / f"{image_id}.xml"
        image = root / "JPEGImages" / f"{image_id}.jpg"
        if not image.is_file():
            raise LoaderError(f"{image}: missing (listed in {listing.name}); {_FIX}")
        boxes, labels, size = _objects(xml)
        scale, (pw, ph) = _letterbox(*size, side)
        moved = (boxes * scale + np.array([pw, ph, pw, ph])).clip(0, side) if len(boxes) else boxes
        out.append(DetectionSample(image, moved, labels, image_id, side, meta={"file": str(xml), "size": size}))
    return out


def _objects(xml: Path) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(boxes (n, 4) in the original pixels, class indices, (width, height)) of one annotation file."""
    try:
        tree = ET.parse(xml).getroot()
    except FileNotFoundError:
        raise LoaderError(f"{xml}: missing; {_FIX}") from None
    except ET.ParseError as err:
        raise LoaderError(f"{xml}: not valid XML ({err})") from None
    try:
        size = tree.find("size")
        width, height = int(size.findtext("width")), int(size.findtext("height"))
    except (AttributeError, TypeError, ValueError):
        raise LoaderError(f"{xml}: no <size> with integer <width> and <height>") from None
    if width < 1 or height < 1:
        raise LoaderError(f"{xml}: <size> is {width} × {height}; an image has at least one pixel a side")
    boxes, labels = [], []
    for k, obj in enumerate(tree.findall("object")):
        name = (obj.findtext("name") or "").strip()
        if name not in VOC_CLASSES:
            raise LoaderError(f"{xml}: object {k}: class {name!r} is not one of VOC's 20")
        try:
            bb = obj.find("bndbox")
            box = [float(bb.findtext(t)) for t in ("xmin", "ymin", "xmax", "ymax")]
        except (AttributeError, TypeError, ValueError):
            raise LoaderError(f"{xml}: object {k}: <bndbox> needs numeric xmin, ymin, xmax, ymax") from None
        if box[2] > box[0] and box[3] > box[1]:  # the code drops boxes with no extent
            boxes.append(box)
            labels.append(VOC_CLASSES.index(name))
    return np.array(boxes, dtype=float).reshape(-1, 4), np.array(labels, dtype=int), (width, height)
