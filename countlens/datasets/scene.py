"""Scenes: pure data that renders deterministically to an image, with exact per-object masks and boxes.

A `Scene` is an image size, a background colour and a tuple of `Obj` (shape, colour, centre, size,
rotation). Rendering is analytic: pixel (row r, col c) is inside an object when its centre
(c + 0.5, r + 0.5) satisfies the shape's inequalities, so a mask is exactly what is drawn, the
drawing does not depend on a graphics library's rasteriser, and the same scene gives byte-identical
pixels on every machine. Objects are painted in order; later objects cover earlier ones.

Coordinates are continuous pixels: x to the right, y down, (0, 0) the top-left corner of the image,
so a grid line of a ``patch``-pixel grid sits at x = k·patch exactly.

Sizes: a circle's ``size`` is its diameter, a square's its side, a triangle's the diameter of its
circumscribed circle (so a circle and a triangle of one size fit the same disc).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from copy import copy
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from numbers import Integral
from typing import TYPE_CHECKING, Literal

import numpy as np

from countlens.errors import CountlensError, InputError
from countlens.validate import (
    require_count,
    require_image_side,
    require_nonnegative,
    require_positive,
)

if TYPE_CHECKING:
    from PIL import Image

Shape = Literal["circle", "square", "triangle"]
SHAPES: tuple[Shape, ...] = ("circle", "square", "triangle")

#: Named colours (RGB). Far apart in RGB so that a small vision encoder can tell them apart.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 190),
    "orange": (245, 130, 20),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "gray": (128, 128, 128),
}
OBJECT_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")


def check_visible(colors, background: str) -> None:
    """Refuse objects of the background's own colour: invisible, yet counted in the label."""
    same = sorted({c for c in colors if c == background})
    if same:
        raise InputError(
            f"objects coloured {same[0]!r} on a {background!r} background cannot be seen, yet they would be "
            "counted in the answer; choose another object colour or background"
        )


