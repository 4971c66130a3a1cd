"""Layers and heads on relative depth, so that models of different depths can be read side by side.

A model of L decoder layers puts layer ℓ (0 … L − 1) at relative depth ``ℓ / (L − 1)`` ∈ [0, 1] (the
head table's ``depth`` column, `countlens.analysis.heads`): the first layer at 0, the last at 1. A
one-layer model has its only layer at 0. Visual activation patching also patches the embeddings
(layer −1, the input of layer 0); they are put at depth 0 too, with layer 0, since no layer lies
before it.

The hand-off of the count from the image tokens to the last token (Counting Circuits' reading of VAP,
`handoff`) is read on this axis by linear interpolation between consecutive points of a curve (the
embeddings first, then the layers in order):

- **image-token effect falls below 0.5** (`falls_below`): with j the *last* point whose effect is
  ≥ 0.5 and j + 1 the next one, the depth d_j + (f_j − 0.5) / (f_j − f_{j+1}) · (d_{j+1} − d_j)
  where the segment between them crosses 0.5. NaN when no point reaches 0.5 (image tokens never carry
  half the effect) or when the last layer still does (it never falls below). A crossing between the
  embeddings and layer 0 is at depth 0 (both sit there).
- **last-token effect rises above 0.5** (`rises_above`): with j the *first* point whose effect is
  ≥ 0.5, the depth d_{j−1} + (0.5 − f_{j−1}) / (f_j − f_{j−1}) · (d_j − d_{j−1}) where the segment
  from the point before crosses 0.5; d_j itself when j is the first point; NaN when no point reaches 0.5.

These are `countlens.pipeline.stages.patching.transition`'s layers (last layer where image tokens
carry half, first where the last token does), read between layers rather than at them.

Heads are binned by depth into ``n_bins`` equal bins (`depth_bin`): bin b holds depths in
[b / n, (b + 1) / n), the last bin also holds depth 1. `class_counts` counts each head class per bin
and `top_heads` lists each bin's most important heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import xarray as xr

from countlens.analysis.heads import CLASSES
from countlens.errors import InputError
from countlens.labels import head_label

#: The effect a token group must carry to hold the count (half the logit difference).
LEVEL = 0.5
#: Relative-depth bins of the head tables and figures.
N_BINS = 5


def relative_depth(layer: int | np.ndarray, n_layers: int) -> float | np.ndarray:
    """``layer / (n_layers − 1)``; the embeddings (layer −1) and a one-layer model's layer at 0."""
    if n_layers < 1:
        raise InputError(f"n_layers={n_layers}: a model has at least one layer")
    scale = max(n_layers - 1, 1)
    return np.maximum(np.asarray(layer, dtype=float), 0.0) / scale if np.ndim(layer) else max(int(layer), 0) / scale


def falls_below(depth: Sequence[float], effect: Sequence[float], level: float = LEVEL) -> float:
    """The depth where a curve last falls below ``level`` (module docstring); NaN if it never does."""
    d, f = np.asarray(depth, dtype=float), np.asarray(effect, dtype=float)
    above = np.flatnonzero(f >= level)
    if not len(above) or above[-1] == len(f) - 1:
        return math.nan
    j = int(above[-1])
    return float(d[j] + (f[j] - level) / (f[j] - f[j + 1]) * (d[j + 1] - d[j]))


def rises_above(depth: Sequence[float], effect: Sequence[float], level: float = LEVEL) -> float:
    """The depth where a curve first reaches ``level`` (module docstring); NaN if it never does."""
    d, f = np.asarray(depth, dtype=float), np.asarray(effect, dtype=float)
    above = np.flatnonzero(f >= level)
    if not len(above):
        return math.nan
    j = int(above[0])
    if j == 0:
        return float(d[0])
    return float(d[j - 1] + (level - f[j - 1]) / (f[j] - f[j - 1]) * (d[j] - d[j - 1]))


def image_group(vap: xr.Dataset) -> str:
    """The VAP group that holds the image: ``image``, or a cross-attention model's ``image_states``."""
    return "image_states" if "image_states" in vap.group else "image"


