"""COUNTINGTRICKS: 32 counting cases that move objects relative to the vision patch grid.

A ViT cuts the image into ``patch``-pixel cells, so the same objects are seen differently when they
sit inside a cell, across a grid line or on an intersection, when they are dilated to several
cells, and when they touch. Each case changes one of these variables and holds the rest; every
position is defined on the patch grid given as a parameter (a model's `Geometry`, or plain
``image_size`` / ``patch_size``), in exact pixel coordinates (grid line k is x = k·patch; nothing
is rounded, so no object is snapped to a neighbouring line).

Cases (``p`` = patch size; sizes are a circle's diameter, a square's side, a triangle's circumscribed
diameter; lattice objects are upright and "apart" means their bounding boxes stay ≥ p/2 apart):

- **1–4, position**: centre at a cell centre (1) / on a vertical grid line, mid-cell vertically (2) /
  on a horizontal grid line (3) / on a grid intersection (4); letter **A** size p, **B** size
  uniform in [0.75p, 1.5p], **C** size p + centre jitter uniform in ±0.2p per axis, **D** both.
- **5A–8A, dilation**: cell-centred objects of size 2.5p, 3p, 3.5p, 4p, apart.
- **9–15, adjacency** (size p; **A** outlines touching, **B** 1 px apart): 9 pairs side by side,
  10 rows of ≤ 4, 11 columns of ≤ 4, 12A one ring, 13 a random compact cluster (each new object
  touches one already placed, at a multiple of 15°), 14 rows of ≤ 4 mixing circles, squares and
  triangles, 15A the shape's tiling of a block (square grid, hexagonal circle packing, alternating
  triangles). Polygons turn so that neighbours meet along an edge, which a point contact does not
  show once drawn: in lines (9, 10, 11, 14) squares stay upright and triangles point up, down,
  left or right (a row alternates up and down, a column left and right, a triangle turns a flat
  side to a square); in 13 each new polygon turns to share an edge with the one it touches, and a
  direction where it could only meet it at a point is redrawn; 12A's objects turn with the ring.
  What shows in the pixels, per case: ``docs/countingtricks/pixel_contact.py``.

Counts: N cycles through ``counts`` (default 3–12) by sample index, so every case is balanced; the
shape cycles through ``shapes`` likewise. When the grid is too small for a lattice case to hold N
objects apart, the default count range is cut to what always fits (`capacity`, recorded in each
sample's meta) and an explicit larger count raises — the label is always the number drawn.
Every sample is a pure function of (seed, case, index).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property, lru_cache

import numpy as np

from countlens.datasets.arrangements import chain, cluster, ring, split_count, tiling
from countlens.datasets.paper_generator import REFERENCE_CASES, check_capacity, reference_grid, reference_sample
from countlens.datasets.prompts import PROMPTS, answer_text, make_question
from countlens.datasets.recipe import recorded
from countlens.datasets.scene import PALETTE, SHAPES, Obj, Scene, check_visible
from countlens.datasets.tasks import TaskSample, sample_rng
from countlens.errors import CountlensError, InputError
from countlens.model.geometry import Geometry
from countlens.validate import (
    require_count,
    require_distinct,
    require_integer,
    require_seed,
    require_sequence,
    require_text,
)

DEFAULT_COUNTS: tuple[int, ...] = tuple(range(3, 13))
APART = 0.5  # minimum distance between enclosing discs of non-adjacent objects, in patches
NEAR_GAP_PX = 1.0  # the "nearly touching" distance of the B adjacency cases


@dataclass(frozen=True)
class Case:
    """One COUNTINGTRICKS case: its name, family, one-line description and placement parameters."""

    name: str
    family: str  # "position", "dilation" or "adjacency"
    description: str
    anchor: str | None = None  # lattice cases: "center", "vline", "hline" or "cross"
    size: tuple[float, float] = (1.0, 1.0)  # object size range, in patches
    jitter: float = 0.0  # lattice cases: max centre offset per axis, in patches
    layout: str | None = None  # adjacency cases: pairs, rows, columns, ring, cluster, mixed, tiling
    gap_px: float = 0.0  # adjacency cases: distance between neighbouring outlines, in pixels

    @property
    def params(self) -> dict:
        """The case's parameters (a fresh dict: the cached one is shared)."""
        return dict(self._params)

    @cached_property
    def _params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _build_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    where = {
        "center": "at a cell centre",
        "vline": "on a vertical grid line",
        "hline": "on a horizontal grid line",
        "cross": "on a grid intersection",
    }
    variants = {
        "A": ((1.0, 1.0), 0.0, "size p"),
        "B": ((0.75, 1.5), 0.0, "size 0.75-1.5p"),
        "C": ((1.0, 1.0), 0.2, "size p, jitter ±0.2p"),
        "D": ((0.75, 1.5), 0.2, "size 0.75-1.5p, jitter ±0.2p"),
    }
    for k, anchor in enumerate(where, start=1):
        for letter, (size, jitter, text) in variants.items():
            cases[f"{k}{letter}"] = Case(
                f"{k}{letter}", "position", f"centre {where[anchor]}, {text}", anchor=anchor, size=size, jitter=jitter
            )
    for k, d in zip(range(5, 9), (2.5, 3.0, 3.5, 4.0)):
        cases[f"{k}A"] = Case(f"{k}A", "dilation", f"cell-centred, size {d:g}p, apart", anchor="center", size=(d, d))
    adjacency = [
        ("9", "pairs", "pairs side by side (a triple when N is odd)", "AB"),
        ("10", "rows", "horizontal rows of up to 4", "AB"),
        ("11", "columns", "vertical columns of up to 4", "AB"),
        ("12", "ring", "one ring of all N", "A"),
        ("13", "cluster", "one random compact cluster", "AB"),
        ("14", "mixed", "rows of up to 4 mixing circles, squares and triangles", "AB"),
        ("15", "tiling", "the shape's tiling of a block (grid / hexagonal / alternating)", "A"),
    ]
    for k, layout, text, letters in adjacency:
        for letter in letters:
            gap = 0.0 if letter == "A" else NEAR_GAP_PX
            how = "touching" if letter == "A" else f"{NEAR_GAP_PX:g} px apart"
            cases[f"{k}{letter}"] = Case(f"{k}{letter}", "adjacency", f"{text}, {how}", layout=layout, gap_px=gap)
    return cases


