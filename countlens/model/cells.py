"""Pixels to token cells: which cells of an image-token grid a scene's objects cover.

A scene rendered at any size is cut into the token grid's cells with integer edges (cell k of an
axis of n pixels and m cells spans round(k·n/m) … round((k+1)·n/m)); a cell's *coverage* by an
object is the share of the cell's pixels the object's mask covers. Where the vision tower drops a
strip (`Geometry.dropped`: SigLIP's 384 px of 14 px patches, 378 px seen), the cells cut only the
seen share of each axis (cell k of a 384 px scene spans 14k … 14(k+1) px); the strip's pixels are
in no cell, so an object (or its part) lying only there covers nothing. Attention metrics
(`countlens.analysis.attention_metrics.object_cells`) and object positions
(`countlens.circuits.sites.positions.Objects`) read the same cells from here.
"""

from __future__ import annotations

import numpy as np

from countlens.errors import InputError
from countlens.model.geometry import Geometry


def cell_edges(n_pixels: int, n_cells: int, what: str, seen: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Int[ndarray, "n_cells+1"]: the pixel edges of ``n_cells`` cells along an axis of ``n_pixels``,
    over its first ``seen[0] / seen[1]`` (the share a vision tower reads: `Geometry.seen`; all of it by
    default)."""
    if n_pixels < n_cells:
        raise InputError(
            f"the scene is {n_pixels} px {what} but the token grid has {n_cells} cells; "
            "render the scene at the model's image size (vlm.geometry)"
        )
    part, whole = seen
    return np.round(np.arange(n_cells + 1) * n_pixels * part / (n_cells * whole)).astype(int)


def scene_edges(scene, geometry: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """(row edges, column edges) of ``geometry``'s token cells on ``scene`` (`cell_edges`): the seen
    part of the image only where the tower drops a strip (`Geometry.dropped`)."""
    (n_rows, n_cols), (seen_h, seen_w) = geometry.token_grid, geometry.seen
    rows = cell_edges(scene.height, n_rows, "high", (seen_h, geometry.image_height))
    return rows, cell_edges(scene.width, n_cols, "wide", (seen_w, geometry.image_width))


def cell_sums(masks: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Int[ndarray, "... rows cols"]: covered pixels per cell from Bool[ndarray, "... H W"] masks; pixels
    past the last edges (a strip the tower drops) count in no cell."""
    masks = masks[..., : rows[-1], : cols[-1]]
    per_row = np.add.reduceat(masks.astype(np.int64), rows[:-1], axis=-2)
    return np.add.reduceat(per_row, cols[:-1], axis=-1)


def object_coverage(scene, geometry: Geometry) -> np.ndarray:
    """Float[ndarray, "objects rows cols"]: each object's share of each of ``geometry``'s token cells'
    pixels (`scene_edges`: a dropped strip in no cell)."""
    rows, cols = scene_edges(scene, geometry)
    area = np.diff(rows)[:, None] * np.diff(cols)[None, :]
    return cell_sums(scene.masks(), rows, cols) / area


def object_cells(coverage: np.ndarray, threshold: float, peak: bool) -> np.ndarray:
    """Bool[ndarray, "objects rows cols"] from `object_coverage`: the cells an object covers by at least
    ``threshold`` of their pixels (threshold 0: by any pixel) and, with ``peak``, the cell(s) holding
    the largest share of it (so that an object smaller than the threshold still owns a cell)."""
    cells = coverage > 0 if threshold == 0 else coverage >= threshold
    if peak and coverage.size:
        top = coverage.max(axis=(1, 2), keepdims=True)
        cells |= (coverage == top) & (top > 0)
    return cells
