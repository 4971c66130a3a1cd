"""Attention drawn on the image: where a head, or a layer's heads on average, look.

Three steps, each its own function:

1. `token_map`: per-token weights (the last position's attention on each image token) onto the base
   token grid through each token's cell (`countlens.model.layouts`). A token of a finer view (LLaVA's crops,
   InternVL's tiles) already carries the base cell its centre falls in, so it adds into that cell;
   ``view=`` keeps one view's tokens (0 the base grid or thumbnail, 1 the finer one), None all of them.
   The mapping is `countlens.analysis.attention_metrics.grid_attention`, the one the attention
   metrics measure with.
2. `upsample` / `blend`: each pixel takes its cell's value (nearest: a token's cell is what the model
   resolves, so the map is drawn blocky rather than smoothed into detail it does not have), coloured
   by a colour map scaled to the map's peak, over the image. A **signed** map (any value below 0: an
   input × gradient, an effect) is drawn on a diverging scale centred at 0, from −m to m with m its
   largest magnitude (`DIVERGING`: blue below 0, red above), so a negative value is never drawn as 0.
3. `overlay` draws that on matplotlib axes with the objects' outlines and a colour scale named after
   what is drawn (``label=``; a DataArray's ``long_name`` or name; "attention" for a bare array);
   `cell_map` turns any per-token DataArray that carries its tokens' cells (a
   `countlens.circuits.engine.site_gradients.gradients` variable of one sample) into such a map;
   `head_overlays_png` renders one PNG per stored sample for one head (or a layer's mean) as pixels
   (the image's, × ``scale``, outlines from `outline_pixels`); `plot_attention_on_image` draws the
   report's grid of samples × heads.

They read an `countlens.analysis.attention_maps.attention_maps` result (``results/attention_maps.nc``
of a discover run), never a model::

    from countlens import results
    from countlens.analysis import overlays

    ds = results.load("runs/demo/results/attention_maps.nc")
    for caption, png in overlays.head_overlays_png(ds, layer=0, head=0):   # head=None: the layer's mean
        ...
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from countlens.analysis.attention_metrics import grid_attention
from countlens.errors import InputError
from countlens.labels import head_label
from countlens.model.layouts import TokenCells
from countlens.validate import require_bool

ALPHA = 0.55  # the colour map's weight over the image: objects stay visible under the strongest cell
CMAP = "inferno"
DIVERGING = "RdBu_r"  # signed maps: white at 0, so a cell of no weight leaves the image as it is
OUTLINE = "cyan"  # far from every colour of the inferno map, and from the scenes' red, green and blue


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def token_map(weights, cells, grid_shape: tuple[int, int], view: int | None = None, views=None) -> np.ndarray:
    """Float[ndarray, "rows cols"]: ``weights`` (one per image token) summed into the base grid of
    ``grid_shape`` at each token's cell. ``cells``: a `countlens.model.layouts.TokenCells` (cells and views)
    or an (n, 2) array of (row, col), then with ``views`` (n,) when ``view`` is given. Tokens at
    (-1, -1) (no cell: newlines, padding) are dropped."""
    if isinstance(cells, TokenCells):
        cells, views = cells.cells, cells.views
    w = torch.as_tensor(np.asarray(weights, np.float64))
    c = torch.as_tensor(np.asarray(cells, np.int64)).reshape(-1, 2)
    if len(w) != len(c):
        raise InputError(f"{len(w)} weights for {len(c)} token cells; give one weight per image token")
    rows, cols = int(grid_shape[0]), int(grid_shape[1])
    if len(c) and ((c[:, 0] >= rows).any() or (c[:, 1] >= cols).any()):
        raise InputError(f"token cells reach beyond the {rows}x{cols} grid; give the sample's own base grid")
    keep = torch.ones(len(c), dtype=torch.bool)
    if view is not None:
        if views is None:
            raise InputError(f"view={view} needs each token's view: pass TokenCells or views=")
        keep = torch.as_tensor(np.asarray(views)) == view
        if not keep.any():
            raise InputError(f"no token is in view {view}; the views present are {sorted(set(np.asarray(views)))}")
    return grid_attention(w[keep], c[keep], (rows, cols)).numpy()


def upsample(grid_map: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Float[ndarray, "height width"]: each pixel of an image of ``size`` (height, width) takes the
    value of the grid cell it lies in (cells split the image evenly)."""
    rows, cols = grid_map.shape
    h, w = size
    return grid_map[(np.arange(h) * rows) // h][:, (np.arange(w) * cols) // w]


def _peak(grid_map: np.ndarray) -> float:
    finite = grid_map[np.isfinite(grid_map)]
    return float(finite.max()) if finite.size else float("nan")


def is_signed(grid_map) -> bool:
    """Whether ``grid_map`` has a value below 0 (then it is drawn on the diverging scale)."""
    values = np.asarray(grid_map, np.float64)
    return bool((values[np.isfinite(values)] < 0).any())


def limits(grid_map, vmax: float | None = None, signed: bool | None = None) -> tuple[float, float]:
    """The colour scale's (low, high) for ``grid_map``: (0, ``vmax`` or the map's peak) for an unsigned
    map; (−m, m) for a signed one (``signed``: None decides by `is_signed`), m ``vmax`` or the map's
    largest magnitude. NaN where the map has no finite value."""
    values = np.asarray(grid_map, np.float64)
    if not (is_signed(values) if signed is None else signed):
        return 0.0, _peak(values) if vmax is None else float(vmax)
    m = _peak(np.abs(values)) if vmax is None else abs(float(vmax))
    return -m, m


def blend(
    image: np.ndarray,
    grid_map: np.ndarray,
    vmax: float | None = None,
    alpha: float = ALPHA,
    cmap: str | None = None,
    signed: bool | None = None,
) -> np.ndarray:
    """Uint8[ndarray, "height width 3"]: ``grid_map`` upsampled to ``image`` (uint8 RGB), coloured by
    ``cmap`` over `limits` — from 0 to ``vmax`` (default: the map's peak) in `CMAP`, or for a signed map
    from −m to m in `DIVERGING` — and laid over the image with weight ``alpha``. A map without values
    (NaN: no probabilities there) leaves the image greyed."""
    from matplotlib import colormaps

    grid_map = np.asarray(grid_map, np.float64)
    base = np.asarray(image, np.float64)[..., :3]
    signed = is_signed(grid_map) if signed is None else signed
    _, high = limits(grid_map, vmax, signed)
    if not np.isfinite(high):
        return (0.5 * base + 0.5 * base.mean(-1, keepdims=True)).round().astype(np.uint8)
    cmap = cmap or (DIVERGING if signed else CMAP)
    up = upsample(np.nan_to_num(grid_map), base.shape[:2])
    scaled = np.clip(0.5 + 0.5 * up / (high or 1.0) if signed else up / (high or 1.0), 0.0, 1.0)
    colour = colormaps[cmap](scaled)[..., :3] * 255.0
    return ((1 - alpha) * base + alpha * colour).round().astype(np.uint8)


def outline_lines(objects: np.ndarray) -> list[np.ndarray]:
    """Each object's outline as (x, y) polylines in the image's pixel coordinates, from a label image
    (0 background, i > 0 the i-th object): the 0.5 contour of its mask, traced inside its bounding box
    (once per image, however many panels draw it)."""
    from contourpy import contour_generator

    lines = []
    for label in np.unique(objects):
        if not label:
            continue
        ys, xs = np.nonzero(objects == label)
        y0, x0 = max(0, ys.min() - 1), max(0, xs.min() - 1)  # a margin, so that a closed outline closes
        crop = (objects[y0 : ys.max() + 2, x0 : xs.max() + 2] == label).astype(float)
        lines += [line + (x0, y0) for line in contour_generator(z=crop).lines(0.5)]
    return lines


def outline(ax, objects, color: str = OUTLINE, width: float = 0.9) -> None:
    """The objects' outlines on ``ax``: a label image (see `outline_lines`) or its `outline_lines`."""
    from matplotlib.collections import LineCollection

    lines = outline_lines(objects) if isinstance(objects, np.ndarray) else objects
    ax.add_collection(LineCollection(lines, colors=color, linewidths=width))


def overlay(
    image: np.ndarray,
    grid_map: np.ndarray | xr.DataArray,
    outlines: np.ndarray | list[np.ndarray] | None = None,
    ax=None,
    vmax: float | None = None,
    title: str | None = None,
    colorbar: bool = True,
    label: str | None = None,
    signed: bool | None = None,
):
    """Draw ``grid_map`` (rows, cols; an array or a DataArray such as `cell_map`'s) over ``image`` (uint8
    RGB) on ``ax`` (a new figure's when None), with the objects of ``outlines`` (a label image of the
    image's size, or its `outline_lines`) and a colour scale: from 0 to ``vmax`` (default: the map's
    peak), or for a signed map (any value < 0, or a DataArray whose ``attrs["signed"]`` says so, as
    `gradients`' do; ``signed`` forces either) a diverging one from −m to m (m: ``vmax`` or the largest
    magnitude). The colour bar is named ``label``: by default the DataArray's ``long_name``, else its
    name, else "attention". Returns the axes."""
    if signed is not None:
        signed = require_bool(signed, "overlay's signed")
    elif isinstance(grid_map, xr.DataArray) and "signed" in grid_map.attrs:
        signed = bool(grid_map.attrs["signed"])  # a gradient is signed even where one sample's map is not
    if label is None:
        label = _name_of(grid_map)
    elif not isinstance(label, str):
        raise InputError(f"label= names what the colour bar shows, a string such as 'input × gradient'; got {label!r}")
    grid_map = np.asarray(grid_map, np.float64)
    if grid_map.ndim != 2:
        raise InputError(
            f"overlay draws a (rows, cols) map; got shape {grid_map.shape}: map per-token values onto the "
            "grid first (token_map, or cell_map for a DataArray of one sample)"
        )
    signed = is_signed(grid_map) if signed is None else signed
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(4.0, 3.4), dpi=110)
    ax.imshow(blend(image, grid_map, vmax, signed=signed), interpolation="nearest")
    if outlines is not None:
        outline(ax, outlines)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=7)
    _, high = limits(grid_map, vmax, signed)
    if colorbar and np.isfinite(high):
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        m = high or 1.0
        norm = Normalize(-m, m) if signed else Normalize(0, m)
        bar = ax.figure.colorbar(ScalarMappable(norm, DIVERGING if signed else CMAP), ax=ax, fraction=0.046, pad=0.03)
        bar.ax.tick_params(labelsize=6)
        bar.set_label(label, fontsize=7)
    return ax


