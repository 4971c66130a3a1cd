"""Several models on one relative-depth axis (`countlens.analysis.depth`): `countlens compare`'s figures.

- `handoff`: every model's VAP effect of the image tokens (solid) and of the last token (dashed) over
  relative depth, one colour per model, with the 0.5 line the hand-off is read at.
- `depth_classes`: the head classes per relative-depth bin, one panel per model, bars stacked by class
  in the colours of the report's head-class map (`countlens.analysis.figures.grids.CLASS_COLOURS`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from countlens.analysis.figures.canvas import finish, new_figure, save
from countlens.analysis.figures.grids import CLASS_COLOURS


def handoff(curves: pd.DataFrame, level: float = 0.5) -> Figure:
    """``curves``: columns model, depth, image, last (`countlens.analysis.compare_tables.vap_curves`)."""
    fig, (ax,) = new_figure(6.8, 4.0)
    for i, (model, c) in enumerate(curves.groupby("model", sort=False)):
        colour = f"C{i % 10}"
        ax.plot(c["depth"], c["image"], marker="o", ms=3, color=colour, label=f"{model}: image tokens")
        ax.plot(c["depth"], c["last"], marker="s", ms=3, ls="--", color=colour, label=f"{model}: last token")
    ax.axhline(level, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="relative depth (layer / (layers − 1))", ylabel="VAP effect", xlim=(-0.02, 1.02), ylim=(-0.05, 1.05))
    ax.legend(fontsize=7, ncol=2)
    return finish(fig, "Where the count passes from the image tokens to the last token")


def plot_handoff(curves: pd.DataFrame, path: str | Path) -> Path:
    """`handoff`, saved as a PNG at ``path``."""
    return save(handoff(curves), path)


def depth_classes(table: pd.DataFrame) -> Figure:
    """``table``: one row per (model, depth bin), a column of counts per class
    (`countlens.analysis.compare_tables.class_table`)."""
    models = list(dict.fromkeys(table["model"]))
    fig, axes = new_figure(2.6 * len(models) + 1.6, 3.6, ncols=len(models), sharey=True)
    classes = [c for c in CLASS_COLOURS if c in table.columns]
    for ax, model in zip(axes, models):
        part = table[table["model"] == model]
        x = np.arange(len(part))
        bottom = np.zeros(len(part))
        for name in classes:
            values = part[name].to_numpy(float)
            ax.bar(x, values, bottom=bottom, color=CLASS_COLOURS[name], edgecolor="black", lw=0.3, label=name)
            bottom += values
        ax.set_xticks(x, part["depth"], rotation=45, fontsize=7)
        ax.set(title=model, xlabel="relative depth")
    axes[0].set_ylabel("heads")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return finish(fig, "Head classes by relative depth")


def plot_depth_classes(table: pd.DataFrame, path: str | Path) -> Path:
    """`depth_classes`, saved as a PNG at ``path``."""
    return save(depth_classes(table), path)
