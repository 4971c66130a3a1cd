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

Tokens that cover no cell (LLaVA's row-end newlines) get cell (-1, -1). A lit square in one base
cell therefore changes, in every view, the tokens mapped to that cell most (`tests/unit/
test_arch_matrix.py`).

Layouts (named by `countlens.arch.ArchSpec.layout`):

- ``grid``: the token grid in row-major order, one view.
- ``anyres``: the base grid row-major, then the high-resolution grid row-major with a newline token
  ending each row. Mapped for square crop grids (side a multiple of the base grid's); other
  high-resolution tokens get (-1, -1).
- ``tiles_thumbnail``: the image resized to R × C tiles of the base size; each tile's token grid in
  row-major order, tiles in row-major order, then the thumbnail when R·C > 1. The processor picks
  R × C from the image's aspect ratio; countlens reads R·C off the token count and takes the
  factorisation whose C / R is closest to the image's width / height, which is the processor's own
  choice among grids of that many tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.errors import InputError
from countlens.geometry import Geometry

if TYPE_CHECKING:
    from jaxtyping import Int

BASE_VIEW = 0
FINE_VIEW = 1


@dataclass(frozen=True)
class TokenCells:
    """Per image token, in sequence order: its base-grid cell (row, col) and its view."""

    cells: Int[Tensor, "n_tokens 2"]
    views: Int[Tensor, " n_tokens"]


def token_cells(layout: str, geom: Geometry, n_tokens: int, image_size: tuple[int, int], sample: int) -> TokenCells:
    """The cells and views of a sample's ``n_tokens`` image tokens under ``layout`` (see the module
    docstring); ``image_size`` is the input image's (height, width), which picks a tile grid."""
    rows, cols = geom.token_grid
    if layout == "grid":
        _expect(n_tokens, rows * cols, f"a {rows}x{cols} token grid", sample)
        return _one_view(rows, cols)
    if layout == "anyres":
        return _anyres(rows, cols, n_tokens, sample)
    if layout == "tiles_thumbnail":
        return _tiles(rows, cols, n_tokens, image_size, sample, thumbnail_first=False)
    raise ValueError(f"unknown layout {layout!r}")


def tile_grid(n_tiles: int, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of ``n_tiles`` tiles whose aspect ratio cols / rows is closest to width / height."""
    pairs = [(r, n_tiles // r) for r in range(1, n_tiles + 1) if n_tiles % r == 0]
    return min(pairs, key=lambda rc: abs(width / height - rc[1] / rc[0]))


def _grid(rows: int, cols: int) -> Tensor:
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([r, c], -1).reshape(-1, 2)


def _one_view(rows: int, cols: int, view: int = BASE_VIEW) -> TokenCells:
    return TokenCells(_grid(rows, cols), torch.full((rows * cols,), view))


def _coarsen(fine: Tensor, fine_shape: tuple[int, int], rows: int, cols: int) -> Tensor:
    """Cells of a finer grid over the same image, as the base cells their centres fall in."""
    return torch.stack([fine[:, 0] * rows // fine_shape[0], fine[:, 1] * cols // fine_shape[1]], -1)


def _join(*parts: TokenCells) -> TokenCells:
    return TokenCells(torch.cat([p.cells for p in parts]), torch.cat([p.views for p in parts]))


def _expect(n_tokens: int, expected: int, what: str, sample: int) -> None:
    if n_tokens != expected:
        raise InputError(
            f"sample {sample}: {n_tokens} image tokens but {what} gives {expected}; "
            "one image per prompt is supported, with the processor's own settings"
        )


def _anyres(rows: int, cols: int, n_tokens: int, sample: int) -> TokenCells:
    n_rest = n_tokens - rows * cols
    if n_rest < 0:
        raise InputError(f"sample {sample}: {n_tokens} image tokens, fewer than the base grid {rows}x{cols}")
    side = int(n_rest**0.5)
    if not (side * (side + 1) == n_rest and side % rows == 0):  # not a square crop grid: unmapped
        return _join(_one_view(rows, cols), TokenCells(torch.full((n_rest, 2), -1), torch.full((n_rest,), FINE_VIEW)))
    fine = _grid(side, side + 1)  # R rows of C tokens and a newline
    cells = _coarsen(fine, (side, side), rows, cols)
    cells[fine[:, 1] == side] = -1  # the row-end newlines
    return _join(_one_view(rows, cols), TokenCells(cells, torch.full((n_rest,), FINE_VIEW)))


def _tiles(
    rows: int, cols: int, n_tokens: int, image_size: tuple[int, int], sample: int, *, thumbnail_first: bool
) -> TokenCells:
    per_tile = rows * cols
    if n_tokens % per_tile:
        raise InputError(
            f"sample {sample}: {n_tokens} image tokens is not a whole number of {rows}x{cols} tiles; "
            "the processor's tile size, patch size or merge disagrees with the model's config"
        )
    if n_tokens == per_tile:  # one tile: no thumbnail
        return _one_view(rows, cols)
    tile_rows, tile_cols = tile_grid(n_tokens // per_tile - 1, *image_size)
    # Token (tile t, r, c) sits at row (t // C)·rows + r, column (t % C)·cols + c of the stitched grid.
    n_tiles = tile_rows * tile_cols
    t, local = torch.arange(n_tiles).repeat_interleave(per_tile), _grid(rows, cols).repeat(n_tiles, 1)
    fine = torch.stack([(t // tile_cols) * rows + local[:, 0], (t % tile_cols) * cols + local[:, 1]], -1)
    cells = _coarsen(fine, (tile_rows * rows, tile_cols * cols), rows, cols)
    tiles = TokenCells(cells, torch.full((len(t),), FINE_VIEW))
    thumbnail = _one_view(rows, cols)
    return _join(thumbnail, tiles) if thumbnail_first else _join(tiles, thumbnail)
