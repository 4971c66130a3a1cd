"""Controlled count pairs for activation patching (two images that differ only in how many objects),
and single counting scenes of the same kinds for fine-tuning and evaluation.

A pair draws one layout of max(clean, corrupt) objects; the clean image shows its first ``clean``
objects and the corrupt image its first ``corrupt``, so every object they share has the same shape,
colour, size and position, and the question is the same. Patching corrupt activations into the
clean run then moves only the count. Kinds:

- ``dots``: black dots (size 0.8 × the patch) — "how many dots …";
- ``shapes``: one shape per pair in mixed palette colours (the organism's counting distribution);
- ``polygons``: circles, squares and triangles mixed — "how many objects …";
- ``rendered``: ``shapes`` on a textured, noisy background (a stand-in for rendered, SynReal-like
  scenes); clean and corrupt share the texture, so the noise is not a difference between them.

Kinds mix with '+': ``dots+polygons`` (the Counting Circuits SynDot and SynPoly data) alternates
by index: item i is item i // 2 of its own kind (its own random stream). ``clean``/``corrupt`` fix one
count pair (e.g. 3 → 5); left as None, the count pair is drawn from the K ordered pairs of distinct
counts in ``counts`` (`pair_counts`):

- ``order="stratified"`` (what `count_pairs`, and so ``countlens discover``, draws): the pairs come in
  blocks of K, each block every ordered pair once in a seeded order, so any first n pairs give each
  ordered pair ⌊n/K⌋ or ⌈n/K⌉ pairs (which ones get the extra is drawn from the seed). Within a block
  the pairs come in rounds of one pair per clean count (each corrupt count once too), so the clean and
  the corrupt counts are as even as n allows, and every count is a clean count once n ≥ len(counts).
  The block is read at the pair's index over the whole mix, so a mix is balanced as one set.
- ``order="cycle"`` (`count_pair`'s default): in order, by each kind's own index ((1, 2), (1, 3), …):
  the first 16 of 72 pairs all have clean count 1 or 2. The planted organisms train on this order.

`count_table` gives the clean × corrupt table of a set of pairs. Every pair and scene is a pure
function of its arguments (seed, kind, index, order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import permutations
from typing import TYPE_CHECKING

import numpy as np

from countlens.datasets.prompts import PAIR_PROMPTS, answer_text, make_question
from countlens.datasets.recipe import recorded
from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Scene, place_objects
from countlens.datasets.tasks import SIZE_RANGE, TaskSample, sample_rng
from countlens.errors import InputError
from countlens.model.geometry import Geometry
from countlens.validate import (
    require_choice,
    require_count,
    require_image_side,
    require_integer,
    require_seed,
    require_sequence,
)

if TYPE_CHECKING:
    import xarray as xr

KINDS: tuple[str, ...] = ("dots", "shapes", "polygons", "rendered")
DEFAULT_COUNTS: tuple[int, ...] = tuple(range(1, 10))
#: Single scenes' counts: the Counting Circuits synthetic data covers 1–10.
SCENE_COUNTS: tuple[int, ...] = tuple(range(1, 11))
TEXTURE_NOISE = 18.0
#: How a pair's counts are drawn when not fixed (see the module docstring): balanced strata, or in order.
ORDERS: tuple[str, ...] = ("stratified", "cycle")


@dataclass(frozen=True)
class CountPair:
    """A clean and a corrupt sample whose shared objects are identical; both carry their gold answer."""

    clean: TaskSample
    corrupt: TaskSample
    kind: str
    index: int


def check_kind(kind: str) -> tuple[str, ...]:
    """The single kinds of ``kind`` ("dots+polygons" → ("dots", "polygons")); raises on an unknown one."""
    parts = tuple(kind.split("+")) if isinstance(kind, str) else ()
    if not parts or any(k not in KINDS for k in parts):
        raise InputError(
            f"unknown pair kind {kind!r}; use one of {KINDS}, or several joined by '+' "
            "(e.g. 'dots+polygons': they alternate by index)"
        )
    return parts


def _check_draw(seed, index, grid, image_size) -> None:
    """The arguments every single draw takes, refused by name before anything is drawn."""
    require_seed(seed)
    require_integer(index, "index", low=0)
    if grid is not None and not isinstance(grid, Geometry):
        raise InputError(f"grid must be a Geometry (vlm.geometry), got {type(grid).__name__}")
    if image_size is not None:
        require_image_side(image_size, "image_size")


def _kind(kind: str, index: int) -> tuple[str, int]:
    """Item ``index`` of ``kind`` as (single kind, index among that kind's items): a mix interleaves
    its kinds' own sequences, so each kind still cycles through every count."""
    parts = check_kind(kind)
    return parts[index % len(parts)], index // len(parts)


def _draw(rng, kind: str, m: int, grid: Geometry | None, image_size: int | None, prompt: str):
    """One layout of ``m`` objects of ``kind``: (scene maker, the asked noun, the question)."""
    size = grid.image_width if grid is not None else (image_size or 192)
    height = grid.image_height if grid is not None else size
    scale = min(size, height) / 192
    if kind == "dots":
        p = grid.patch_size if grid is not None else 16
        specs = [("circle", "black", 0.8 * p)] * m
        asked = "dots"
    else:
        if kind == "polygons":
            shapes = [SHAPES[rng.integers(len(SHAPES))] for _ in range(m)]
            asked = "objects"
        else:
            asked = SHAPES[rng.integers(len(SHAPES))]
            shapes = [asked] * m
        specs = [
            (s, OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))], float(rng.uniform(*SIZE_RANGE) * scale))
            for s in shapes
        ]
    # Inside the part the tower sees: off a strip it drops (`Geometry.dropped`), the whole image otherwise.
    objs = place_objects(rng, *(grid.seen[::-1] if grid is not None else (size, height)), specs)
    noise = TEXTURE_NOISE if kind == "rendered" else 0.0
    noise_seed = int(rng.integers(2**31))
    question, _ = make_question(prompt, asked, m, rng)

    def scene(n: int) -> Scene:
        return Scene(size, height, objs[:n], noise=noise, noise_seed=noise_seed)

    return scene, asked, question