@dataclass(frozen=True)
class Obj:
    shape: Shape
    color: str
    cx: float
    cy: float
    size: float
    rotation: float = 0.0  # degrees, counter-clockwise on screen

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise CountlensError(f"unknown shape {self.shape!r}; use one of {SHAPES}")
        if self.color not in PALETTE:
            raise CountlensError(f"unknown colour {self.color!r}; use one of {tuple(PALETTE)}")
        if not self.size > 0:
            raise CountlensError(f"object size must be > 0, got {self.size}")

    @property
    def radius(self) -> float:
        """Radius of the disc that contains the object (half the diagonal for a square)."""
        return self.size / 2 * (np.sqrt(2) if self.shape == "square" else 1.0)

    def extent(self) -> tuple[float, float, float, float]:
        """Exact bounding box (x0, y0, x1, y1) of the outline, in continuous pixel coordinates."""
        if self.shape == "circle":
            r = self.size / 2
            return self.cx - r, self.cy - r, self.cx + r, self.cy + r
        v = polygon(self)
        return float(v[:, 0].min()), float(v[:, 1].min()), float(v[:, 0].max()), float(v[:, 1].max())


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    objects: tuple[Obj, ...] = ()
    background: str = "white"
    noise: float = 0.0  # std of a deterministic pixel-noise and shading texture (0: flat colours)
    noise_seed: int = 0
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.background not in PALETTE:
            raise CountlensError(f"unknown background {self.background!r}; use one of {tuple(PALETTE)}")
        check_visible([o.color for o in self.objects], self.background)
        for o in self.objects:
            x0, y0, x1, y1 = o.extent()
            if not (-1e-9 <= x0 and x1 <= self.width + 1e-9 and -1e-9 <= y0 and y1 <= self.height + 1e-9):
                # The label must always equal the number of objects drawn: never clip at the border.
                raise CountlensError(
                    f"object {o} does not fit inside the {self.width}x{self.height} image; "
                    "move it inwards or make it smaller"
                )

    def without(self, indices) -> Scene:
        """This scene without the objects at ``indices`` (an object index or a collection of them, in any
        order; empty: an equal copy), drawn again on the same size, background and noise; the other
        objects keep their order. Not re-validated: fewer objects of a valid scene are valid, and an
        object placed past `Scene`'s check by design stays as it was. Refuses (`InputError`) an index
        that is not an integer, is outside 0..n − 1, or is given twice."""
        n = len(self.objects)
        has = f"the scene has {n} object{'' if n == 1 else 's'}" + (f" (indices 0..{n - 1})" if n else "")
        if isinstance(indices, Integral) and not isinstance(indices, bool):
            indices = (indices,)
        if isinstance(indices, (str, bytes, Mapping)) or not isinstance(indices, Iterable):
            raise InputError(f"Scene.without takes object indices, e.g. [0, 2], got {indices!r:.60}; {has}")
        indices = list(indices)
        bad = [i for i in indices if not isinstance(i, Integral) or isinstance(i, (bool, np.bool_)) or not 0 <= i < n]
        if bad:
            raise InputError(
                f"Scene.without: object index {bad[0]!r:.40} is not one of this scene's: {has}; give indices in range"
            )
        twice = sorted({int(i) for i in indices if indices.count(i) > 1})
        if twice:
            raise InputError(f"Scene.without: object {twice[0]} is given more than once; {has}: give each index once")
        drop = {int(i) for i in indices}
        out = copy(self)
        out.__dict__.pop("_prints", None)  # the cached footprints are the full scene's
        object.__setattr__(out, "objects", tuple(o for j, o in enumerate(self.objects) if j not in drop))
        return out

    @cached_property
    def _prints(self) -> tuple[tuple[int, int, np.ndarray, tuple[int, int, int, int]], ...]:
        return tuple(_footprint(o.shape, o.size, o.rotation, o.cx, o.cy, self.width, self.height) for o in self.objects)

    @property
    def footprints(self) -> tuple[tuple[int, int, np.ndarray], ...]:
        """Per object, (row0, col0, Bool[ndarray, "h w"]): the pixels it covers inside its bounding
        square, whose top-left pixel is (row0, col0); the arrays are read-only. Computed once per
        object placement (`_footprint`); masks, boxes and the rendering all read it."""
        return tuple(f[:3] for f in self._prints)

    def masks(self) -> np.ndarray:
        """(n_objects, height, width) bool: the pixels each object covers (before occlusion)."""
        out = np.zeros((len(self.objects), self.height, self.width), dtype=bool)
        for i, (r0, c0, m, _) in enumerate(self._prints):
            out[i, r0 : r0 + m.shape[0], c0 : c0 + m.shape[1]] = m
        return out

    def boxes(self) -> np.ndarray:
        """(n_objects, 4) float xyxy pixel boxes of each object's mask (tight, in pixel edges)."""
        return np.array([f[3] for f in self._prints], dtype=np.float64).reshape(-1, 4)

    def render_indexed(self) -> tuple[np.ndarray, list[str]]:
        """(Uint8[ndarray, "height width"] colour indices, the colour names they index; the
        background is 0): the objects painted in order over the background, before any texture."""
        names = list(dict.fromkeys([self.background, *(o.color for o in self.objects)]))
        idx = np.zeros((self.height, self.width), dtype=np.uint8)
        for o, (r0, c0, m, _) in zip(self.objects, self._prints):
            idx[r0 : r0 + m.shape[0], c0 : c0 + m.shape[1]][m] = names.index(o.color)
        return idx, names

    def render_array(self) -> np.ndarray:
        """(height, width, 3) uint8 pixels."""
        idx, names = self.render_indexed()
        img = np.array([PALETTE[n] for n in names], dtype=np.uint8)[idx]
        if self.noise > 0:
            img = self._texture(img)
        return img

    def _texture(self, img: np.ndarray) -> np.ndarray:
        # A smooth illumination gradient plus pixel noise, both from `noise_seed` alone, so that two
        # scenes that share the seed (a clean/corrupt pair) differ only where their objects differ.
        rng = np.random.default_rng([self.noise_seed, self.width, self.height])
        gx, gy = rng.uniform(-1, 1, size=2)
        yy, xx = np.mgrid[0 : self.height, 0 : self.width]
        shade = 2 * self.noise * (gx * (xx / self.width - 0.5) + gy * (yy / self.height - 0.5))
        pixel = rng.normal(0.0, self.noise, size=img.shape)
        return np.clip(img.astype(np.float64) + shade[..., None] + pixel, 0, 255).round().astype(np.uint8)

    def render(self) -> Image.Image:
        from PIL import Image  # here, not at import: exports and layouts never need PIL

        return Image.fromarray(self.render_array(), mode="RGB")