def _name_of(grid_map) -> str:
    """What a map shows: a DataArray's ``long_name`` or name; "attention" for a bare array."""
    if isinstance(grid_map, xr.DataArray):
        name = grid_map.attrs.get("long_name") or grid_map.name
        if name:
            return str(name)
    return "attention"


def cell_map(values: xr.DataArray) -> xr.DataArray:
    """One sample's per-token ``values`` (over ``position``, with the coords ``cell_row``, ``cell_col``,
    ``grid_rows``, ``grid_cols``: a `countlens.circuits.engine.site_gradients.gradients` variable of one
    site and sample) summed into its image-token grid (`token_map`): a (row, col) DataArray named and
    attributed as ``values``, for `overlay`. Tokens of no cell (text, a row-end newline) and NaN
    (padding beyond the sample's positions) are left out; a cell of no token is 0."""
    need = ("cell_row", "cell_col", "grid_rows", "grid_cols")
    one = isinstance(values, xr.DataArray) and values.dims == ("position",)
    if not one or any(c not in values.coords for c in need):
        dims = values.dims if isinstance(values, xr.DataArray) else type(values).__name__
        raise InputError(
            f"cell_map takes one sample's values over position with the coords {', '.join(need)} (got {dims}): "
            "e.g. gradients(...).input_x_gradient.sel(site='L-1.resid').isel(sample=0)"
        )
    v = values.values.astype(np.float64)
    cells = np.stack([values.cell_row.values, values.cell_col.values], -1)
    keep = np.isfinite(v) & (cells >= 0).all(-1)
    grid = (int(values.grid_rows), int(values.grid_cols))
    drawn = token_map(v[keep], cells[keep], grid) if keep.any() else np.zeros(grid)
    return xr.DataArray(drawn, dims=("row", "col"), name=values.name, attrs=dict(values.attrs))


