"""Which objects does the model count? The object-effect figures of a discover run's ``objects`` stage.

Both read the stage's stored result (``results/objects.nc``: an `countlens.circuits.objects.effects`
result over (scene, object), with the run's own answers per scene and, for a few drawn scenes, their
images and object labels), never a model.

- `object_scenes`: the drawn scenes, answered right in the top row and wrong in the bottom row, each
  object outlined in a diverging colour by its effect (logits; red: its tokens carry the count, blue:
  the answer gains without them, grey dashed: it covers no token, so it was not measured). One scale,
  symmetric about 0, for every panel.
- `effect_by_offset`: every measured object's effect against its offset from the nearest ViT-patch
  cell centre (patches), coloured by placement class, objects of wrongly answered scenes marked ×.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from countlens.analysis.figures.canvas import DPI, finish, save
from countlens.analysis.overlays import outline_lines
from countlens.errors import InputError

#: The diverging colour map of the object outlines (red: positive effect, blue: negative).
CMAP = "RdBu_r"
#: Placement classes (`countlens.circuits.objects.effects.CLASSES`) in the figures' order, with colours.
PLACEMENTS: dict[str, str] = {"centred": "tab:green", "edge": "tab:orange", "intersection": "tab:purple"}
HIDDEN = "0.55"  # an object that covers no token: outlined in grey, dashed


def _check(ds: xr.Dataset, need: tuple[str, ...]) -> None:
    missing = [v for v in need if v not in ds]
    if missing:
        raise InputError(f"an objects result (results/objects.nc) holds {list(need)}; this one lacks {missing}")


def _scale(ds: xr.Dataset) -> float:
    """The largest |effect| over the drawn scenes' measured objects (1 when there is none)."""
    effect = ds["effect"].isel(scene=ds["drawn_scene"].values).values
    finite = np.abs(effect[np.isfinite(effect)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _panel(ax, ds: xr.Dataset, k: int, norm, cmap) -> None:
    """Drawn scene ``k``: its image, faded, each object outlined in its effect's colour."""
    from matplotlib.collections import LineCollection

    s = int(ds["drawn_scene"].values[k])
    h, w = int(ds["image_height"].values[k]), int(ds["image_width"].values[k])
    image = ds["image"].values[k, :h, :w].astype(float)
    labels = ds["labels"].values[k, :h, :w]
    ax.imshow((0.45 * image + 0.55 * 235).round().astype(np.uint8), interpolation="nearest")
    effect = ds["effect"].values[s]
    for i in range(int(ds["exists"].values[s].sum())):  # every object drawn (count may be fewer)
        mask = labels == i + 1
        if not mask.any():
            continue  # painted over by later objects, or outside the stored image
        lines = outline_lines(mask.astype(np.uint8))
        if np.isfinite(effect[i]):  # a dark rim under the colour: an effect near 0 (near white) stays visible
            ax.add_collection(LineCollection(lines, colors="0.15", linewidths=3.2))
            ax.add_collection(LineCollection(lines, colors=[cmap(norm(effect[i]))], linewidths=2.0))
        else:
            ax.add_collection(LineCollection(lines, colors=HIDDEN, linewidths=1.2, linestyles="dashed"))
    ax.set_xlim(-0.5, w - 0.5)
    ax.set_ylim(h - 0.5, -0.5)
    ax.set_xticks([])
    ax.set_yticks([])
    answer = f"answered {ds['pred'].values[s]}" if "pred" in ds else ""
    ax.set_title(f"{ds['case'].values[s]}: {int(ds['exists'].values[s].sum())} objects\n{answer}", fontsize=7)


def object_scenes(ds: xr.Dataset, title: str | None = None) -> Figure:
    """The drawn scenes of an objects result: answered right (top row) beside answered wrong (bottom
    row), each object outlined in the colour of its effect (module docstring)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    _check(ds, ("effect", "exists", "count", "case", "answered_right", "drawn_scene", "image", "labels"))
    right = ds["answered_right"].values[ds["drawn_scene"].values].astype(bool)
    rows = [np.flatnonzero(right), np.flatnonzero(~right)]
    ncols = max(1, max(len(r) for r in rows))
    fig = Figure(figsize=(1.75 * ncols + 1.4, 4.3), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, ncols, squeeze=False)
    vmax = _scale(ds)
    norm, cmap = Normalize(-vmax, vmax), colormaps[CMAP]
    for r, (drawn, label) in enumerate(zip(rows, ("answered right", "answered wrong"))):
        for c in range(ncols):
            ax = axes[r, c]
            if c < len(drawn):
                _panel(ax, ds, int(drawn[c]), norm, cmap)
            else:
                ax.set_axis_off()
                if c == 0:  # no scene of this outcome among the measured ones
                    ax.text(0.5, 0.5, f"no scene {label}", ha="center", va="center", fontsize=8, transform=ax.transAxes)
        axes[r, 0].set_ylabel(label, fontsize=8)
    bar = fig.colorbar(ScalarMappable(norm, cmap), ax=axes.ravel().tolist(), fraction=0.04, pad=0.02)
    bar.set_label("object effect (logits)", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    return finish(fig, title or "Each object's effect on the count answer, right answers above wrong ones", 10)


def plot_object_scenes(ds: xr.Dataset, path: str | Path, title: str | None = None) -> Path:
    """`object_scenes`, saved as a PNG at ``path``."""
    return save(object_scenes(ds, title), path)


def effect_by_offset(ds: xr.Dataset, title: str | None = None) -> Figure:
    """Every measured object's effect (logits) against its offset from the nearest cell centre
    (patches), coloured by placement class; objects of scenes answered wrong marked ×."""
    _check(ds, ("effect", "offset", "placement", "exists", "answered_right"))
    effect, offset = ds["effect"].values, ds["offset"].values
    live = ds["exists"].values.astype(bool) & np.isfinite(effect) & np.isfinite(offset)
    wrong = ~ds["answered_right"].values.astype(bool)[:, None] & live
    fig = Figure(figsize=(6.8, 3.6), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for placement, colour in PLACEMENTS.items():
        sel = live & (ds["placement"].values == placement)
        for marks, marker, size in ((sel & ~wrong, "o", 14), (sel & wrong, "x", 22)):
            if marks.any():
                label = f"{placement} ({int(sel.sum())})" if marker == "o" or not (sel & ~wrong).any() else None
                ax.scatter(offset[marks], effect[marks], s=size, marker=marker, color=colour, alpha=0.6, label=label)
    if wrong.any():
        ax.scatter([], [], marker="x", color="black", s=22, label="in a scene answered wrong")
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_xlabel("offset from the nearest cell centre (patches)", fontsize=8)
    ax.set_ylabel("object effect (logits)", fontsize=8)
    ax.tick_params(labelsize=7)
    if live.any():
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the points, never on them
    else:
        ax.text(0.5, 0.5, "no object measured", ha="center", va="center", transform=ax.transAxes)
    return finish(fig, title or "Object effect against the object's offset from the nearest cell centre", 10)


def plot_effect_by_offset(ds: xr.Dataset, path: str | Path, title: str | None = None) -> Path:
    """`effect_by_offset`, saved as a PNG at ``path``."""
    return save(effect_by_offset(ds, title), path)