def _check_prompt(prompt: str) -> None:
    if prompt not in PAIR_PROMPTS:
        raise InputError(f"prompt {prompt!r} is not a pair prompt; use one of {PAIR_PROMPTS}")


def _count_options(counts) -> list[int]:
    """The distinct counts of ``counts``, sorted; refused unless two or more."""
    counts = require_sequence(counts, "counts", example="range(1, 10)")
    values = sorted(set(require_integer(c, "each of counts", low=0) for c in counts))
    if len(values) < 2:
        raise InputError(f"counts={counts!r} needs at least two distinct values to form pairs, e.g. range(1, 10)")
    return values


def _stratum(seed: int, values: list[int], index: int) -> tuple[int, int]:
    """The ``index``-th count pair of the stratified order: block ``index // K`` is every ordered pair
    once, as m − 1 rounds (a seeded shift s of seeded count labels: t → t + s mod m) of one pair per clean
    count, the rounds and the pairs within each in a seeded order."""
    m = len(values)
    block, at = divmod(index, m * (m - 1))
    rng = sample_rng(seed, "pairs/strata", block)
    label = rng.permutation(m)
    shifts = rng.permutation(np.arange(1, m))
    shift = int(shifts[at // m])
    t = int(rng.permuted(np.tile(np.arange(m), (m - 1, 1)), axis=1)[at // m, at % m])
    return values[int(label[t])], values[int(label[(t + shift) % m])]


def pair_counts(
    seed: int,
    index: int,
    kind: str = "shapes",
    clean: int | None = None,
    corrupt: int | None = None,
    counts=DEFAULT_COUNTS,
    order: str = "cycle",
) -> tuple[int, int]:
    """(clean, corrupt) of `count_pair` with these arguments, without drawing its images: the fixed
    pair, or the ``index``-th of ``order`` (the module docstring)."""
    require_seed(seed)
    require_integer(index, "index", low=0)
    require_choice(order, "order", ORDERS)
    if (clean is None) != (corrupt is None):
        raise InputError("give both clean= and corrupt= (a fixed count pair) or neither (all pairs of counts=)")
    if clean is None:
        values = _count_options(counts)
        if order == "stratified":
            clean, corrupt = _stratum(seed, values, index)
        else:
            clean, corrupt = list(permutations(values, 2))[_kind(kind, index)[1] % (len(values) * (len(values) - 1))]
    require_integer(clean, "clean")
    require_integer(corrupt, "corrupt")
    if clean == corrupt or min(clean, corrupt) < 0:
        raise InputError(f"clean={clean} and corrupt={corrupt} must be distinct non-negative counts")
    return clean, corrupt


@recorded
def count_pair(
    seed: int,
    index: int,
    kind: str = "shapes",
    clean: int | None = None,
    corrupt: int | None = None,
    grid: Geometry | None = None,
    image_size: int | None = None,
    counts=DEFAULT_COUNTS,
    prompt: str = "std",
    order: str = "cycle",
) -> CountPair:
    """The ``index``-th pair of ``kind`` under ``seed``; its counts: ``clean``/``corrupt``, else drawn
    from ``counts`` in ``order`` (`pair_counts`)."""
    _check_draw(seed, index, grid, image_size)
    own_kind, own = _kind(kind, index)
    _check_prompt(prompt)
    clean, corrupt = pair_counts(seed, index, kind, clean, corrupt, counts, order)
    rng = sample_rng(seed, f"pairs/{own_kind}", own)
    scene, asked, question = _draw(rng, own_kind, max(clean, corrupt), grid, image_size, prompt)

    def sample(n: int, role: str) -> TaskSample:
        meta = {"count": n, "kind": own_kind, "role": role, "shape": asked, "pair": index}
        return TaskSample(scene(n), question, answer_text(prompt, asked, n), "count", meta)

    return CountPair(sample(clean, "clean"), sample(corrupt, "corrupt"), own_kind, index)


@recorded
def count_scene(
    seed: int,
    index: int,
    kind: str = "dots",
    grid: Geometry | None = None,
    image_size: int | None = None,
    counts=SCENE_COUNTS,
    prompt: str = "std",
) -> TaskSample:
    """The ``index``-th single counting scene of ``kind`` (the counts cycle by index): fine-tuning
    data (SynDot = "dots", SynPoly = "polygons") and the rendered evaluation set ("rendered")."""
    _check_draw(seed, index, grid, image_size)
    kind, own = _kind(kind, index)
    _check_prompt(prompt)
    counts = sorted(
        set(
            require_integer(c, "each of counts", low=0)
            for c in require_sequence(counts, "counts", example="range(1, 10)")
        )
    )
    if not counts or counts[0] < 0:
        raise InputError(f"counts={counts!r}: give at least one non-negative count")
    n = counts[own % len(counts)]
    scene, asked, question = _draw(sample_rng(seed, f"scenes/{kind}", own), kind, n, grid, image_size, prompt)
    meta = {"count": n, "kind": kind, "shape": asked}
    return TaskSample(scene(n), question, answer_text(prompt, asked, n), "count", meta)


def count_scenes(n: int, kind: str = "dots", grid: Geometry | None = None, seed: int = 0, **kw) -> list[TaskSample]:
    """``n`` scenes (see `count_scene`); e.g. ``count_scenes(8000, "dots+polygons", vlm.geometry)``."""
    require_count(n, "count_scenes: n (the number of scenes)")
    require_seed(seed)
    return [count_scene(seed, i, kind, grid, **kw) for i in range(n)]


def count_pairs(
    n: int,
    clean: int | None = None,
    corrupt: int | None = None,
    kind: str = "shapes",
    grid: Geometry | None = None,
    seed: int = 0,
    **kw,
) -> list[CountPair]:
    """``n`` pairs (see `count_pair`); e.g. ``count_pairs(64, 3, 5, grid=vlm.geometry)``. Without a fixed
    ``clean``/``corrupt``, stratified over the ordered count pairs (``order="stratified"``): each gets
    ⌊n/K⌋ or ⌈n/K⌉ pairs, the extra ones drawn from ``seed``, and the clean counts are as even as n
    allows; ``order="cycle"`` gives the pairs in order instead."""
    require_count(n, "count_pairs: n (the number of pairs)")
    require_seed(seed)
    kw.setdefault("order", "stratified")
    return [count_pair(seed, i, kind, clean, corrupt, grid, **kw) for i in range(n)]


def count_table(pairs: Sequence) -> xr.DataArray:
    """How many of ``pairs`` have each (clean, corrupt) count: an integer DataArray (clean, corrupt)
    over every count that occurs on either side. ``pairs``: count pairs (`count_pairs`; any pair whose
    samples carry ``meta["count"]``) or (clean, corrupt) tuples of integers."""
    import xarray as xr

    items = require_sequence(pairs, "pairs", example="count_pairs(16)")
    got = []
    for i, p in enumerate(items):
        if hasattr(p, "clean") and hasattr(p, "corrupt"):
            c, d = (getattr(s, "meta", None) or {} for s in (p.clean, p.corrupt))
            c, d = c.get("count"), d.get("count")
        else:
            c, d = p if isinstance(p, (tuple, list)) and len(p) == 2 else (None, None)
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (c, d)):
            raise InputError(
                f"pair {i} ({type(p).__name__}) carries no counts: count_table reads pairs whose samples have "
                "meta['count'] (count_pairs draws them) or (clean, corrupt) tuples of integers"
            )
        got.append((int(c), int(d)))
    values = sorted({x for pair in got for x in pair})
    where = {v: k for k, v in enumerate(values)}
    table = np.zeros((len(values), len(values)), dtype=np.int64)
    for c, d in got:
        table[where[c], where[d]] += 1
    return xr.DataArray(table, coords={"clean": values, "corrupt": values}, dims=("clean", "corrupt"), name="pairs")