# ----------------------------------------------------------------------------- stored results


def sample_map(ds: xr.Dataset, sample: int, layer: int, head: int | None = None, view: int | None = None) -> np.ndarray:
    """The base-grid map of stored sample ``sample`` (its position in ``ds``) for head (layer, head), or
    the layer's head mean with ``head=None``."""
    s = ds.isel(sample=sample)
    if head is None:
        if layer not in ds.layer.values:
            raise InputError(f"layer {layer} is not stored; the layers are 0 … {int(ds.layer.max())}")
        weights = s.layer_mean.sel(layer=layer).values
    else:
        hit = np.flatnonzero((ds.site_layer.values == layer) & (ds.site_head.values == head))
        if not len(hit):
            stored = [head_label((la, h)) for la, h in zip(ds.site_layer.values[:8], ds.site_head.values[:8])]
            raise InputError(
                f"head {head_label((layer, head))} is not stored ({ds.attrs.get('heads', '')}; e.g. "
                f"{', '.join(stored)}); draw a stored head, or the layer's mean with head=None"
            )
        weights = s.attention.isel(site=int(hit[0])).values
    n = int(s.n_tokens)
    cells = np.stack([s.cell_row.values[:n], s.cell_col.values[:n]], -1)
    return token_map(weights[:n], cells, (int(s.grid_rows), int(s.grid_cols)), view, s.view.values[:n])


def _picture(ds: xr.Dataset, sample: int) -> tuple[np.ndarray, np.ndarray]:
    s = ds.isel(sample=sample)
    h, w = int(s.image_height), int(s.image_width)
    return s.image.values[:h, :w], s.objects.values[:h, :w]


