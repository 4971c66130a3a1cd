"""The sample type shared by the benchmark loaders, their error, and helpers to read annotation files.

Every loader turns a local copy of a counting benchmark into a list of `CountSample`: one image
(a file path or encoded bytes, opened lazily), one counting question and its integer answer, with
the object points or boxes where the benchmark has them. Annotation files are JSON (one document),
JSONL (one JSON object per line) or parquet (one record per row, as Hugging Face stores datasets);
`read_records` picks the reader from the file suffix and pairs each record with a descriptor of
where it is ("line 3", "row 2", "record 5"). Records are validated when they are loaded, with
`record_field`, so a malformed record fails at load time with a `LoaderError` that names the file, the
record and the field; images are opened only when `CountSample.image` is read.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from countlens.errors import InputError

PathLike = str | os.PathLike


class LoaderError(InputError):
    """A benchmark file, record or image that cannot be loaded; the message names it and the fix."""


@dataclass(frozen=True)
class CountSample:
    """One counting question about one image, from a real benchmark.

    Exactly one of ``image_path`` and ``image_bytes`` is set. ``points`` ((n, 2) x, y in pixels) and
    ``boxes`` ((n, 4) x0, y0, x1, y1) hold one row per counted object when the benchmark has them.
    ``meta`` always holds ``count``, so a sample works with `countlens.analysis.evaluate.score`.
    """

    image_path: Path | None
    image_bytes: bytes | None = field(repr=False)
    question: str
    count: int
    points: np.ndarray | None = field(repr=False, compare=False)
    boxes: np.ndarray | None = field(repr=False, compare=False)
    source: str
    id: str
    split: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = _check_image_source(self)
        if isinstance(self.count, bool) or not isinstance(self.count, (int, np.integer)) or self.count < 0:
            raise LoaderError(f"{where}: count is {self.count!r}; a count must be a non-negative integer")
        object.__setattr__(self, "count", int(self.count))
        for name, width in (("points", 2), ("boxes", 4)):
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.array(value, dtype=np.float64)
            if arr.size == 0:
                arr = arr.reshape(0, width)
            if arr.ndim != 2 or arr.shape[1] != width:
                raise LoaderError(f"{where}: {name} has shape {arr.shape}, expected (n, {width})")
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "meta", {**self.meta, "count": self.count})

    @property
    def image(self) -> Image.Image:
        """The image as PIL RGB, read from ``image_path`` or decoded from ``image_bytes`` on each access."""
        return open_image(self)

    @property
    def answer(self) -> str:
        return str(self.count)

    @property
    def task(self) -> str:
        return "count"


@dataclass(frozen=True)
class QuestionSample:
    """One question about one image from a real reasoning benchmark (CLEVR, MathVista, MMMU,
    RealWorldQA), with its answer as the benchmark writes it and, for a multiple-choice question, its
    ``choices`` (what the model is to answer: MathVista's option texts, MMMU's and RealWorldQA's
    letters, whose texts are in ``meta["options"]``).

    ``task`` names what the question exercises ("spatial", "math", "reasoning"), so the samples of a
    local copy can stand in for countlens's procedural tasks of that name."""

    image_path: Path | None
    image_bytes: bytes | None = field(repr=False)
    question: str
    answer: str
    task: str
    source: str
    id: str
    choices: tuple[str, ...] | None = None
    split: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = _check_image_source(self)
        for name in ("question", "answer"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise LoaderError(f"{where}: {name} {getattr(self, name)!r} must be a non-empty string")
        if self.choices is not None:
            choices = self.choices
            if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
                raise LoaderError(f"{where}: choices {choices!r} must be a tuple of strings")
            choices = tuple(choices)
            if len(set(choices)) != len(choices) or len(choices) < 2 or self.answer not in choices:
                raise LoaderError(
                    f"{where}: choices {list(choices)} must be at least two distinct options holding the answer "
                    f"{self.answer!r}"
                )
            object.__setattr__(self, "choices", choices)

    @property
    def image(self) -> Image.Image:
        """The image as PIL RGB, read from ``image_path`` or decoded from ``image_bytes`` on each access."""
        return open_image(self)


def _check_image_source(sample: CountSample | QuestionSample) -> str:
    """Refuse a loaded sample without exactly one image source; make its path a Path. Returns the
    sample's name for messages ("fsc147 sample '2.jpg'")."""
    where = f"{sample.source} sample {sample.id!r}"
    if (sample.image_path is None) == (sample.image_bytes is None):
        raise LoaderError(f"{where}: give exactly one of image_path and image_bytes")
    if sample.image_path is not None:
        object.__setattr__(sample, "image_path", Path(sample.image_path))
    return where


#: Modes whose values hold more than 8 bits per channel (16-bit PNGs open as "I;16" or "I").
_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def decode_image(image: Image.Image, source: str) -> Image.Image:
    """``image`` as the RGB picture a person (and the model's processor) sees; every loader's images
    pass through here. ``source``: the benchmark, named in the warnings.

    - EXIF orientation applied (`PIL.ImageOps.exif_transpose`), as Hugging Face ``datasets`` decodes
      photos: a phone JPEG stored sideways with orientation 6 comes out upright, so "left of" keeps
      its meaning;
    - transparency (an alpha channel, or a palette's or a colour key's transparent entry) composited
      on white, as transformers' own ``convert_to_rgb`` does: a bare ``convert("RGB")`` drops the alpha
      and shows what the transparent pixels store, black for most diagrams;
    - 16-bit and float greyscale scaled to 8 bits (``convert`` would clip every value above 255 to
      white), with a warning: the low bits are lost;
    - CMYK converted without its colour profile, with a warning: its colours may shift;
    - palette, greyscale, bilevel and other modes converted to RGB as they are.
    """
    from PIL import ImageOps

    image = ImageOps.exif_transpose(image)  # a copy, upright; without an orientation tag, the same pixels
    if image.mode in _WIDE_MODES:
        values = np.asarray(image, dtype=np.float64)
        if values.size and np.nanmax(values) > 255:  # 16-bit data: 65535 is white
            warnings.warn(
                f"{source}: an image of mode {image.mode!r} (16 bits per pixel) is reduced to 8 bits, as the "
                "model's processor sees it; the low bits are lost",
                stacklevel=3,
            )
            values = values / 257
        image = Image.fromarray(np.clip(np.nan_to_num(values), 0, 255).round().astype(np.uint8), "L")
    if image.mode == "CMYK":
        warnings.warn(
            f"{source}: a CMYK image is converted to RGB without its colour profile; its colours may shift",
            stacklevel=3,
        )
    transparent = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if not transparent:
        return image if image.mode == "RGB" else image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def open_image(sample: CountSample | QuestionSample) -> Image.Image:
    """A loaded sample's image as PIL RGB (`decode_image`), or a LoaderError naming the file (or
    record) and the fix."""
    if sample.image_path is not None:
        what = f"{sample.image_path} (image of {sample.source} sample {sample.id!r})"
        try:
            with Image.open(sample.image_path) as im:
                return decode_image(im, sample.source)
        except FileNotFoundError:
            raise LoaderError(
                f"{what}: file not found; check that the images are extracted and that the image root "
                "given to the loader is their directory"
            ) from None
        except (OSError, Image.DecompressionBombError) as e:
            raise LoaderError(f"{what}: not a readable image ({e}); re-download or remove this file") from None
    where = f"{sample.meta.get('file', sample.source)}: {sample.source} sample {sample.id!r}"
    try:
        with Image.open(io.BytesIO(sample.image_bytes)) as im:
            return decode_image(im, sample.source)
    except (OSError, Image.DecompressionBombError) as e:
        raise LoaderError(f"{where}: the image bytes are not a readable image ({e})") from None


def annotation_files(path: PathLike, pattern: str, fix: str) -> list[Path]:
    """The annotation files of a copy given as one file, or as a folder searched for ``pattern`` at any
    depth (Hugging Face keeps a data set's parquet files in data/ or one folder per subset), in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob(pattern))
        if not files:
            raise LoaderError(f"{path}: no {pattern} files at any depth; {fix}")
        return files
    if not path.exists():
        raise LoaderError(f"{path}: not found; {fix}")
    return [path]


def require_images_per_file(samples: list, files: list[Path], fix: str) -> None:
    """`require_images` for samples read from several annotation files: each file's images beside it."""
    for file in files:
        require_images([s for s in samples if s.meta["file"] == str(file)], file.parent, "images", fix)


def require_images(samples: list, folder: Path, what: str, fix: str) -> None:
    """Refuse, at load time, samples whose image file is missing (every image is read later, by scoring
    or training): how many of the ``what`` (e.g. "images of split 'train'") and the first few."""
    missing = [s.id for s in samples if s.image_path is not None and not s.image_path.is_file()]
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (" …" if len(missing) > 5 else "")
        raise LoaderError(f"{folder}: {len(missing)} of the {len(samples)} {what} are missing ({shown}); {fix}")


# ---------------------------------------------------------------------------------------------
# Reading files


def require_file(path: PathLike, fix: str = "") -> Path:
    """``path`` as a Path, or a LoaderError saying it is missing (and ``fix``)."""
    path = Path(path)
    if not path.is_file():
        state = "is a directory, expected a file" if path.is_dir() else "not found"
        raise LoaderError(f"{path}: {state}" + (f"; {fix}" if fix else ""))
    return path


def read_json(path: PathLike, fix: str = "") -> Any:
    """The JSON document in ``path``."""
    path = require_file(path, fix)
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise LoaderError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise LoaderError(f"{path}: not UTF-8 text ({e.reason}); is this the right file?") from None


def read_jsonl(path: PathLike, fix: str = "") -> list[tuple[str, dict]]:
    """The objects of a JSONL file, one per non-blank line, each with its descriptor "line N"."""
    path = require_file(path, fix)
    out = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LoaderError(f"{path}: line {n}: invalid JSON at column {e.colno}: {e.msg}") from None
                if not isinstance(record, dict):
                    raise LoaderError(f"{path}: line {n}: a record must be a JSON object, got {_type(record)}")
                out.append((f"line {n}", record))
    except UnicodeDecodeError as e:
        raise LoaderError(f"{path}: not UTF-8 text ({e.reason}); is this the right file?") from None
    return out


def read_parquet(path: PathLike, fix: str = "") -> list[tuple[str, dict]]:
    """The rows of a parquet file as dicts, each with its descriptor "row N" (0-based)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = require_file(path, fix)
    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise LoaderError(f"{path}: not a readable parquet file ({e})") from None
    return [(f"row {i}", row) for i, row in enumerate(rows)]


def read_records(path: PathLike, fix: str = "") -> list[tuple[str, dict]]:
    """The records of a .json (a list of objects), .jsonl/.ndjson or .parquet file, with descriptors."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return read_jsonl(path, fix)
    if suffix == ".parquet":
        return read_parquet(path, fix)
    if suffix == ".json":
        data = read_json(path, fix)
        if not isinstance(data, list):
            raise LoaderError(f"{path}: expected a JSON list of records, got {_type(data)}")
        out = []
        for i, record in enumerate(data):
            if not isinstance(record, dict):
                raise LoaderError(f"{path}: record {i}: a record must be a JSON object, got {_type(record)}")
            out.append((f"record {i}", record))
        return out
    raise LoaderError(f"{path}: unknown annotation format {suffix or '(no suffix)'!r}; use .json, .jsonl or .parquet")


# ---------------------------------------------------------------------------------------------
# Validating records

_MISSING = object()


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _expected(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)


def record_field(
    record: dict,
    name: str,
    types: type | tuple[type, ...],
    file: PathLike,
    record_id: str,
    default: Any = _MISSING,
    fix: str = "",
) -> Any:
    """``record[name]``, checked to be of ``types``; a missing (or null) field gives ``default`` if given.

    A bool is not accepted as an int, and an int is accepted as a float.
    """
    suffix = f"; {fix}" if fix else ""
    if record.get(name) is None:
        if default is not _MISSING:
            return default
        raise LoaderError(f"{file}: {record_id}: field {name!r} is missing{suffix}")
    value = record[name]
    allowed = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
    if not ok and float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise LoaderError(
            f"{file}: {record_id}: field {name!r} has type {_type(value)}, expected {_expected(types)}{suffix}"
        )
    return value


def count_field(record: dict, name: str, file: PathLike, record_id: str) -> int:
    """``record[name]`` as a count: an int ≥ 0."""
    value = record_field(record, name, int, file, record_id)
    if value < 0:
        raise LoaderError(f"{file}: {record_id}: field {name!r} is {value}; a count must be ≥ 0")
    return value


def points_field(record: dict, name: str, file: PathLike, record_id: str) -> np.ndarray | None:
    """``record[name]`` as an (n, 2) float array of x, y; from [x, y] pairs or {"x", "y"} dicts; None if absent."""
    value = record_field(record, name, list, file, record_id, default=None)
    if value is None:
        return None
    out = np.zeros((len(value), 2))
    for i, p in enumerate(value):
        if isinstance(p, dict) and "x" in p and "y" in p:
            p = (p["x"], p["y"])
        if (
            not isinstance(p, (list, tuple))
            or len(p) != 2
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in p)
        ):
            raise LoaderError(
                f'{file}: {record_id}: field {name!r}: item {i} is {p!r}; expected [x, y] or {{"x": x, "y": y}} numbers'
            )
        out[i] = p
    return out


