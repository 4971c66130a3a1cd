"""Layer × head maps and small labelled matrices.

A measurement per head (`heatmap`) is an image with a colour bar. Its numbers are also written in the
cells only while the grid is small, at most `ANNOTATE_MAX` layers and `ANNOTATE_MAX` heads (12 × 12:
at the 0.55 × 0.42 inch cells used there a two-decimal number in 7 pt still fits its cell); a larger
model (28 layers × 28 heads is 784 numbers) is read from the colours and the colour bar, its tick
labels thinned (`canvas.thin_ticks`) and the figure capped at `MAX_SIZE` inches. The head classes
(`head_classes`) are categorical: one colour per class of `countlens.analysis.heads.CLASSES`, a legend
with each class's count. `matrix` is a square table of values in [0, 1] with every cell labelled
(the tasks' Jaccard overlaps).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from countlens.analysis.figures.canvas import finish, label_cells, new_figure, save, thin_ticks
from countlens.errors import InputError

#: Cell numbers are written while the grid has at most this many layers and this many heads.
ANNOTATE_MAX = 12
#: The largest figure a grid gets, in inches (width, height).
MAX_SIZE = (11.0, 9.0)
#: One colour per head class, in the order of `countlens.analysis.heads.CLASSES` (tab10's, "other" grey).
CLASS_COLOURS: dict[str, str] = {
    "visual grounding": "tab:blue",
    "cross-modal routing": "tab:orange",
    "counting aggregation": "tab:green",
    "awareness": "tab:purple",
    "other": "lightgrey",
}


def _grid_size(n_layers: int, n_heads: int, annotated: bool) -> tuple[float, float]:
    """Inches for a layer × head grid: roomy cells while they carry numbers, smaller ones after."""
    if annotated:
        width, height = 1.8 + 0.55 * n_heads, 1.3 + 0.42 * n_layers
    else:
        width, height = 2.2 + 0.22 * n_heads, 1.4 + 0.2 * n_layers
    return min(max(width, 4.6), MAX_SIZE[0]), min(max(height, 3.2), MAX_SIZE[1])


def heatmap(da: xr.DataArray, title: str, cmap: str = "viridis", center: bool = False) -> Figure:
    """A (layer, head) measurement as an image with a colour bar; numbers in the cells of a small grid
    (`ANNOTATE_MAX`). ``center``: a diverging map symmetric about 0. NaN cells are light grey."""
    da = da.transpose("layer", "head")
    n_layers, n_heads = da.sizes["layer"], da.sizes["head"]
    annotated = n_layers <= ANNOTATE_MAX and n_heads <= ANNOTATE_MAX
    fig, (ax,) = new_figure(*_grid_size(n_layers, n_heads, annotated))
    values = da.values.astype(float)
    finite = values[np.isfinite(values)]
    vmax = float(np.abs(finite).max()) if finite.size else 1.0
    colours = matplotlib.colormaps["RdBu_r" if center else cmap].with_extremes(bad="lightgrey")
    image = ax.imshow(
        values,
        cmap=colours,
        vmin=-(vmax or 1.0) if center else None,
        vmax=(vmax or 1.0) if center else None,
        aspect="auto",
        interpolation="nearest",
    )
    if annotated:
        label_cells(ax, image, values)
    ax.set(xlabel="head", ylabel="layer")
    thin_ticks(ax, "x", da["head"].values)
    thin_ticks(ax, "y", da["layer"].values)
    fig.colorbar(image, ax=ax, shrink=0.9)
    return finish(fig, title)


def plot_heatmap(da: xr.DataArray, path: str | Path, title: str, cmap: str = "viridis", center: bool = False) -> Path:
    """`heatmap`, saved as a PNG at ``path``."""
    return save(heatmap(da, title, cmap, center), path)


def class_codes(table: pd.DataFrame, layers, heads) -> np.ndarray:
    """Float[ndarray, "layer head"]: each head's class as its index in `CLASS_COLOURS`, NaN for a head
    the table lacks."""
    order = list(CLASS_COLOURS)
    unknown = sorted(set(table["class"]) - set(order), key=str)
    if unknown:
        raise InputError(
            f"the head table has classes {unknown} that have no colour; the classes are {order} "
            "(rebuild the table with `countlens classify --run RUN`)"
        )
    codes = np.full((len(layers), len(heads)), np.nan)
    row = {int(v): i for i, v in enumerate(layers)}
    col = {int(v): j for j, v in enumerate(heads)}
    for layer, head, name in table[["layer", "head", "class"]].itertuples(index=False):
        codes[row[int(layer)], col[int(head)]] = order.index(name)
    return codes


def head_classes(table: pd.DataFrame, layers, heads, title: str = "Head classes") -> Figure:
    """The head table's ``class`` on the layer × head grid, one colour per class, a legend with counts;
    ``layers``/``heads``: the grid's coordinates (the model's, so heads the table lacks stay blank)."""
    codes = class_codes(table, layers, heads)
    annotated = len(layers) <= ANNOTATE_MAX and len(heads) <= ANNOTATE_MAX
    width, height = _grid_size(len(layers), len(heads), annotated)
    fig, (ax,) = new_figure(width + 1.8, height)  # the legend sits to the right
    names = list(CLASS_COLOURS)
    colours = ListedColormap(list(CLASS_COLOURS.values())).with_extremes(bad="white")
    norm = BoundaryNorm(np.arange(len(names) + 1) - 0.5, len(names))
    ax.imshow(codes, cmap=colours, norm=norm, aspect="auto", interpolation="nearest")
    ax.set(xlabel="head", ylabel="layer")
    thin_ticks(ax, "x", heads)
    thin_ticks(ax, "y", layers)
    counts = table["class"].value_counts()
    handles = [
        Patch(facecolor=CLASS_COLOURS[name], edgecolor="black", linewidth=0.4, label=f"{name} ({counts[name]})")
        for name in names
        if name in counts
    ]
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    return finish(fig, title)


def plot_head_classes(table: pd.DataFrame, layers, heads, path: str | Path, title: str = "Head classes") -> Path:
    """`head_classes`, saved as a PNG at ``path``."""
    return save(head_classes(table, layers, heads, title), path)


def matrix(da: xr.DataArray, title: str, cmap: str = "Blues") -> Figure:
    """A square (row, column) DataArray of values in [0, 1], every cell labelled with its value."""
    rows, cols = da.dims
    n = max(da.sizes[rows], da.sizes[cols])
    fig, (ax,) = new_figure(max(4.2, 1.8 + 0.8 * n), max(3.4, 1.4 + 0.7 * n))
    image = ax.imshow(da.values.astype(float), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
    label_cells(ax, image, da.values.astype(float), fontsize=9)
    thin_ticks(ax, "x", da[cols].values)
    thin_ticks(ax, "y", da[rows].values)
    fig.colorbar(image, ax=ax, shrink=0.9)
    return finish(fig, title)


def plot_matrix(da: xr.DataArray, path: str | Path, title: str, cmap: str = "Blues") -> Path:
    """`matrix`, saved as a PNG at ``path``."""
    return save(matrix(da, title, cmap), path)