def _describe(ds: xr.Dataset, sample: int) -> str:
    """What is known of a stored sample: its case, count, answer and whether it was right."""
    s = ds.isel(sample=sample)
    parts = [f"sample {int(s['index']) if 'index' in ds else sample}"]
    if "case" in ds:
        parts.append(f"case {s['case'].item()}")
    if "gold" in ds:
        parts.append(f"gold {s['gold'].item()}")
    if "pred" in ds:
        parts.append(f"answered {s['pred'].item()}")
    if "correct" in ds:
        parts.append("right" if bool(s["correct"]) else "wrong")
    return ", ".join(parts)


def _what(layer: int, head: int | None) -> str:
    return f"L{layer} mean of heads" if head is None else head_label((layer, head))


def outline_pixels(objects: np.ndarray, scale: int = 1) -> np.ndarray:
    """Bool[ndarray, "height*scale width*scale"]: the objects' outlines as pixels of the image scaled
    ``scale`` × (nearest): each pixel of an object with a 4-neighbour outside it (another label, the
    background or the image's edge) — a one-pixel line just inside the object, so that it hides none
    of the attention around it."""
    up = np.repeat(np.repeat(np.asarray(objects), scale, 0), scale, 1)
    padded = np.pad(up, 1)  # the image's edge counts as outside
    inner = padded[1:-1, 1:-1]
    neighbours = (padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:])
    return (inner > 0) & np.logical_or.reduce([n != inner for n in neighbours])


def _png(rgb: np.ndarray) -> bytes:
    """PNG bytes of a uint8 RGB array, with no metadata (the same bytes on every render)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def head_overlays_png(
    ds: xr.Dataset, layer: int, head: int | None = None, view: int | None = None, scale: int = 2
) -> list[tuple[str, bytes]]:
    """(caption, PNG bytes) per stored sample: head (layer, head)'s attention (``head=None``: the
    layer's mean over heads) over the sample's image with its objects' outlines (`outline_pixels`),
    ``scale`` × the stored image's pixels, no axes (the caption carries the peak, the share on the
    whole image and the sample's answer). Drawn as pixels, not through matplotlib: report.html holds
    one per head and sample, and each cell is a block of pixels anyway (`upsample`)."""
    from matplotlib.colors import to_rgb

    line = (np.array(to_rgb(OUTLINE)) * 255).round().astype(np.uint8)
    out = []
    for i in range(ds.sizes["sample"]):
        grid_map = sample_map(ds, i, layer, head, view)
        image, objects = _picture(ds, i)
        rgb = np.repeat(np.repeat(blend(image, grid_map), scale, 0), scale, 1)
        rgb[outline_pixels(objects, scale)] = line
        caption = (
            f"{_what(layer, head)}{'' if view is None else f', view {view}'} on {_describe(ds, i)}: "
            f"peak {_peak(grid_map):.3f} on one cell, {np.nansum(grid_map):.3f} on the image"
        )
        out.append((caption, _png(rgb)))
    return out


def plot_attention_on_image(
    ds: xr.Dataset,
    heads: Sequence[tuple[int, int]],
    path: str | Path,
    layers: Sequence[int] = (),
    view: int | None = None,
) -> Path:
    """A grid: one row per stored sample (right answers first), one column per head of ``heads`` and
    per layer mean of ``layers``; each panel scaled to its own peak (written in its title)."""
    columns = [(int(la), int(h)) for la, h in heads] + [(int(la), None) for la in layers]
    if not columns:
        raise InputError("nothing to draw: give at least one head or one layer")
    order = list(range(ds.sizes["sample"]))
    if "correct" in ds:
        order.sort(key=lambda i: not bool(ds.correct.values[i]))
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(order), len(columns), figsize=(1.45 * len(columns) + 0.9, 1.5 * len(order) + 0.4), dpi=100, squeeze=False
    )
    for r, i in enumerate(order):
        image, objects = _picture(ds, i)
        lines = outline_lines(objects)
        for c, (layer, head) in enumerate(columns):
            grid_map = sample_map(ds, i, layer, head, view)
            overlay(image, grid_map, lines, ax=axes[r, c], colorbar=False)
            axes[r, c].set_title(f"{_what(layer, head)}\npeak {_peak(grid_map):.2g}", fontsize=6)
        label = _describe(ds, i).replace(", ", "\n")
        axes[r, 0].text(-0.08, 0.5, label, transform=axes[r, 0].transAxes, ha="right", va="center", fontsize=6)
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    fig.subplots_adjust(left=0.13, right=0.9, top=0.95, bottom=0.02, wspace=0.08, hspace=0.45)
    bar = fig.colorbar(ScalarMappable(Normalize(0, 1), CMAP), cax=fig.add_axes((0.925, 0.35, 0.015, 0.3)))
    bar.set_label("attention / the panel's peak", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
