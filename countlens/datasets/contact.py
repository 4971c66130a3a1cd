"""Exact contact between scene objects: boundary distances and touching placements.

Adjacency cases need objects whose outlines touch (or stand a set number of pixels apart), for any
pair of shapes. Circles are discs; squares and triangles are convex polygons whose vertices are
derived from the same inequalities `Scene` renders with. `boundary_gap(a, b)` is the distance
between the two outlines (≤ 0 when they overlap). `touching_distance` finds, by bisection on that
monotone quantity, how far apart two centres must be along a direction for the outlines to stand
exactly ``gap`` pixels apart (0: touching); results are cached because adjacency layouts reuse a
few (shape, size, rotation, direction) combinations many times.

Touching at a single point is invisible once drawn: a triangle's tip pixel is often not inked, so
two "touching" triangles show a gap. `facing_rotation` turns a polygon so that it meets its
neighbour along an edge (`shared_edge`, the length of outline two touching polygons share), and
`pixel_joined` says whether two drawn masks touch under 4- or 8-connectivity.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from countlens.datasets.scene import Obj, polygon


def _point_segment_distance(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distances from points p (m, 2) to segments a→b (k, 2): (m, k)."""
    ab = b - a
    ap = p[:, None, :] - a[None]
    t = np.clip((ap * ab[None]).sum(-1) / (ab * ab).sum(-1)[None], 0.0, 1.0)
    closest = a[None] + t[..., None] * ab[None]
    return np.linalg.norm(p[:, None, :] - closest, axis=-1)


def _inside_convex(p: np.ndarray, poly: np.ndarray) -> np.ndarray:
    edges = np.roll(poly, -1, axis=0) - poly
    rel = p[:, None, :] - poly[None]
    cross = edges[None, :, 0] * rel[..., 1] - edges[None, :, 1] * rel[..., 0]
    return (cross >= 0).all(axis=1) | (cross <= 0).all(axis=1)


def _penetration(p: np.ndarray, q: np.ndarray) -> float:
    """Separating-axis test for two convex polygons: the smallest overlap of their projections over
    all edge normals (≤ 0 when an axis separates them, i.e. they do not overlap)."""
    depth = np.inf
    for poly in (p, q):
        edges = np.roll(poly, -1, axis=0) - poly
        normals = np.stack([-edges[:, 1], edges[:, 0]], axis=1)
        normals /= np.linalg.norm(normals, axis=1, keepdims=True)
        pp, qq = p @ normals.T, q @ normals.T
        depth = min(depth, float(np.minimum(pp.max(0) - qq.min(0), qq.max(0) - pp.min(0)).min()))
    return depth


def boundary_gap(a: Obj, b: Obj) -> float:
    """Distance in pixels between the outlines of two objects; ≤ 0 when they overlap."""
    if a.shape == "circle" and b.shape == "circle":
        return float(np.hypot(a.cx - b.cx, a.cy - b.cy) - (a.size + b.size) / 2)
    if b.shape == "circle":
        a, b = b, a
    if a.shape == "circle":
        poly, c = polygon(b), np.array([[a.cx, a.cy]])
        d = _point_segment_distance(c, poly, np.roll(poly, -1, axis=0)).min()
        return float((-d if _inside_convex(c, poly)[0] else d) - a.size / 2)
    p, q = polygon(a), polygon(b)
    depth = _penetration(p, q)
    if depth > 0:
        return -depth
    d1 = _point_segment_distance(p, q, np.roll(q, -1, axis=0)).min()
    d2 = _point_segment_distance(q, p, np.roll(p, -1, axis=0)).min()
    return float(min(d1, d2))


def _bisect(gap_at, lo: float, hi: float, gap: float) -> float:
    """Smallest t in [lo, hi] with gap_at(t) ≥ gap, for gap_at non-decreasing in t."""
    for _ in range(60):
        mid = (lo + hi) / 2
        if gap_at(mid) >= gap:
            hi = mid
        else:
            lo = mid
    return hi


