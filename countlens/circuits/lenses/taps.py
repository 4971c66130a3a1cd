"""Taps: image-token activations laid out on the image grid, as (batch, d, rows, cols) maps.

Three kinds of tap follow the image through the model, so that one probe architecture can ask what
each stage still encodes:

- ``("vision", b)`` — the output of vision block ``b``, on the ViT *patch* grid (before merging);
- ``("projector", None)`` — the image tokens as the language model receives them (the input of
  decoder layer 0 at the image positions), on the *token* grid;
- ``("llm", l)`` — the residual stream after decoder layer ``l`` at the image positions, token grid.

Token-grid taps use `Batch.image_cell`; where several tokens map to one cell (LLaVA-NeXT /
OneVision's high-resolution tokens, InternVL's tiles and thumbnail) the cell holds their mean. Vision
taps undo the processor's patch order: row-major for CLIP/SigLIP towers (a CLS token is dropped),
merge blocks for Qwen2-VL and Qwen3-VL, and for Qwen2.5-VL merge blocks put back from its windowed
order (the model's own window index, inverted); InternVL's tiles are laid on the base patch grid as
its tokens are on the token grid (`countlens.model.layouts` at merge 1), each cell the mean of the patches
that see it. LLaVA's any-resolution crops are not mapped yet (clear error).

A cross-attention model (Llama-3.2-Vision) has no image tokens: its ``projector`` tap is the image
states its cross-attention layers read, laid out by `Batch.state_cells` (class tokens and padding
tiles dropped); ``llm`` taps do not exist there (the image never enters the residual stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.sites import ImageStates, Residual, VisionBlock
from countlens.errors import InputError
from countlens.model.adapt import module_of
from countlens.model.arguments import require_vlm
from countlens.model.families import family_of
from countlens.model.geometry import Geometry
from countlens.model.layouts import token_cells
from countlens.model.vlm import check_samples
from countlens.validate import require_count, require_integer

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM, Batch

TAPS: tuple[str, ...] = ("vision", "projector", "llm")


def tap_site(vlm: VLM, kind: str, index: int | None) -> VisionBlock | Residual | ImageStates:
    """The site a tap reads: vision block ``index``, the image tokens entering layer 0 (a cross-attention
    model's image states), or the residual stream after decoder layer ``index``."""
    if not isinstance(kind, str) or kind not in TAPS:
        raise InputError(f"unknown tap {kind!r:.40}; use one of {TAPS}")
    if index is not None:
        require_integer(index, "the tap's index", low=0)

    def indexed(site: type, what: str):
        if index is None:
            raise InputError(f"the {kind!r} tap needs an index: the {what} to read")
        return site(index)

    makers = {
        "vision": lambda: indexed(VisionBlock, "vision block"),
        "projector": lambda: Residual(-1) if vlm.arch.spec.cross_attention is None else ImageStates(-1),
        "llm": lambda: indexed(Residual, "decoder layer"),
    }
    return makers[kind]()


def _cell_means(x: Tensor, cells: Tensor, rows: int, cols: int) -> Tensor:
    """Float[Tensor, "d rows cols"]: each cell the mean of the rows of ``x`` (Float[Tensor, "n d"]) that
    ``cells`` (Int[Tensor, "n 2"]) maps to it; rows at (-1, -1) are dropped, empty cells are 0."""
    keep = cells[:, 0] >= 0
    flat = cells[keep, 0] * cols + cells[keep, 1]
    total = torch.zeros(rows * cols, x.shape[-1]).index_add_(0, flat, x[keep.to(x.device)].float().cpu())
    count = torch.zeros(rows * cols, 1).index_add_(0, flat, torch.ones(len(flat), 1))
    return (total / count.clamp(min=1)).T.reshape(-1, rows, cols)


def _grid_map(acts: Tensor, positions: Sequence[Tensor], cells: Sequence[Tensor], batch: Batch) -> Tensor:
    """Float[Tensor, "batch d rows cols"] from per-position activations Float[Tensor, "batch seq d"]:
    each cell the mean of the positions mapped to it."""
    rows = max(g.token_grid[0] for g in batch.geometry)
    cols = max(g.token_grid[1] for g in batch.geometry)
    out = torch.zeros(len(batch), acts.shape[-1], rows, cols, dtype=torch.float32)
    for b, (pos, cell) in enumerate(zip(positions, cells)):
        out[b] = _cell_means(acts[b, pos.to(acts.device)], cell, rows, cols)
    return out


def _window_index(vlm: VLM, grid_thw: Tensor) -> Tensor:
    """The order of merge units inside a windowed tower's blocks, by its family's own rule."""
    visual = module_of(vlm.hf, vlm.arch.vision_encoder)
    return family_of(vlm.arch.spec).window_index(visual, grid_thw)


def _tiled_patch_map(x: Tensor, vlm: VLM, batch: Batch) -> Tensor:
    """Float[Tensor, "batch d rows cols"] on the base patch grid from every tile's patches
    Float[Tensor, "tiles patches d"] (all samples' tiles in order, a CLS token first where the tower has one)."""
    g = batch.geometry[0]
    rows, cols = g.patch_grid
    if x.shape[1] == rows * cols + 1:
        x = x[:, 1:]
    if x.shape[1] != rows * cols:
        raise InputError(f"vision block output has {x.shape[1]} tokens per tile; expected {rows}×{cols} patches")
    patches = Geometry(g.image_height, g.image_width, g.patch_size, dropped=g.dropped)
    out = torch.zeros(len(batch), x.shape[-1], rows, cols)
    start = 0
    for b in range(len(batch)):
        rows_t, cols_t = batch.tile_grids[b]
        n_tiles = rows_t * cols_t + (rows_t * cols_t > 1)  # and the thumbnail
        cells = token_cells(vlm.arch.spec.layout, patches, n_tiles * rows * cols, b, batch.tile_grids[b]).cells
        out[b] = _cell_means(x[start : start + n_tiles].reshape(-1, x.shape[-1]), cells, rows, cols)
        start += n_tiles
    return out


def _vision_grid_map(acts: Tensor, vlm: VLM, batch: Batch) -> Tensor:
    spec = vlm.arch.spec
    if spec.layout in ("tiles_thumbnail", "thumbnail_tiles"):
        return _tiled_patch_map(acts.float().cpu(), vlm, batch)
    if spec.layout != "grid":
        raise InputError(
            f"vision-block taps are not mapped for {vlm.arch.name} yet (any-resolution crops); "
            "use the 'projector' or 'llm' taps"
        )
    rows, cols = batch.geometry[0].patch_grid
    if any(g.patch_grid != (rows, cols) for g in batch.geometry):
        raise InputError("vision-block taps need one image size per batch")
    n = len(batch)
    if acts.dim() == 2:  # Qwen: all images' patches concatenated, each image in 2×2 merge blocks
        m = vlm.arch.merge_size
        x = acts.float().cpu()
        if spec.projector_order == "window":
            # Qwen2.5-VL's blocks hold the merge units window by window: put them back in order.
            unit = x.view(x.shape[0] // (m * m), m * m, -1)
            x = unit[torch.argsort(_window_index(vlm, batch.inputs["image_grid_thw"]).cpu())].reshape(x.shape)
        x = x.view(n, rows // m, cols // m, m, m, -1)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(n, -1, rows, cols)
    x = acts.float().cpu()
    if x.shape[1] == rows * cols + 1:  # CLIP: a CLS token first
        x = x[:, 1:]
    if x.shape[1] != rows * cols:
        raise InputError(f"vision block output has {x.shape[1]} tokens; expected {rows}×{cols} patches")
    return x.transpose(1, 2).reshape(n, -1, rows, cols)


@torch.no_grad()
def tap(
    vlm: VLM, samples: Sequence, kind: str, index: int | None = None, batch_size: int = 16
) -> Float[Tensor, "sample d rows cols"]:
    """The ``kind`` tap ("vision", "projector", "llm") of every sample, laid out on the image grid."""
    require_vlm(vlm, "tap")
    check_samples(samples, "tap")
    require_count(batch_size, "batch_size")
    site = tap_site(vlm, kind, index)
    if vlm.arch.spec.cross_attention is not None and not isinstance(site, ImageStates):
        raise InputError(
            f"{vlm.arch.name} reads its image through cross-attention: no image tokens in the residual stream "
            "and its vision blocks are not mapped yet; use the 'projector' tap (the image states)"
        )
    loc = site.location(vlm)
    out = []
    for _, batch in vlm.batches(samples, batch_size):
        with vlm.read(batch):
            envoy = vlm.module(loc.path)
            acts = (envoy.input if loc.io == "input" else envoy.output).save()
        acts = acts[0] if isinstance(acts, tuple) else acts
        if isinstance(site, VisionBlock):
            out.append(_vision_grid_map(acts, vlm, batch))
        elif isinstance(site, ImageStates):  # the states as a sequence: every one of them a "position"
            states = acts.reshape(len(batch), -1, acts.shape[-1])
            keys = [torch.arange(states.shape[1])] * len(batch)
            out.append(_grid_map(states, keys, batch.state_cells, batch))
        else:
            out.append(_grid_map(acts, batch.image_pos, batch.image_cell, batch))
    return torch.cat(out)
