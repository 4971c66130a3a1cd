"""Positions: where on the sequence an intervention acts, as values resolved per batch.

A position set is resolved against a `Frame` — the rows and columns of one forward — into a
Bool[Tensor, "rows seq"] mask, so one set serves any batch size, a stacked (batch-expanded)
forward, and the new tokens of generation:

- `Group` — a token group of `countlens.circuits.sites.GROUPS`: ``image`` (image tokens), ``last``
  (the read position: the last prompt token and any teacher-forced answer tokens after it), ``text``
  (every other real token) and ``all`` (every real token).
- `Cells` — image tokens by their cell (row, col) of the image-token grid (`Batch.image_cell`).
- `Objects` — the image tokens of chosen objects of each row's scene. Token t belongs to object i
  when object i covers at least ``coverage`` of the pixels of t's cell (``coverage=0``: any pixel),
  or, with ``peak`` (the default), when t's cell holds the largest share of the object's pixels, so
  that an object smaller than the threshold still owns one cell (`countlens.model.cells.object_cells`).
  At the default 0.25 a small object on the organism's 32 px cells owns one or two tokens; with
  ``coverage=0`` every token it touches.
- `Mask` — any Bool[Tensor, "batch seq"] over a prepared batch.

**Rows know their samples.** A value made over a batch's rows (a `Mask`; a `Patch`'s recorded values,
`countlens.circuits.engine.interventions`) is written into a forward by sample, never by row number: each
row's sample is identified by `sample_key` (a frozen sample by its value — scene, question, answer —
else its image and question). `countlens.circuits.record` marks the tensors it returns with the
samples of their rows (`with_samples`, read back by `samples_of`); a forward of batches prepared with
`VLM.prepare_samples` (`score`, `generate`, `effect` do) knows its rows' samples (`Frame.row_keys`), so
row r takes the value's row of the same sample, at any batch size and in any order (`row_index`). A
forward with a sample the value lacks, or whose rows' samples are unknown, is refused. A value without
samples must have exactly the forward's rows (or the rows of the batch that a stacked forward repeats),
or one row, which every row shares. `record` marks them with the batch they were recorded on too
(`with_layout`, read back by `layout_of`): a donor of another token layout has its positions resolved in
its own frame (`countlens.circuits.engine.interventions.donor_rows`).

**New tokens** (generation after the prompt, fed one at a time after a KV cache) belong to ``last``
and ``all`` — each new token is where the next answer token is read — and to no other set: they are
not image tokens, not in any cell or object, and outside a mask, which covers the prompt only.

Cells, objects and masks need the prepared `countlens.model.vlm.Batch` the forward runs on (its token
cells; for objects the samples' scenes, so prepare with `VLM.prepare_samples`); groups are read off
the tokens alone when no batch is known.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from countlens.circuits.sites import GROUPS, check_group, group_mask
from countlens.errors import InputError
from countlens.model.cells import object_cells, object_coverage
from countlens.validate import require_bool, require_choice, require_share

if TYPE_CHECKING:
    from jaxtyping import Bool

    from countlens.model.vlm import VLM, Batch


class Frame(NamedTuple):
    """One forward's rows and columns: its ``input_ids`` and ``attention_mask`` (rows, columns), the
    prepared ``batch`` whose rows these are (or k stacked copies of), if known, and whether the
    columns are ``new`` tokens fed after the prompt (generation with a KV cache)."""

    input_ids: Tensor
    attention_mask: Tensor
    batch: Batch | None
    new: bool = False
    donor: Batch | None = None  # in `countlens.circuits.effect`, the pair's corrupt side

    @classmethod
    def of(cls, batch: Batch, donor: Batch | None = None) -> Frame:
        return cls(batch.inputs["input_ids"], batch.inputs["attention_mask"], batch, donor=donor)

    def need_batch(self, what: str) -> Batch:
        if self.batch is None:
            raise InputError(
                f"{what} need the prepared batch this forward runs on (its image cells and scenes): prepare it "
                "with vlm.prepare_samples(samples) and run that batch, or use a token group"
            )
        return self.batch

    def row_samples(self) -> tuple | None:
        """Each row's sample (k stacked copies of the batch: its samples k times), or None where the rows'
        samples are unknown (no prepared batch, or one prepared without `VLM.prepare_samples`)."""
        samples = None if self.batch is None else self.batch.samples
        rows = self.input_ids.shape[0]
        if not samples or rows % len(samples):
            return None
        return tuple(samples) * (rows // len(samples))

    def row_keys(self) -> tuple | None:
        """Each row's `sample_key`, or None where the rows' samples are unknown (`row_samples`)."""
        samples = self.row_samples()
        return None if samples is None else sample_keys(samples)

    def stacked(self, per_row: Bool[Tensor, "batch seq"]) -> Bool[Tensor, "rows seq"]:
        """A mask over the batch's rows repeated over this forward's stacked rows."""
        k = self.input_ids.shape[0] // per_row.shape[0]
        return torch.cat([per_row] * k).to(self.input_ids.device)


# ----------------------------------------------------------------------------- rows and their samples

_SAMPLES = "countlens_samples"  # the attribute of a tensor that `with_samples` marks
_LAYOUT = "countlens_layout"  # … and `with_layout`


def sample_key(sample) -> Hashable:
    """A stable identity of ``sample``: the sample itself where it hashes (countlens's samples are
    frozen dataclasses, equal when their scene or image, question and answer are), else a digest of
    its image with its question."""
    try:
        hash(sample)
    except TypeError:
        return ("content", sample_digest(sample))
    return sample


def sample_digest(sample) -> bytes:
    """A digest of ``sample``'s content (its image, with its shape, and its question), the same in every
    process and on every machine — unlike `hash`, which Python salts per process."""
    image = np.ascontiguousarray(np.asarray(sample.image))
    h = hashlib.sha256(repr(image.shape).encode())
    h.update(image.tobytes())
    h.update(str(getattr(sample, "question", "")).encode())
    return h.digest()


def sample_keys(samples: Sequence) -> tuple:
    """`sample_key` of each of ``samples``."""
    return tuple(sample_key(s) for s in samples)


def given_sample_keys(samples: Sequence, what: str) -> tuple:
    """`sample_keys` of the samples a user names for the rows of a value (``into=``, ``samples=``): each
    sample once, since two rows given for one sample leave no rule for which a forward writes."""
    keys = sample_keys(samples)
    seen: dict = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise InputError(
                f"{what} names one sample for rows {seen[key]} and {i}: a forward of that sample could take "
                "either; give each sample once (run the other row's values in a separate intervene)"
            )
        seen[key] = i
    return keys


def with_samples(values: Tensor, samples: Sequence) -> Tensor:
    """``values`` (its first axis: one row per sample) marked with the samples of its rows, so that a
    forward writes each row into its own sample's row (`row_index`); returns ``values``. A new tensor
    made from it (``.to(device)``, indexing, arithmetic) is unmarked: mark it again, or give the samples
    where it is used (``Patch(..., into=samples)``)."""
    if len(samples) != values.shape[0]:
        raise InputError(f"{len(samples)} samples for values of {values.shape[0]} rows; give one sample per row")
    setattr(values, _SAMPLES, tuple(samples))
    return values


def samples_of(values) -> tuple | None:
    """The samples of ``values``' rows (`with_samples`: `countlens.circuits.record` marks what it
    returns), or None."""
    return getattr(values, _SAMPLES, None)


def with_layout(values: Tensor, batch: Batch) -> Tensor:
    """``values`` (its first axis: one row per row of ``batch``) marked with the prepared batch they were
    recorded on — its tokens, image cells and scenes — so that positions are resolved in the donor's own
    frame when it is written into a forward of another layout (another prompt length, another task:
    `countlens.circuits.engine.interventions.donor_rows`); returns ``values``. Like `with_samples`, a new
    tensor made from it is unmarked."""
    if len(batch) != values.shape[0]:
        raise InputError(f"a batch of {len(batch)} rows for values of {values.shape[0]} rows; give one row per row")
    tokens = {key: batch.inputs[key] for key in ("input_ids", "attention_mask")}  # no pixels kept alive
    setattr(values, _LAYOUT, Frame.of(replace(batch, inputs=tokens)))
    return values


def layout_of(values) -> Frame | None:
    """The `Frame` of the batch ``values`` were recorded on (`with_layout`: `countlens.circuits.record`
    marks what it returns), or None."""
    return getattr(values, _LAYOUT, None)


def row_index(frame: Frame, keys: tuple | None, n: int, what: str) -> Tensor:
    """For each row of ``frame``'s forward, the row of a value of ``n`` rows written there: by sample
    where the value's rows have ``keys`` (`sample_key`s), else row for row (exactly the forward's rows,
    or the batch's rows that a stacked forward repeats), or one row for all. ``what`` names the value in
    the refusals."""
    rows = frame.input_ids.shape[0]
    if keys is not None:
        here = frame.row_keys()
        if here is None:
            raise InputError(
                f"{what} know the samples of their rows, but this forward's rows are no known samples: run "
                "batches prepared with vlm.prepare_samples(samples) (score, generate and effect do)"
            )
        where: dict = {}
        for i, key in enumerate(keys):
            where.setdefault(key, i)
        missing = [r for r, key in enumerate(here) if key not in where]
        if missing:
            raise InputError(
                f"{what} were made from other samples: none of their {n} rows is the sample of this forward's "
                f"row {missing[0]} ({len(missing)} of its {rows} rows lack theirs). Record them from the samples "
                "that run (record(vlm, vlm.prepare_samples(samples), [site])), or name the sample each of their "
                "rows is written into: Patch(..., into=samples), Mask(..., samples=samples)"
            )
        return torch.tensor([where[key] for key in here], dtype=torch.long)
    if n == 1:
        return torch.zeros(rows, dtype=torch.long)
    if n == rows:
        return torch.arange(rows)
    if frame.batch is not None and n == len(frame.batch) and rows % n == 0:
        return torch.arange(rows) % n  # k stacked copies of the batch the value was made for
    raise InputError(
        f"{what} hold {n} rows, without their samples, and this forward {rows}: give one row (shared by every "
        "row), exactly the forward's rows, or values that know their samples (record's, or with into= / "
        "samples=), which are written by sample at any batch size and order"
    )


@dataclass(frozen=True)
class Group:
    """A token group: "image", "last", "text" or "all" (`countlens.circuits.sites.group_mask`)."""

    name: str

    def check(self, vlm: VLM) -> None:
        check_group(self.name)
        if self.name == "image" and vlm.arch.spec.cross_attention is not None:
            raise InputError(
                f"{vlm.arch.name} has no image tokens: its image reaches the text as image states (the "
                "ImageStates site), not as positions of the sequence"
            )

    def mask(self, vlm: VLM, frame: Frame) -> Bool[Tensor, "rows seq"]:
        real = frame.attention_mask[:, -frame.input_ids.shape[1] :].bool()
        if frame.new:
            return real if self.name in ("last", "all") else torch.zeros_like(real)
        if frame.batch is not None:
            return frame.stacked(group_mask(frame.batch, self.name))
        image = frame.input_ids == vlm.arch.image_token_id
        last = torch.zeros_like(real)
        last[:, -1] = True  # rows are left-padded: the last column is every row's read position
        return {"image": image, "last": last, "all": real, "text": real & ~image & ~last}[self.name]


@dataclass(frozen=True)
class Cells:
    """Image tokens whose cell of the image-token grid is one of ``cells`` ((row, col) pairs)."""

    cells: tuple[tuple[int, int], ...]

    def __init__(self, cells: Sequence[Sequence[int]]):
        if isinstance(cells, Tensor):
            cells = cells.tolist()
        try:
            pairs = tuple((int(r), int(c)) for r, c in cells)
        except (TypeError, ValueError) as err:
            raise InputError(f"Cells takes (row, col) pairs, e.g. Cells([(2, 3)]); got {cells!r}") from err
        if not pairs or any(r < 0 or c < 0 for r, c in pairs):
            raise InputError(f"Cells needs at least one (row, col) pair with row, col ≥ 0; got {cells!r}")
        object.__setattr__(self, "cells", pairs)

    def check(self, vlm: VLM) -> None:
        pass

    def mask(self, vlm: VLM, frame: Frame) -> Bool[Tensor, "rows seq"]:
        if frame.new:
            return torch.zeros_like(frame.input_ids, dtype=torch.bool)
        batch = frame.need_batch("Cells positions")
        out = torch.zeros_like(batch.inputs["input_ids"], dtype=torch.bool, device="cpu")
        for b, (pos, cell, geom) in enumerate(zip(batch.image_pos, batch.image_cell, batch.geometry)):
            rows, cols = geom.token_grid
            outside = [rc for rc in self.cells if rc[0] >= rows or rc[1] >= cols]
            if outside:
                raise InputError(f"cells {outside} lie outside sample {b}'s {rows}×{cols} image-token grid")
            wanted = torch.tensor(self.cells)
            hit = (cell[:, None, :] == wanted[None]).all(-1).any(-1)
            out[b, pos[hit]] = True
        return frame.stacked(out)


#: What to do about a sample without an object list: for a function that reads each sample's objects …
GENERATED = (
    "this reads each sample's objects, so give samples with generated scenes (task_samples, count_scenes, "
    "count_pairs or countingtricks)"
)
#: … and for Objects positions, which other positions can replace.
AS_POSITIONS = "Objects positions need a generated scene; use Cells or a Mask"


@dataclass(frozen=True)
class Objects:
    """The image tokens of objects ``objects`` (indices into each row's ``scene.objects``); a token is
    an object's when the object covers ≥ ``coverage`` of its cell's pixels (0: any pixel), or, with
    ``peak``, when its cell holds the largest share of the object. ``of``: whose scene — the edited
    run's ("edited"), or in `countlens.circuits.effect` the donor's ("donor": the corrupt side, whose
    extra objects the clean scene lacks)."""

    objects: tuple[int, ...]
    coverage: float = 0.25
    peak: bool = True
    of: str = "edited"

    def __init__(self, objects: int | Sequence[int], coverage: float = 0.25, peak: bool = True, of: str = "edited"):
        try:
            chosen = (objects,) if isinstance(objects, (int, np.integer)) else tuple(objects)
        except TypeError:
            chosen = ()  # a float, None: no indices
        if not chosen or any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0 for i in chosen):
            raise InputError(f"Objects takes object indices ≥ 0, e.g. Objects([0, 2]); got {objects!r}")
        object.__setattr__(self, "objects", tuple(int(i) for i in chosen))
        object.__setattr__(self, "coverage", require_share(coverage, "Objects coverage"))
        object.__setattr__(self, "peak", require_bool(peak, "Objects peak"))
        object.__setattr__(self, "of", require_choice(of, "Objects of", ("edited", "donor")))

    def check(self, vlm: VLM) -> None:
        pass

    def mask(self, vlm: VLM, frame: Frame) -> Bool[Tensor, "rows seq"]:
        if frame.new:
            return torch.zeros_like(frame.input_ids, dtype=torch.bool)
        batch = frame.need_batch("Objects positions")
        if self.of == "donor":
            if frame.donor is None:
                raise InputError(
                    "Objects(of='donor') reads the donor's scene, which only effect() has (the corrupt side of "
                    "each pair); under intervene use of='edited'"
                )
            batch = frame.donor
        if batch.samples is None:
            raise InputError(
                "Objects positions need each sample's scene: prepare the batch with vlm.prepare_samples(samples)"
            )
        out = torch.zeros_like(batch.inputs["input_ids"], dtype=torch.bool, device="cpu")
        for b, sample in enumerate(batch.samples):
            out[b, self.tokens(batch, b, sample, fix=AS_POSITIONS)] = True
        return frame.stacked(out)

    def scene_of(self, sample, where: str, fix: str = GENERATED):
        """``sample``'s scene, refused (``where`` names the sample) without an object list or without one
        of the chosen objects; ``fix`` says what to do instead (`GENERATED`: give generated scenes;
        `AS_POSITIONS`: other positions)."""
        scene = getattr(sample, "scene", None)
        objects = getattr(scene, "objects", None)
        if not objects:
            raise InputError(f"{where} has no object list (a loaded benchmark image, or an empty scene): {fix}")
        missing = [i for i in self.objects if i >= len(objects)]
        if missing:
            raise InputError(
                f"{where}'s scene has objects 0..{len(objects) - 1}; it has no object {', '.join(map(str, missing))}"
            )
        return scene

    def tokens(self, batch: Batch, b: int, sample, fix: str = GENERATED) -> Tensor:
        """The positions of row ``b``'s tokens that belong to the chosen objects of ``sample``'s scene
        (``fix``: as in `scene_of`)."""
        scene = self.scene_of(sample, f"sample {b}", fix)
        cells = object_cells(object_coverage(scene, batch.geometry[b]), self.coverage, self.peak)
        mine = torch.from_numpy(cells[list(self.objects)].any(0))
        cell = batch.image_cell[b]
        inside = (cell >= 0).all(-1)
        hit = torch.zeros(len(cell), dtype=torch.bool)
        hit[inside] = mine[cell[inside, 0], cell[inside, 1]]
        return batch.image_pos[b][hit]


@dataclass(frozen=True, eq=False)
class Mask:
    """Explicit positions: Bool[Tensor, "batch seq"] over the prepared batch the forward runs on. With
    ``samples`` (the sample of each row; a tensor marked by `with_samples` carries them) each forward's
    row takes its own sample's row, at any batch size and order; without, the mask has exactly the
    forward's rows, or one row shared by all (`row_index`)."""

    where: Tensor = field(repr=False)
    samples: Sequence | None = field(default=None, repr=False)
    keys: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        samples = samples_of(self.where) if self.samples is None else self.samples
        if samples is not None:
            if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
                raise InputError(f"Mask samples are the sample of each row (a list), got {type(samples).__name__}")
            keys = sample_keys(samples) if self.samples is None else given_sample_keys(samples, "Mask samples=")
            object.__setattr__(self, "keys", keys)

    def check(self, vlm: VLM) -> None:
        w = self.where
        if not isinstance(w, Tensor) or w.dtype != torch.bool or w.ndim != 2:
            raise InputError("Mask takes a Bool[Tensor, 'batch seq'] (e.g. batch.inputs['input_ids'] == token)")
        if self.keys is not None and len(self.keys) != w.shape[0]:
            raise InputError(f"a Mask of {w.shape[0]} rows with {len(self.keys)} samples; give one sample per row")

    def mask(self, vlm: VLM, frame: Frame) -> Bool[Tensor, "rows seq"]:
        if frame.new:
            return torch.zeros_like(frame.input_ids, dtype=torch.bool)
        rows, seq = frame.input_ids.shape
        if self.where.shape[1] != seq:
            raise InputError(
                f"a Mask of shape {tuple(self.where.shape)} does not fit a forward of {rows} rows × {seq} positions; "
                "build it from the batch that runs (the same preparation: image size and question)"
            )
        index = row_index(frame, self.keys, self.where.shape[0], f"a Mask of shape {tuple(self.where.shape)}")
        return self.where.cpu()[index].to(frame.input_ids.device)


Positions = Group | Cells | Objects | Mask


def as_positions(value) -> Positions:
    """``value`` as positions: a group's name, a Bool tensor (a `Mask`), or positions as they are."""
    if isinstance(value, str):
        if value not in GROUPS:
            raise InputError(f"unknown token group {value!r}; use one of {GROUPS}, or Cells, Objects or a Mask")
        return Group(value)
    if isinstance(value, Tensor):
        return Mask(value)
    if isinstance(value, (Group, Cells, Objects, Mask)):
        return value
    raise InputError(
        f"positions must be a token group {GROUPS}, Cells, Objects, a Mask or a Bool tensor; got {type(value).__name__}"
    )
