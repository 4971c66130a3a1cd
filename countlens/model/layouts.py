"""Where each image token sits on the image: its cell on the base token grid, and its view.

A processor may show the language model one image several times at different resolutions: LLaVA-NeXT
and OneVision a base image and then a high-resolution grid of crops; InternVL a grid of tiles and
then a thumbnail. countlens gives every image token

- a **cell** on the *base grid*, the token grid of the sample's `Geometry` (the processor's own
  size: LLaVA's base image, one InternVL tile): the base cell its centre falls in, so tokens of a
  finer view share a cell with their neighbours, and a cell holds every token that sees it;
- a **view**: 0 for tokens of the image at the base grid's resolution (the grid itself, LLaVA's base
  image, InternVL's only tile or its thumbnail), 1 for the finer view (LLaVA's crops, InternVL's
  tiles, both stitched into one grid).

Where the tower drops a remainder (`Geometry.dropped`: SigLIP's 384 px of 14 px patches), the base
grid covers the seen 378 px of its image, and each tile or crop of a finer view drops its own 6 px strip:
a finer token's centre is placed in its own tile, and one whose centre falls in the base image's strip
gets (-1, -1) (SmolVLM's tiles, OneVision's crops).
Tokens that cover no cell (LLaVA's row-end newlines) get cell (-1, -1). A lit square in one base
cell therefore changes, in every view, the tokens mapped to that cell most (`tests/unit/
test_arch_matrix.py`).

Layouts (named by `countlens.model.families.spec.ArchSpec.layout`):

- ``grid``: the token grid in row-major order, one view.
- ``anyres``: the base grid row-major, then the high-resolution grid row-major with a newline token
  ending each row. Mapped for square crop grids (side a multiple of the base grid's); other
  high-resolution tokens get (-1, -1).
- ``tiles_thumbnail`` (InternVL) and ``thumbnail_tiles`` (Ovis2): the image resized to R × C tiles of
  the base size, each tile's token grid in row-major order, tiles in row-major order, and — when
  R·C > 1 — a thumbnail (the whole image at one tile's size) after the tiles or before them. Ovis2's
  separators between tiles are other tokens than the image token, so they are not image tokens here.
- ``hd_global`` (Phi-4-multimodal): the high-resolution crops stitched into one grid, R useful rows
  of C tokens each ended by a newline, one separator, then the global image (the base grid) with a
  newline ending each row. Newlines and the separator get (-1, -1).

- ``padded_tiles`` (Llama 4): the image resized, aspect kept, into the top-left of a canvas of tiles
  and padded; the canvas's tiles one after another (each row-major), then — beside several tiles —
  the whole image stretched to one tile. Tile tokens whose centre is padding get (-1, -1).
- ``cross_tiles`` (Llama-3.2-Vision): not tokens but the image *states* its cross-attention layers
  read: a fixed number of tile slots, each a class token then the tile's patch grid row-major; the
  image's R × C tiles fill the first slots row-major, the rest are padding. Class tokens and padding
  slots get (-1, -1).

R × C (tiles or crops) is the processor's own choice (`countlens.model.processors.tile_grid`); Phi-4's
useful rows and columns (the crops' padding dropped) come from the processor's padding rule
(`countlens.model.processors.useful_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.errors import ImageTokenCountError, InputError
from countlens.model.geometry import Geometry

if TYPE_CHECKING:
    from jaxtyping import Int

BASE_VIEW = 0
FINE_VIEW = 1
#: Per axis (height, width), (seen, side) px of one tile or crop whose remainder the tower drops
#: (`Geometry.dropped`); None for whole grids.
Seen = tuple[tuple[int, int], tuple[int, int]] | None


@dataclass(frozen=True)
class TokenCells:
    """Per image token, in sequence order: its base-grid cell (row, col) and its view."""

    cells: Int[Tensor, "n_tokens 2"]
    views: Int[Tensor, " n_tokens"]


#: Layouts that cut the image into a processor-chosen grid of tiles (crops).
TILED = ("tiles_thumbnail", "thumbnail_tiles", "hd_global", "cross_tiles", "padded_tiles")


def token_cells(
    layout: str,
    geom: Geometry,
    n_tokens: int,
    sample: int,
    tiles: tuple[int, int] | None = None,
    useful: tuple[int, int] | None = None,
) -> TokenCells:
    """The cells and views of a sample's ``n_tokens`` image tokens under ``layout`` (see the module
    docstring); ``tiles`` is the (rows, cols) grid of tiles or crops the processor cut (TILED layouts),
    ``useful`` (``hd_global``) the high-resolution token rows and columns that show the image."""
    rows, cols = geom.token_grid
    # Per axis, (seen, side) px of one tile or crop where the tower drops a remainder: each drops its own strip.
    seen = tuple(zip(geom.seen, (geom.image_height, geom.image_width), strict=True)) if geom.dropped else None
    if layout == "grid":
        _expect(n_tokens, rows * cols, f"a {rows}x{cols} token grid", sample)
        return _one_view(rows, cols)
    if layout == "anyres":
        return _anyres(rows, cols, n_tokens, sample, seen)
    if layout not in TILED:
        raise ValueError(f"unknown layout {layout!r}")
    if tiles is None:
        raise InputError(f"sample {sample}: the {layout} layout needs the processor's tile grid; none was given")
    if layout == "hd_global":
        if useful is None:
            raise InputError(f"sample {sample}: the hd_global layout needs the image's useful token rows and columns")
        return _hd_global(rows, cols, n_tokens, tiles, useful, sample)
    if layout == "cross_tiles":
        return _cross_tiles(rows, cols, n_tokens, tiles, sample, seen)
    if layout == "padded_tiles":
        if useful is None:
            raise InputError(f"sample {sample}: the padded_tiles layout needs the resized image's size in pixels")
        return _padded_tiles(geom, n_tokens, tiles, useful, sample)
    return _tiles(rows, cols, n_tokens, tiles, sample, seen, thumbnail_first=layout == "thumbnail_tiles")


def _grid(rows: int, cols: int) -> Tensor:
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([r, c], -1).reshape(-1, 2)


def _one_view(rows: int, cols: int, view: int = BASE_VIEW) -> TokenCells:
    return TokenCells(_grid(rows, cols), torch.full((rows * cols,), view))


def _coarsen(fine: Tensor, fine_shape: tuple[int, int], rows: int, cols: int, seen: Seen = None) -> Tensor:
    """Cells of a finer grid over the same image, as the base cells their centres fall in. With ``seen``
    (a dropped remainder), the finer grid is tiles of rows × cols tokens each over its own tile of the
    image, whose last ``side - seen`` px per axis no token sees; a centre in the base image's strip gets
    (-1, -1)."""
    if seen is None:
        return torch.stack([fine[:, 0] * rows // fine_shape[0], fine[:, 1] * cols // fine_shape[1]], -1)
    cells = torch.stack(
        [
            _base_axis(fine[:, 0], rows, fine_shape[0] // rows, *seen[0]),
            _base_axis(fine[:, 1], cols, fine_shape[1] // cols, *seen[1]),
        ],
        -1,
    )
    cells[(cells < 0).any(-1)] = -1
    return cells


def _base_axis(fine: Tensor, n: int, n_tiles: int, part: int, side: int) -> Tensor:
    """Along one axis: the base cell (of ``n`` over the first ``part`` of ``side`` px) of the centre of each
    token ``fine`` of ``n_tiles`` tiles of ``n`` tokens, each tile ``side`` px of which its tokens cover
    ``part``; -1 where the centre is past the base cells. The centre, in one tile's pixels, is
    (tile·side + (local + ½)·part / n) / n_tiles, so the cell is that × n / part, in integers."""
    tile, local = fine // n, fine % n
    cell = (2 * n * tile * side + (2 * local + 1) * part) // (2 * n_tiles * part)
    return torch.where(cell < n, cell, -1)


def _tile_cells(rows: int, cols: int, tile_rows: int, tile_cols: int, seen: Seen = None) -> Tensor:
    """Base cells of every token of a tile_rows × tile_cols grid of tiles (each rows × cols tokens),
    tile by tile in row-major order, each tile's tokens row-major."""
    n_tiles = tile_rows * tile_cols
    # Token (tile t, r, c) sits at row (t // C)·rows + r, column (t % C)·cols + c of the stitched grid.
    t, local = torch.arange(n_tiles).repeat_interleave(rows * cols), _grid(rows, cols).repeat(n_tiles, 1)
    fine = torch.stack([(t // tile_cols) * rows + local[:, 0], (t % tile_cols) * cols + local[:, 1]], -1)
    return _coarsen(fine, (tile_rows * rows, tile_cols * cols), rows, cols, seen)


def _newline_rows(
    n_rows: int, n_cols: int, fine_shape: tuple[int, int], rows: int, cols: int, seen: Seen = None
) -> Tensor:
    """Base cells of n_rows rows of n_cols tokens each ended by a newline, on a grid of ``fine_shape``
    over the image; the newlines get (-1, -1)."""
    fine = _grid(n_rows, n_cols + 1)
    cells = _coarsen(fine, fine_shape, rows, cols, seen)
    cells[fine[:, 1] == n_cols] = -1
    return cells


def _join(*parts: TokenCells) -> TokenCells:
    return TokenCells(torch.cat([p.cells for p in parts]), torch.cat([p.views for p in parts]))


def _expect(n_tokens: int, expected: int, what: str, sample: int) -> None:
    if n_tokens != expected:
        raise ImageTokenCountError(
            f"sample {sample}: {n_tokens} image tokens but {what} gives {expected}; "
            "one image per prompt is supported, with the processor's own settings"
        )


def _anyres(rows: int, cols: int, n_tokens: int, sample: int, seen: Seen = None) -> TokenCells:
    n_rest = n_tokens - rows * cols
    if n_rest < 0:
        raise ImageTokenCountError(f"sample {sample}: {n_tokens} image tokens, fewer than the base grid {rows}x{cols}")
    side = int(n_rest**0.5)
    if not (side * (side + 1) == n_rest and side % rows == 0):  # not a square crop grid: unmapped
        return _join(_one_view(rows, cols), TokenCells(torch.full((n_rest, 2), -1), torch.full((n_rest,), FINE_VIEW)))
    cells = _newline_rows(side, side, (side, side), rows, cols, seen)
    return _join(_one_view(rows, cols), TokenCells(cells, torch.full((n_rest,), FINE_VIEW)))


def _tiles(
    rows: int, cols: int, n_tokens: int, tiles: tuple[int, int], sample: int, seen: Seen, *, thumbnail_first: bool
) -> TokenCells:
    per_tile = rows * cols
    tile_rows, tile_cols = tiles
    n_tiles = tile_rows * tile_cols
    _expect(n_tokens, per_tile * (n_tiles + (n_tiles > 1)), f"{tile_rows}x{tile_cols} tiles of {rows}x{cols}", sample)
    if n_tiles == 1:  # one tile: no thumbnail
        return _one_view(rows, cols)
    cells = _tile_cells(rows, cols, tile_rows, tile_cols, seen)
    tiles = TokenCells(cells, torch.full((len(cells),), FINE_VIEW))
    thumbnail = _one_view(rows, cols)
    return _join(thumbnail, tiles) if thumbnail_first else _join(tiles, thumbnail)


def _hd_global(
    rows: int, cols: int, n_tokens: int, crops: tuple[int, int], useful: tuple[int, int], sample: int
) -> TokenCells:
    crop_rows, crop_cols = crops
    hd_rows, hd_cols = useful
    _expect(
        n_tokens,
        hd_rows * (hd_cols + 1) + 1 + rows * (cols + 1),
        f"{hd_rows}x{hd_cols} high-resolution tokens of {crop_rows}x{crop_cols} crops, rows ended by newlines, "
        f"a separator and a {rows}x{cols} global grid",
        sample,
    )
    hd = _newline_rows(hd_rows, hd_cols, (crop_rows * rows, crop_cols * cols), rows, cols)
    glob = _newline_rows(rows, cols, (rows, cols), rows, cols)
    return _join(
        TokenCells(hd, torch.full((len(hd),), FINE_VIEW)),
        TokenCells(torch.full((1, 2), -1), torch.full((1,), BASE_VIEW)),  # the separator
        TokenCells(glob, torch.full((len(glob),), BASE_VIEW)),
    )


def _padded_tiles(
    geom: Geometry, n_tokens: int, tiles: tuple[int, int], resized: tuple[int, int], sample: int
) -> TokenCells:
    """Llama 4: the image resized into the top-left of a canvas of R × C tiles (``resized``: its height
    and width in pixels), the canvas padded, cut into tiles whose tokens come tile by tile, each
    row-major; then, beside several tiles, the whole image stretched to one tile. A tile token maps to
    the base cell its centre falls in on the image, or to (-1, -1) where its centre is padding."""
    rows, cols = geom.token_grid
    side = geom.image_height  # the tile side in pixels
    tile_rows, tile_cols = tiles
    n_tiles = tile_rows * tile_cols
    per_tile = rows * cols
    _expect(n_tokens, per_tile * (n_tiles + (n_tiles > 1)), f"{tile_rows}x{tile_cols} tiles of {rows}x{cols}", sample)
    if n_tiles == 1 and resized == (geom.image_height, geom.image_width):
        return _one_view(rows, cols)
    t, local = torch.arange(n_tiles).repeat_interleave(per_tile), _grid(rows, cols).repeat(n_tiles, 1)
    fine_y = (t // tile_cols) * rows + local[:, 0]  # the token's row and column on the canvas
    fine_x = (t % tile_cols) * cols + local[:, 1]
    # Twice the centre in pixels, (2f + 1) · side / (2 · rows), against the resized image's extent.
    inside = ((2 * fine_y + 1) * side < 2 * resized[0] * rows) & ((2 * fine_x + 1) * side < 2 * resized[1] * cols)
    cells = torch.stack(
        [((2 * fine_y + 1) * side) // (2 * resized[0]), ((2 * fine_x + 1) * side) // (2 * resized[1])], -1
    )
    cells[~inside] = -1
    view = FINE_VIEW if n_tiles > 1 else BASE_VIEW
    tiled = TokenCells(cells, torch.full((len(cells),), view))
    return tiled if n_tiles == 1 else _join(tiled, _one_view(rows, cols))


def _cross_tiles(
    rows: int, cols: int, n_states: int, tiles: tuple[int, int], sample: int, seen: Seen = None
) -> TokenCells:
    per_tile = rows * cols + 1  # a class token, then the patches
    tile_rows, tile_cols = tiles
    n_tiles = tile_rows * tile_cols
    if n_states % per_tile or n_states // per_tile < n_tiles:
        raise ImageTokenCountError(
            f"sample {sample}: {n_states} image states are not whole tiles of {rows}x{cols} patches and a class "
            f"token holding {tile_rows}x{tile_cols} tiles; the processor's settings disagree with the model's config"
        )
    slots = n_states // per_tile
    cells = torch.full((slots, per_tile, 2), -1)
    cells[:n_tiles, 1:] = _tile_cells(rows, cols, tile_rows, tile_cols, seen).view(n_tiles, -1, 2)
    view = BASE_VIEW if n_tiles == 1 else FINE_VIEW
    return TokenCells(cells.view(-1, 2), torch.full((n_states,), view))
