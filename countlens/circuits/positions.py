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
  that an object smaller than the threshold still owns one cell (`countlens.cells.object_cells`).
  At the default 0.25 a small object on the organism's 32 px cells owns one or two tokens; with
  ``coverage=0`` every token it touches.
- `Mask` — any Bool[Tensor, "batch seq"] over a prepared batch.

**New tokens** (generation after the prompt, fed one at a time after a KV cache) belong to ``last``
and ``all`` — each new token is where the next answer token is read — and to no other set: they are
not image tokens, not in any cell or object, and outside a mask, which covers the prompt only.

Cells, objects and masks need the prepared `countlens.vlm.Batch` the forward runs on (its token
cells; for objects the samples' scenes, so prepare with `VLM.prepare_samples`); groups are read off
the tokens alone when no batch is known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from countlens.cells import object_cells, object_coverage
from countlens.circuits.sites import GROUPS, check_group, group_mask
from countlens.errors import InputError
from countlens.validate import require_choice, require_share

if TYPE_CHECKING:
    from jaxtyping import Bool

    from countlens.vlm import VLM, Batch


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

    def stacked(self, per_row: Bool[Tensor, "batch seq"]) -> Bool[Tensor, "rows seq"]:
        """A mask over the batch's rows repeated over this forward's stacked rows."""
        k = self.input_ids.shape[0] // per_row.shape[0]
        return torch.cat([per_row] * k).to(self.input_ids.device)


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
        chosen = (objects,) if isinstance(objects, (int, np.integer)) else tuple(objects)
        if not chosen or any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) or i < 0 for i in chosen):
            raise InputError(f"Objects takes object indices ≥ 0, e.g. Objects([0, 2]); got {objects!r}")
        object.__setattr__(self, "objects", tuple(int(i) for i in chosen))
        object.__setattr__(self, "coverage", require_share(coverage, "Objects coverage"))
        object.__setattr__(self, "peak", bool(peak))
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
            out[b, self.tokens(batch, b, sample)] = True
        return frame.stacked(out)

    def scene_of(self, sample, where: str):
        """``sample``'s scene, refused (``where`` names the sample) without an object list or without one
        of the chosen objects."""
        scene = getattr(sample, "scene", None)
        objects = getattr(scene, "objects", None)
        if not objects:
            raise InputError(
                f"{where} has no object list (a loaded benchmark image, or an empty scene): Objects positions "
                "need a generated scene; use Cells or a Mask"
            )
        missing = [i for i in self.objects if i >= len(objects)]
        if missing:
            raise InputError(
                f"{where}'s scene has objects 0..{len(objects) - 1}; it has no object {', '.join(map(str, missing))}"
            )
        return scene

    def tokens(self, batch: Batch, b: int, sample) -> Tensor:
        """The positions of row ``b``'s tokens that belong to the chosen objects of ``sample``'s scene."""
        scene = self.scene_of(sample, f"sample {b}")
        cells = object_cells(object_coverage(scene, batch.geometry[b].token_grid), self.coverage, self.peak)
        mine = torch.from_numpy(cells[list(self.objects)].any(0))
        cell = batch.image_cell[b]
        inside = (cell >= 0).all(-1)
        hit = torch.zeros(len(cell), dtype=torch.bool)
        hit[inside] = mine[cell[inside, 0], cell[inside, 1]]
        return batch.image_pos[b][hit]


@dataclass(frozen=True, eq=False)
class Mask:
    """Explicit positions: Bool[Tensor, "batch seq"] over the prepared batch the forward runs on."""

    where: Tensor = field(repr=False)

    def check(self, vlm: VLM) -> None:
        w = self.where
        if not isinstance(w, Tensor) or w.dtype != torch.bool or w.ndim != 2:
            raise InputError("Mask takes a Bool[Tensor, 'batch seq'] (e.g. batch.inputs['input_ids'] == token)")

    def mask(self, vlm: VLM, frame: Frame) -> Bool[Tensor, "rows seq"]:
        if frame.new:
            return torch.zeros_like(frame.input_ids, dtype=torch.bool)
        rows, seq = frame.input_ids.shape
        if self.where.shape[1] != seq or rows % self.where.shape[0]:
            raise InputError(
                f"a Mask of shape {tuple(self.where.shape)} does not fit a forward of {rows} rows × {seq} positions; "
                "build it from the batch that runs"
            )
        return frame.stacked(self.where.cpu())


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