def vap_curves(vap: xr.Dataset, n_layers: int) -> pd.DataFrame:
    """The image-token and last-token effect per VAP layer, with the layer's relative depth: columns
    layer, depth, image, last (layers in order, the embeddings first)."""
    layers = np.sort(vap.layer.values.astype(int))
    return pd.DataFrame(
        {
            "layer": layers,
            "depth": relative_depth(layers, n_layers),
            "image": vap.effect.sel(group=image_group(vap), layer=layers).values.astype(float),
            "last": vap.effect.sel(group="last", layer=layers).values.astype(float),
        }
    )


def handoff(vap: xr.Dataset, n_layers: int) -> dict[str, float]:
    """Where the count passes from the image tokens to the last token, on relative depth: ``image_below``
    (`falls_below` of the image-token effect) and ``last_above`` (`rises_above` of the last token's)."""
    c = vap_curves(vap, n_layers)
    return {"image_below": falls_below(c.depth, c.image), "last_above": rises_above(c.depth, c.last)}


def depth_bin(depth: float | np.ndarray, n_bins: int = N_BINS) -> int | np.ndarray:
    """The bin of a relative depth: ⌊depth · n⌋, the last bin closed (depth 1 is in bin n − 1). The
    1e-9 keeps a depth such as 3/5, a hair below 0.6 in floating point, in its own bin."""
    b = np.minimum(np.floor(np.asarray(depth, dtype=float) * n_bins + 1e-9), n_bins - 1).astype(int)
    return int(b) if np.ndim(b) == 0 else b


def bin_labels(n_bins: int = N_BINS) -> list[str]:
    """Each bin's depth range, e.g. ``0.0–0.2``."""
    return [f"{b / n_bins:.1f}–{(b + 1) / n_bins:.1f}" for b in range(n_bins)]


def binned(table: pd.DataFrame, n_layers: int, n_bins: int = N_BINS) -> pd.DataFrame:
    """The head table (`countlens.analysis.heads.read_heads`) with each head's ``depth`` recomputed from
    its layer and ``n_layers``, and its depth ``bin`` label."""
    out = table.copy()
    out["depth"] = relative_depth(out["layer"].to_numpy(), n_layers)
    out["bin"] = np.asarray(bin_labels(n_bins))[depth_bin(out["depth"].to_numpy(), n_bins)]
    return out


def class_counts(table: pd.DataFrame, n_layers: int, n_bins: int = N_BINS) -> pd.DataFrame:
    """Heads of each class (columns, in `CLASSES` order) per depth bin (rows, every bin, zeros kept)."""
    t = binned(table, n_layers, n_bins)
    counts = pd.crosstab(t["bin"], t["class"]).reindex(index=bin_labels(n_bins), columns=list(CLASSES), fill_value=0)
    counts.index.name, counts.columns.name = "depth", None
    return counts


def top_heads(table: pd.DataFrame, n_layers: int, k: int = 3, n_bins: int = N_BINS) -> pd.DataFrame:
    """The ``k`` most important heads (head table's ``importance``, the |patching effect|) of each depth
    bin: columns bin, rank (1 … k), head (``L3H1``), layer, head_index, depth, class, importance."""
    t = binned(table, n_layers, n_bins)
    rows = []
    for label in bin_labels(n_bins):
        part = t[t["bin"] == label].sort_values(["importance", "layer", "head"], ascending=[False, True, True])
        for rank, (_, h) in enumerate(part.head(k).iterrows(), start=1):
            rows.append(
                {
                    "bin": label,
                    "rank": rank,
                    "head": head_label((int(h["layer"]), int(h["head"]))),
                    "layer": int(h["layer"]),
                    "head_index": int(h["head"]),
                    "depth": float(h["depth"]),
                    "class": h["class"],
                    "importance": float(h["importance"]),
                }
            )
    columns = ["bin", "rank", "head", "layer", "head_index", "depth", "class", "importance"]
    return pd.DataFrame(rows, columns=columns)