def _footprint(
    shape: Shape, size: float, rotation: float, cx: float, cy: float, width: int, height: int
) -> tuple[int, int, np.ndarray, tuple[int, int, int, int]]:
    """(row0, col0, read-only mask over the object's bounding square, tight xyxy pixel box).

    The mask depends on the centre only through its offset within a pixel: a pixel centre's
    offset (c + 0.5) − cx equals (c − ⌊cx⌋ + 0.5) − (cx − ⌊cx⌋) to the last bit (both sides are
    one rounding of the same real number), so `_unit_footprint` draws the object once per size,
    rotation and sub-pixel offset — lattice cases place objects at the same offset in every cell."""
    bx, by = math.floor(cx), math.floor(cy)
    r0, c0, mask, (x0, y0, x1, y1) = _unit_footprint(shape, size, rotation, cx - bx, cy - by)
    r0, c0 = r0 + by, c0 + bx
    # The bounding square's 1 px margin may cross the border; the object itself never does.
    top, left = max(0, -r0), max(0, -c0)
    bottom, right = min(mask.shape[0], height - r0), min(mask.shape[1], width - c0)
    if top or left or bottom < mask.shape[0] or right < mask.shape[1]:
        mask = mask[top:bottom, left:right]
        r0, c0 = r0 + top, c0 + left
    return r0, c0, mask, (x0 + bx, y0 + by, x1 + bx, y1 + by)


@lru_cache(maxsize=8192)
def _unit_footprint(
    shape: Shape, size: float, rotation: float, fx: float, fy: float
) -> tuple[int, int, np.ndarray, tuple[int, int, int, int]]:
    """`_footprint` of an object centred at (fx, fy) with 0 ≤ fx, fy < 1, unclipped."""
    o = Obj(shape, "red", fx, fy, size, rotation)
    # Only the object's enclosing disc can be inside: test the pixels of its bounding square.
    r0, r1 = math.floor(fy - o.radius) - 1, math.ceil(fy + o.radius) + 1
    c0, c1 = math.floor(fx - o.radius) - 1, math.ceil(fx + o.radius) + 1
    ys = np.arange(r0 + 0.5, r1, dtype=np.float64)[:, None]
    xs = np.arange(c0 + 0.5, c1, dtype=np.float64)[None, :]
    mask = _inside(o, xs, ys)
    mask.flags.writeable = False
    # A convex shape's rows (columns) with ink are one run: its ends are the first True from each side.
    rows, cols = mask.any(1), mask.any(0)
    if not rows.any():
        raise CountlensError(f"object {o} is too small to cover a pixel centre; make it larger")
    top, bottom = int(rows.argmax()), len(rows) - int(rows[::-1].argmax())
    left, right = int(cols.argmax()), len(cols) - int(cols[::-1].argmax())
    return r0, c0, mask, (c0 + left, r0 + top, c0 + right, r0 + bottom)


