"""What every figure shares: its canvas, a title that fits, thinned ticks and readable cell labels.

Figures are made as ``matplotlib.figure.Figure`` with an Agg canvas, not through pyplot: no global
figure registry to leak into, nothing to close, no display needed. ``layout="constrained"`` makes
room for colour bars, legends and the title; `finish` then wraps the title (``suptitle``, centred on
the image) until its drawn extent lies inside the figure, so a long title on a narrow map (the
organism's 4-head attention map) is never cut off at an edge.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 110
#: At most this many tick labels along an axis; a longer axis labels every ⌈n / MAX_TICKS⌉-th entry.
MAX_TICKS = 12


def new_figure(width: float, height: float, ncols: int = 1, **subplots) -> tuple[Figure, list[Axes]]:
    """A figure of ``width`` × ``height`` inches with ``ncols`` axes side by side (constrained layout)."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # gives the figure a renderer: finish() measures the title with it
    axes = fig.subplots(1, ncols, squeeze=False, **subplots)[0]
    return fig, list(axes)


def finish(fig: Figure, title: str, fontsize: float = 11.0) -> Figure:
    """Give ``fig`` its title, wrapped onto more lines (then shrunk) until it fits inside the figure."""
    limit = fig.bbox.width
    chars = max(len(title), 1)
    renderer = fig.canvas.get_renderer()
    while True:
        text = fig.suptitle("\n".join(textwrap.wrap(title, chars)) or title, fontsize=fontsize)
        # The title's extent from its own layout: it sits centred at the top whatever the constrained
        # layout does to the axes, so no draw of the whole figure is needed (savefig draws it once).
        box = text.get_window_extent(renderer)
        if box.x0 >= 0 and box.x1 <= limit:
            return fig
        if chars > 12:  # rewrap to the share of the width that fits, with a margin for proportional glyphs
            chars = max(12, math.floor(chars * limit / box.width * 0.92))
        elif fontsize > 6:
            fontsize -= 1
        else:  # a single word wider than the figure at 6 pt: let it be, a figure is still written
            return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder made if need be)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def thin_ticks(ax: Axes, axis: str, labels) -> None:
    """Label ``axis`` ("x" or "y") of an image with ``labels`` (one per cell), every n-th one when there
    are more than `MAX_TICKS`, so that 40 heads read as 0, 4, 8, … instead of an overprinted row."""
    labels = [str(v) for v in labels]
    step = max(1, math.ceil(len(labels) / MAX_TICKS))
    where = list(range(0, len(labels), step))
    setter = ax.set_xticks if axis == "x" else ax.set_yticks
    setter(where, [labels[i] for i in where])


def cell_text_colour(rgba) -> str:
    """Black on a light cell, white on a dark one (relative luminance of the cell's colour)."""
    r, g, b = rgba[:3]
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "white"


def label_cells(ax: Axes, image, values: np.ndarray, fmt: str = ".2f", fontsize: float = 7.0) -> None:
    """Write each finite value of ``values`` (rows × columns) in its cell of ``image`` (an AxesImage)."""
    for (i, j), v in np.ndenumerate(values):
        if np.isfinite(v):
            colour = cell_text_colour(image.cmap(image.norm(v)))
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=fontsize, color=colour)
