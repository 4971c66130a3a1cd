"""Touching objects arranged for COUNTINGTRICKS' adjacency cases (9–15): lines, rings, clusters and
tilings, each object ``gap`` pixels from its neighbours.

Every arrangement is a list of (shape, rotation, x, y) around the origin, in pixels, for an object
size; `countlens.datasets.countingtricks` picks one per case, rotates and places it on the image.
Distances and rotations come from `countlens.datasets.contact`: polygons turn so neighbours share
an edge where their shapes can (a row of triangles alternates up and down), and a cluster redraws a
direction in which two polygons could meet only at a point.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

from countlens.datasets.contact import boundary_gap, contact_length, facing_rotation, ring_radius, touching_distance
from countlens.datasets.scene import Obj
from countlens.errors import CountlensError


def split_count(n: int, most: int) -> list[int]:
    """n into as few parts of ≤ most as possible, as equal as possible."""
    k = math.ceil(n / most)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


# A line's polygons keep their edges on the line's axes: squares upright, triangles pointing up,
# down (60°), right (30°) or left (90°), so every shared edge is across the line.
LINE_ROTATIONS = {"circle": (0.0,), "square": (0.0,), "triangle": (0.0, 30.0, 60.0, 90.0)}


@lru_cache(maxsize=1024)
def line_rotations(shapes: tuple[str, ...], size: float, angle: float) -> tuple[float, ...]:
    """Rotations for objects in a line along ``angle``, each touching the next, such that the
    shortest edge shared by neighbours is as long as it can be, then their sum (ties: the first
    in order). A row of triangles alternates up and down; a triangle beside a square turns a flat
    side to it. Exhaustive: lines hold at most 4 objects and a triangle 4 rotations."""
    best, best_key = (0.0,) * len(shapes), (-1.0, -1.0)
    for rots in itertools.product(*(LINE_ROTATIONS[s] for s in shapes)):
        shared = [contact_length(a, ra, b, rb, size, angle) for a, ra, b, rb in zip(shapes, rots, shapes[1:], rots[1:])]
        key = (min(shared, default=0.0), sum(shared))
        if key[0] > best_key[0] + 1e-9 or (abs(key[0] - best_key[0]) <= 1e-9 and key[1] > best_key[1] + 1e-9):
            best, best_key = rots, key
    return best


def chain(shapes: list[str], size: float, angle: float, gap: float) -> list[tuple[str, float, float, float]]:
    """Objects (shape, rotation, x, y) in a line along ``angle``, each ``gap`` from the previous one,
    turned to meet their neighbours along edges where the shapes can (`line_rotations`)."""
    rots = line_rotations(tuple(shapes), size, angle)
    out = [(shapes[0], rots[0], 0.0, 0.0)]
    u = (math.cos(math.radians(angle)), math.sin(math.radians(angle)))
    for s, rot in zip(shapes[1:], rots[1:]):
        prev, prev_rot, x, y = out[-1]
        t = touching_distance(prev, prev_rot, s, rot, size, angle, gap)
        out.append((s, rot, x + t * u[0], y + t * u[1]))
    return out


def ring(shape: str, n: int, size: float, gap: float) -> list[tuple[str, float, float, float]]:
    rho = ring_radius(shape, size, n, gap)
    th = [2 * math.pi * i / n for i in range(n)]
    return [(shape, -math.degrees(t), rho * math.cos(t), rho * math.sin(t)) for t in th]


def cluster(shape: str, n: int, size: float, gap: float, rng) -> list[tuple[str, float, float, float]]:
    """Grow a cluster: each new object touches a random placed one along a multiple of 15°; polygons
    turn to meet it along an edge, and a direction where they could only meet at a point is redrawn."""
    placed = [(shape, 0.0, 0.0, 0.0)]
    while len(placed) < n:
        for _ in range(500):
            _, anchor_rot, x, y = placed[rng.integers(len(placed))]
            angle = 15.0 * int(rng.integers(24))
            rot, shared = facing_rotation(shape, anchor_rot, shape, size, angle)
            if shape != "circle" and shared < 1.0:
                continue
            t = touching_distance(shape, anchor_rot, shape, rot, size, angle, gap)
            cand = (x + t * math.cos(math.radians(angle)), y + t * math.sin(math.radians(angle)))
            new = Obj(shape, "red", cand[0], cand[1], size, rot)
            if all(boundary_gap(new, Obj(s, "red", px, py, size, r)) >= gap - 1e-6 for s, r, px, py in placed):
                placed.append((shape, rot, *cand))
                break
        else:
            raise CountlensError(f"could not grow a cluster of {n} {shape}s; use fewer objects")
    return placed


def tiling(shape: str, n: int, size: float, gap: float) -> list[tuple[str, float, float, float]]:
    cols = math.ceil(math.sqrt(n))
    out = []
    for i in range(n):
        r, k = divmod(i, cols)
        if shape == "square":
            out.append((shape, 0.0, k * (size + gap), r * (size + gap)))
        elif shape == "circle":
            step = size + gap
            out.append((shape, 0.0, k * step + (step / 2 if r % 2 else 0.0), r * step * math.sqrt(3) / 2))
        else:
            # Alternating up/down triangles share edges. In every strip an up triangle's centre is R
            # below the strip's top and a down triangle's R/2; the strip below is the mirror image.
            big_r = size / 2
            up = (k + r) % 2 == 0
            x = k * (big_r * math.sqrt(3) / 2 + 2 * gap / math.sqrt(3))
            y = r * (1.5 * big_r + gap) + (big_r if up else big_r / 2)
            out.append((shape, 0.0 if up else 180.0, x, y))
    return out