def polygon(o: Obj) -> np.ndarray:
    """(k, 2) screen-coordinate vertices (x, y) of a square or triangle, counter-clockwise on screen."""
    if o.shape == "circle":
        raise ValueError("a circle has no polygon; use its centre and radius")
    h = o.size / 2
    if o.shape == "square":
        uv = np.array([(-h, -h), (-h, h), (h, h), (h, -h)])
    else:
        # Vertex k sits opposite edge k of `scene._inside` (whose outward normals point at 270°+120k).
        ang = np.deg2rad(90 + 120 * np.arange(3))
        uv = np.stack([h * np.cos(ang), -h * np.sin(ang)], axis=1)
    # `_inside` maps screen offsets to the object frame by u = dx·cosθ − dy·sinθ, v = dx·sinθ + dy·cosθ;
    # the inverse rotation maps the frame's vertices back to the screen.
    t = np.deg2rad(o.rotation)
    dx = uv[:, 0] * np.cos(t) + uv[:, 1] * np.sin(t)
    dy = -uv[:, 0] * np.sin(t) + uv[:, 1] * np.cos(t)
    return np.stack([dx + o.cx, dy + o.cy], axis=1)


def _inside(o: Obj, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    dx, dy = xs - o.cx, ys - o.cy
    if o.shape == "circle":
        return dx * dx + dy * dy <= (o.size / 2) ** 2
    # Rotate the pixel into the object's frame. Screen y points down, so a counter-clockwise
    # rotation on screen by θ is a clockwise one in these coordinates.
    t = np.deg2rad(o.rotation)
    u = dx * np.cos(t) - dy * np.sin(t)
    v = dx * np.sin(t) + dy * np.cos(t)
    if o.shape == "square":
        h = o.size / 2
        return (np.abs(u) <= h) & (np.abs(v) <= h)
    # Equilateral triangle, apex up, circumradius R: inside all three edges' half-planes.
    r = o.size / 2
    inside = np.ones(np.broadcast_shapes(u.shape, v.shape), dtype=bool)
    for k in range(3):
        a = np.deg2rad(90 + 120 * k + 180)  # outward normal of the edge opposite vertex k
        nx, ny = np.cos(a), -np.sin(a)
        inside &= u * nx + v * ny <= r / 2  # inradius of an equilateral triangle = R / 2
    return inside


def place_objects(
    rng: np.random.Generator,
    width: int,
    height: int,
    specs: list[tuple[Shape, str, float]],
    gap: float = 2.0,
    max_tries: int = 2000,
) -> tuple[Obj, ...]:
    """Place objects (shape, colour, size) at random so that their enclosing discs are ``gap`` px apart.

    Raises instead of returning fewer objects than asked: a label must equal what is drawn.
    """
    if not isinstance(rng, np.random.Generator):
        raise CountlensError(f"rng must be a numpy Generator (np.random.default_rng(seed)), got {type(rng).__name__}")
    require_image_side(width, "width")
    require_image_side(height, "height")
    require_nonnegative(gap, "gap")
    require_count(max_tries, "max_tries")
    if isinstance(specs, (str, bytes, dict)) or not isinstance(specs, (list, tuple)):
        raise CountlensError(
            f"specs must be a list of (shape, colour, size), e.g. [('circle', 'red', 8.0)]; got {specs!r:.60}"
        )
    for spec in specs:  # none: an empty scene
        if isinstance(spec, (str, bytes)) or not isinstance(spec, (tuple, list)) or len(spec) != 3:
            raise CountlensError(f"each spec is (shape, colour, size), e.g. ('circle', 'red', 8.0); got {spec!r:.60}")
        require_positive(spec[2], "an object's size")
    placed: list[Obj] = []
    for shape, color, size in specs:
        probe = Obj(shape, color, 0.0, 0.0, size)
        r = probe.radius
        for _ in range(max_tries):
            cx = rng.uniform(r, width - r)
            cy = rng.uniform(r, height - r)
            if all((cx - p.cx) ** 2 + (cy - p.cy) ** 2 >= (r + p.radius + gap) ** 2 for p in placed):
                rot = float(rng.uniform(0, 360)) if shape != "circle" else 0.0
                placed.append(Obj(shape, color, float(cx), float(cy), float(size), rot))
                break
        else:
            raise CountlensError(
                f"could not place {len(specs)} objects of sizes up to {max(s for *_, s in specs):.1f}px "
                f"in a {width}x{height} image with gap {gap}px; use fewer or smaller objects"
            )
    return tuple(placed)