CASES: dict[str, Case] = _build_cases()
assert len(CASES) == 32


def as_geometry(grid: Geometry | None = None, image_size: int | None = None, patch_size: int | None = None) -> Geometry:
    """The patch grid: a model's `Geometry`, or a square image from plain numbers."""
    if grid is not None:
        if image_size is not None or patch_size is not None:
            raise InputError("give either grid= or image_size=/patch_size=, not both")
        return grid
    if image_size is None or patch_size is None:
        raise InputError("give grid= (e.g. vlm.geometry) or both image_size= and patch_size=")
    require_count(image_size, "image_size (pixels)")
    require_count(patch_size, "patch_size (pixels)")
    if image_size < patch_size:
        raise InputError(f"image_size {image_size} is smaller than one patch_size {patch_size}")
    return Geometry.data_grid(image_size, patch_size)


def case(name: str) -> Case:
    if not isinstance(name, str) or name not in CASES:
        raise InputError(f"unknown COUNTINGTRICKS case {name!r}; cases are {', '.join(CASES)}")
    return CASES[name]


# ----------------------------------------------------------------------------- lattice cases (1–8)


def _enclosing_radius(shape: str, size: float) -> float:
    return size / 2 * (math.sqrt(2) if shape == "square" else 1.0)


def _anchors(c: Case, g: Geometry, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """Anchor x and y coordinates (px) of a lattice case whose objects keep ``margin`` px inside."""
    p = g.patch_size
    rows, cols = g.patch_grid
    on_line_x = c.anchor in ("vline", "cross")
    on_line_y = c.anchor in ("hline", "cross")
    xs = np.arange(cols + 1) * p if on_line_x else (np.arange(cols) + 0.5) * p
    ys = np.arange(rows + 1) * p if on_line_y else (np.arange(rows) + 0.5) * p
    keep = lambda v, hi: v[(v >= margin - 1e-9) & (v <= hi - margin + 1e-9)]  # noqa: E731
    seen_h, seen_w = g.seen  # objects stay off a strip the vision tower drops (Geometry.dropped)
    return keep(xs.astype(float), seen_w), keep(ys.astype(float), seen_h)


def _lattice_terms(c: Case, g: Geometry) -> tuple[float, float, int]:
    """(margin, jitter, step): lattice objects are upright, so each lies in the axis-aligned box of
    side ``size`` around its centre; centres ``step`` cells apart keep any two boxes p/2 apart."""
    p = g.patch_size
    jitter = c.jitter * p
    sep = c.size[1] * p + APART * p + 2 * jitter
    return c.size[1] * p / 2 + jitter, jitter, max(1, math.ceil(sep / p - 1e-9))


@lru_cache(maxsize=1024)
def capacity(name: str, grid: Geometry) -> int | None:
    """How many objects a lattice case always fits on this grid (None for adjacency cases)."""
    c = case(name)
    if c.anchor is None:
        return None
    margin, _, step = _lattice_terms(c, grid)
    xs, ys = _anchors(c, grid, margin)
    return max((len(xs[ox::step]) * len(ys[oy::step]) for ox in range(step) for oy in range(step)), default=0)


@lru_cache(maxsize=256)
def _anchor_table(c: Case, g: Geometry) -> np.ndarray:
    """A lattice case's anchors (k, 2) in row-major order: fixed per case and grid, so computed once.
    Their Chebyshev distances are computed a row at a time (`_greedy`): the whole (k, k) table of a
    1540 px image (Mistral 3's native size, k ≈ 12,000 anchors) would take over a GiB per case."""
    margin, _, _ = _lattice_terms(c, g)
    xs, ys = _anchors(c, g, margin)
    pts = np.array([(x, y) for y in ys for x in xs]).reshape(-1, 2)
    pts.flags.writeable = False  # shared by every sample of the case
    return pts


def _greedy(order: np.ndarray, pts: np.ndarray, sizes: np.ndarray, spacing: float, n: int) -> list[int]:
    """Scan anchors in ``order`` once and keep each whose Chebyshev distance to every kept one is at
    least the two objects' mean size plus ``spacing``, the new object's size being ``sizes[i]``
    for the i-th kept. ``slack[a]``, the least of dist(a, kept) − size(kept)/2, makes each step one
    vectorised scan."""
    chosen: list[int] = []
    slack = np.full(len(pts), np.inf)
    pos = 0
    while len(chosen) < n and pos < len(order):
        rest = order[pos:]
        ok = slack[rest] >= sizes[len(chosen)] / 2 + spacing - 1e-9
        hit = int(ok.argmax())
        if not ok[hit]:
            break
        m = int(rest[hit])
        slack = np.minimum(slack, np.abs(pts - pts[m]).max(-1) - sizes[len(chosen)] / 2)
        chosen.append(m)
        pos += hit + 1
    return chosen


def _lattice(c: Case, g: Geometry, n: int, shape: str, colors: tuple[str, ...], rng) -> tuple[Obj, ...]:
    p = g.patch_size
    margin, jitter, step = _lattice_terms(c, g)
    grid_pts = _anchor_table(c, g)
    sizes = rng.uniform(c.size[0] * p, c.size[1] * p, size=n) if c.size[0] != c.size[1] else np.full(n, c.size[0] * p)
    chosen: list[int] = []
    for _ in range(10):  # random greedy first: varied layouts, not only sub-lattices
        # Chebyshev distance between anchors: the boxes of two objects stay p/2 apart after jitter.
        chosen = _greedy(rng.permutation(len(grid_pts)), grid_pts, sizes, APART * p + 2 * jitter, n)
        if len(chosen) == n:
            break
    else:
        # A sub-lattice `step` cells apart always satisfies every pair; pick one that holds n.
        xs, ys = _anchors(c, g, margin)
        offsets = [(ox, oy) for ox in range(step) for oy in range(step) if len(xs[ox::step]) * len(ys[oy::step]) >= n]
        if not offsets:
            raise CountlensError(f"case {c.name} cannot place {n} objects on a {g.patch_grid} grid of {p}px patches")
        ox, oy = offsets[rng.integers(len(offsets))]
        sub = np.array([(x, y) for y in ys[oy::step] for x in xs[ox::step]])
        grid_pts, chosen = sub, [int(k) for k in rng.permutation(len(sub))[:n]]
    objs = []
    for i, k in enumerate(chosen):
        dx, dy = rng.uniform(-jitter, jitter, size=2) if jitter else (0.0, 0.0)
        color = colors[rng.integers(len(colors))]
        objs.append(Obj(shape, color, float(grid_pts[k][0] + dx), float(grid_pts[k][1] + dy), float(sizes[i])))
    return tuple(objs)


# ----------------------------------------------------------------------------- adjacency cases (9–15)


def _groups(c: Case, n: int, shape: str, size: float, rng) -> list[list[tuple[str, float, float, float]]]:
    gap = c.gap_px
    if c.layout == "pairs":
        parts = [2] * (n // 2 - 1) + ([3] if n % 2 else [2]) if n >= 2 else [1]
        return [chain([shape] * k, size, 0.0, gap) for k in parts]
    if c.layout in ("rows", "columns"):
        angle = 0.0 if c.layout == "rows" else 90.0
        return [chain([shape] * k, size, angle, gap) for k in split_count(n, 4)]
    if c.layout == "mixed":
        return [chain([SHAPES[rng.integers(len(SHAPES))] for _ in range(k)], size, 0.0, gap) for k in split_count(n, 4)]
    if c.layout == "ring":
        return [ring(shape, n, size, gap)]
    if c.layout == "cluster":
        return [cluster(shape, n, size, gap, rng)]
    return [tiling(shape, n, size, gap)]


def _adjacent(c: Case, g: Geometry, n: int, shape: str, colors: tuple[str, ...], rng) -> tuple[Obj, ...]:
    size = float(g.patch_size)
    apart = APART * g.patch_size
    seen_h, seen_w = g.seen  # objects stay off a strip the vision tower drops (Geometry.dropped)
    for _ in range(50):
        placed: list[tuple[np.ndarray, list]] = []  # (box x0 y0 x1 y1 in image coords, members)
        for members in _groups(c, n, shape, size, rng):
            r = [_enclosing_radius(s, size) for s, *_ in members]
            lo = np.min([(x - ri, y - ri) for (_, _, x, y), ri in zip(members, r)], axis=0)
            hi = np.max([(x + ri, y + ri) for (_, _, x, y), ri in zip(members, r)], axis=0)
            w, h = hi - lo
            if w > seen_w or h > seen_h:
                raise CountlensError(
                    f"case {c.name}: {n} objects of {size:g}px do not fit a "
                    f"{seen_w}x{seen_h} image; use fewer objects or a larger image"
                )
            for _ in range(200):
                x0 = rng.uniform(0, seen_w - w)
                y0 = rng.uniform(0, seen_h - h)
                box = np.array([x0, y0, x0 + w, y0 + h])
                clear = all(
                    box[0] >= b[2] + apart or b[0] >= box[2] + apart or box[1] >= b[3] + apart or b[1] >= box[3] + apart
                    for b, _ in placed
                )
                if clear:
                    placed.append((box, [(s, rot, x - lo[0] + x0, y - lo[1] + y0) for s, rot, x, y in members]))
                    break
            else:
                break
        else:
            return tuple(
                Obj(s, colors[rng.integers(len(colors))], float(x), float(y), size, float(rot))
                for _, members in placed
                for s, rot, x, y in members
            )
    raise CountlensError(
        f"case {c.name}: could not lay out {n} objects in a {g.image_width}x{g.image_height} "
        "image; use fewer objects or a larger image"
    )


# ----------------------------------------------------------------------------- samples


def resolve_counts(name: str, grid: Geometry, counts=None) -> tuple[int, ...]:
    """The counts a case cycles through on this grid (see the module docstring)."""
    cap = capacity(name, grid)
    if counts is None:
        out = tuple(n for n in DEFAULT_COUNTS if cap is None or n <= cap)
        if not out:
            raise CountlensError(
                f"case {name} fits only {cap} objects on a {grid.patch_grid} patch grid, fewer than "
                f"{DEFAULT_COUNTS[0]}; use a larger image or give counts= explicitly "
                "(`countlens data countingtricks --counts`)"
            )
        return out
    out = tuple(int(n) for n in counts)
    if not out or min(out) < 1:
        raise InputError(f"counts must be a non-empty list of positive integers, got {counts!r}")
    if cap is not None and max(out) > cap:
        raise InputError(
            f"case {name} fits at most {cap} objects apart on a {grid.patch_grid} grid of "
            f"{grid.patch_size}px patches, but counts go up to {max(out)}; lower the counts "
            "(counts= / --counts) or use a larger image"
        )
    return out


def _check_style(shapes, color, prompt) -> tuple[tuple[str, ...], tuple[str, ...]]:
    shapes = (shapes,) if isinstance(shapes, str) else tuple(shapes)
    colors = (color,) if isinstance(color, str) else tuple(color)
    for s in shapes:
        if s not in SHAPES:
            raise InputError(f"unknown shape {s!r}; use one of {SHAPES}")
    for col in colors:
        if col not in PALETTE:
            raise InputError(f"unknown colour {col!r}; use one of {tuple(PALETTE)}")
    if prompt not in PROMPTS:
        raise InputError(f"unknown prompt style {prompt!r}; use one of {tuple(PROMPTS)}")
    return shapes, colors


@recorded
def trick_sample(
    name: str,
    seed: int,
    index: int,
    grid: Geometry | None = None,
    *,
    image_size: int | None = None,
    patch_size: int | None = None,
    shapes: str | tuple[str, ...] = SHAPES,
    color: str | tuple[str, ...] = "red",
    counts=None,
    prompt: str = "std",
    background: str = "white",
) -> TaskSample:
    """The ``index``-th sample of case ``name`` under ``seed``: a pure function of its arguments."""
    require_seed(seed)
    require_integer(index, "index", low=0)
    c = case(name)
    g = as_geometry(grid, image_size, patch_size)
    shapes, colors = _check_style(shapes, color, prompt)
    check_visible(colors, background)  # every colour the case may draw, not only the first sample's
    counts = resolve_counts(name, g, counts)
    n = counts[index % len(counts)]
    shape = shapes[(index // len(counts)) % len(shapes)]
    rng = sample_rng(seed, f"countingtricks/{name}", index)
    objs = _lattice(c, g, n, shape, colors, rng) if c.anchor else _adjacent(c, g, n, shape, colors, rng)
    asked = "objects" if c.layout == "mixed" else shape
    # The prompt draws from its own stream, so the image is the same under every prompt style.
    # Only a conflict prompt draws (its distractor), so only it pays for a generator.
    prompt_rng = sample_rng(seed, f"countingtricks/{name}/prompt", index) if PROMPTS[prompt].conflict else None
    question, prompt_meta = make_question(prompt, asked, n, prompt_rng)
    meta = {
        "count": n,
        "case": name,
        "family": c.family,
        "shape": asked,
        "prompt": prompt,
        "grid": [g.image_height, g.image_width, g.patch_size],
        "capacity": capacity(name, g),
        **prompt_meta,
    }
    return TaskSample(
        Scene(g.image_width, g.image_height, objs, background), question, answer_text(prompt, asked, n), "count", meta
    )


#: The generators `countingtricks` can follow: countlens's reconstruction from the paper's text (32
#: cases), or the rules of the paper's public generator (`countlens.datasets.paper_generator`, 18 cases).
DESIGNS: tuple[str, ...] = ("countlens", "paper-code")


def countingtricks(
    cases: list[str] | tuple[str, ...] | None = None,
    n_per_case: int = 1000,
    grid: Geometry | None = None,
    seed: int = 0,
    design: str = "countlens",
    **kw,
) -> list[TaskSample]:
    """``n_per_case`` samples of each case, case by case. ``design="countlens"`` (default): the 32 cases
    of this module (`trick_sample`; default all). ``design="paper-code"``: the 18 circle cases as the MAS
    paper's generator draws them (`countlens.datasets.paper_generator.reference_sample`: shared layouts per
    index, counts 1–10, the code's drop rule), on ``grid`` or the code's 384 px / 27 px; it takes
    ``prompt``, ``color`` and ``background``."""
    if design not in DESIGNS:
        raise InputError(f"unknown design {design!r}; use one of {DESIGNS}")
    if isinstance(cases, str):  # one case named alone: "1A"
        cases = [cases]
    if cases is not None:
        cases = [require_text(c, "each case") for c in require_sequence(cases, "cases", example='["1A", "4A"]')]
    require_count(n_per_case, "n_per_case")
    require_seed(seed)
    if design == "paper-code":
        names = list(REFERENCE_CASES) if cases is None else [str(n).upper() for n in cases]
        require_distinct(names, "cases")
        allowed = {"prompt", "color", "background"}
        if set(kw) - allowed:
            raise InputError(
                f"design='paper-code' draws red circles at the code's counts; {sorted(set(kw) - allowed)} "
                f"cannot be set (it takes {sorted(allowed)})"
            )
        g = reference_grid(grid)
        check_capacity(names, g)
        return [reference_sample(name, seed, i, g, **kw) for name in names for i in range(n_per_case)]
    names = list(CASES) if cases is None else [case(n).name for n in cases]
    require_distinct(names, "cases")
    return [trick_sample(name, seed, i, grid, **kw) for name in names for i in range(n_per_case)]