@lru_cache(maxsize=4096)
def touching_distance(
    shape_a: str, rot_a: float, shape_b: str, rot_b: float, size: float, angle: float, gap: float = 0.0
) -> float:
    """Centre distance along ``angle`` (degrees, screen: 0 = right, 90 = down) at which b stands
    exactly ``gap`` px from a; both objects have size ``size``."""
    u = np.array([np.cos(np.deg2rad(angle)), np.sin(np.deg2rad(angle))])
    a = Obj(shape_a, "red", 0.0, 0.0, size, rot_a)

    def gap_at(t: float) -> float:
        return boundary_gap(a, Obj(shape_b, "red", t * u[0], t * u[1], size, rot_b))

    return _bisect(gap_at, 0.0, 2 * size + gap + 1.0, gap)


def shared_edge(a: Obj, b: Obj, tol: float = 1e-6) -> float:
    """Length in pixels of the outline two touching polygons share: 0 for a circle or a point contact."""
    if a.shape == "circle" or b.shape == "circle":
        return 0.0
    p, q = polygon(a), polygon(b)
    total = 0.0
    for e0, e1 in zip(p, np.roll(p, -1, axis=0)):
        length = float(np.hypot(*(e1 - e0)))
        u = (e1 - e0) / length
        normal = np.array([-u[1], u[0]])
        for f0, f1 in zip(q, np.roll(q, -1, axis=0)):
            if abs((f0 - e0) @ normal) > tol or abs((f1 - e0) @ normal) > tol:
                continue  # not on this edge's line
            lo, hi = sorted((float((f0 - e0) @ u), float((f1 - e0) @ u)))
            total += max(0.0, min(length, hi) - max(0.0, lo))
    return total


_PERIOD = {"square": 90, "triangle": 120}  # rotations that leave the outline unchanged


@lru_cache(maxsize=8192)
def contact_length(shape_a: str, rot_a: float, shape_b: str, rot_b: float, size: float, angle: float) -> float:
    """`shared_edge` of a at the origin and b placed along ``angle`` (degrees) so that they touch."""
    if shape_a == "circle" or shape_b == "circle":
        return 0.0
    t = touching_distance(shape_a, rot_a, shape_b, rot_b, size, angle, 0.0)
    u = np.cos(np.deg2rad(angle)), np.sin(np.deg2rad(angle))
    return shared_edge(Obj(shape_a, "red", 0.0, 0.0, size, rot_a), Obj(shape_b, "red", t * u[0], t * u[1], size, rot_b))


def facing_rotation(shape_a: str, rot_a: float, shape_b: str, size: float, angle: float) -> tuple[float, float]:
    """(rotation, shared length): the rotation, a multiple of 15°, at which b placed along ``angle``
    from a (rotated ``rot_a``) and touching it shares the longest edge with it; ties go to the
    smallest rotation, so a circle, or a polygon that can only meet a at a point, stays at 0°."""
    best = (0.0, 0.0)
    for rot in range(0, _PERIOD.get(shape_b, 0), 15):
        shared = contact_length(shape_a, rot_a, shape_b, float(rot), size, angle)
        if shared > best[1] + 1e-9:
            best = (float(rot), shared)
    return best


def pixel_joined(a: np.ndarray, b: np.ndarray, connectivity: int = 4) -> bool:
    """Whether two (h, w) masks overlap or touch: some pixel of b is a 4- (or 8-) neighbour of one of a."""
    if connectivity not in (4, 8):
        raise ValueError(f"connectivity is 4 or 8, got {connectivity}")
    grown = a.copy()
    grown[1:] |= a[:-1]
    grown[:-1] |= a[1:]
    grown[:, 1:] |= a[:, :-1]
    grown[:, :-1] |= a[:, 1:]
    if connectivity == 8:
        grown[1:, 1:] |= a[:-1, :-1]
        grown[:-1, :-1] |= a[1:, 1:]
        grown[1:, :-1] |= a[:-1, 1:]
        grown[:-1, 1:] |= a[1:, :-1]
    return bool((grown & b).any())


def ring_radius(shape: str, size: float, n: int, gap: float = 0.0) -> float:
    """Radius of a ring of n objects, each rotated with its angle, whose neighbours stand ``gap`` apart."""
    if n < 2:
        return 0.0
    th = 2 * np.pi / n

    def gap_at(rho: float) -> float:
        a = Obj(shape, "red", rho, 0.0, size, 0.0)
        b = Obj(shape, "red", rho * np.cos(th), rho * np.sin(th), size, -np.rad2deg(th))
        return boundary_gap(a, b)

    return _bisect(gap_at, 0.0, (2 * size + gap + 1.0) * n, gap)