def image_field(
    record: dict, names: tuple[str, ...], image_root: Path, file: PathLike, record_id: str
) -> tuple[Path | None, bytes | None]:
    """The image of a record as (path, None) or (None, bytes), from the first present field of ``names``.

    A field may hold a path (relative to ``image_root``), raw bytes, or a ``{"bytes": ..., "path": ...}``
    dict as Hugging Face stores images in parquet.
    """
    name = next((n for n in names if record.get(n) is not None), None)
    if name is None:
        raise LoaderError(f"{file}: {record_id}: field {' / '.join(repr(n) for n in names)} is missing")
    value = record[name]
    if isinstance(value, dict):
        if isinstance(value.get("bytes"), (bytes, bytearray)) and value["bytes"]:
            return None, bytes(value["bytes"])
        if isinstance(value.get("path"), str) and value["path"]:
            return image_root / value["path"], None
        raise LoaderError(f"{file}: {record_id}: field {name!r} is a dict without 'bytes' or 'path'")
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise LoaderError(f"{file}: {record_id}: field {name!r} holds empty bytes")
        return None, bytes(value)
    if isinstance(value, str):
        if not value:
            raise LoaderError(f"{file}: {record_id}: field {name!r} is an empty path")
        return image_root / value, None
    raise LoaderError(
        f"{file}: {record_id}: field {name!r} has type {_type(value)}, "
        "expected str (a path), bytes or a {'bytes': ...} dict"
    )


def check_template(question: str, key: str) -> None:
    """A LoaderError unless ``question`` formats with ``key`` alone."""
    try:
        question.format(**{key: "objects"})
    except (KeyError, IndexError, ValueError) as e:
        raise LoaderError(f"question template {question!r} is invalid ({e!r}); it may use only {{{key}}}") from None


def check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise LoaderError(f"limit is {limit!r}; give a non-negative int or None")
