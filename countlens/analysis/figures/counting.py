"""COUNTINGTRICKS accuracy, where the answer position looks, and the probes, as "Counting to Four" draws them.

- `bars`: one bar per entry of a Series (accuracy per case).
- `case_grid`: the paper's Table 5 layout: the position cases as a 1–4 × A–D grid (the number is
  where an object's centre sits against the patch grid, the letter the variant), beside a strip of
  the special cases (dilation 5A–8A, adjacency 9A–15A); a case the design lacks stays blank.
  `case_layout` gives both arrays, the ones the figure shows.
- `accuracy_by_count`: accuracy against the ground-truth count, with the number of samples per count
  (Fig. 7).
- `modality_share`: of the attention of the answer position, the share on image tokens and on the rest,
  for right and wrong answers (Fig. 3a). With the MAS code's four sets (special, system, image,
  text) when the run read attention at the last generation step, else image against everything else.
- `probe_ap`: AP@50 per tap of the detection probes (Fig. 4).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import xarray as xr
from matplotlib.figure import Figure

from countlens.analysis.figures.canvas import finish, label_cells, new_figure, save
from countlens.errors import InputError

#: Table 5's columns (the variants) and rows (the position of an object's centre on the patch grid).
VARIANTS: tuple[str, ...] = ("A", "B", "C", "D")
POSITIONS: tuple[int, ...] = (1, 2, 3, 4)
_CASE = re.compile(r"^(\d+)([A-Z])$")


def bars(series: pd.Series, title: str, ylabel: str = "accuracy") -> Figure:
    """One bar per entry of ``series``, labelled with its index, on a 0–1 axis."""
    fig, (ax,) = new_figure(max(5.0, 0.28 * len(series)), 3.6)
    ax.bar(range(len(series)), series.values, color="tab:blue")
    ax.set_xticks(range(len(series)), [str(i) for i in series.index], rotation=90, fontsize=7)
    ax.set(ylabel=ylabel, ylim=(0, 1))
    return finish(fig, title)


def plot_bars(series: pd.Series, path: str | Path, title: str, ylabel: str = "accuracy") -> Path:
    """`bars`, saved as a PNG at ``path``."""
    return save(bars(series, title, ylabel), path)


def case_layout(by_case: pd.Series) -> tuple[xr.DataArray, xr.DataArray]:
    """``by_case`` (accuracy per case name, e.g. "2C") as Table 5 lays it out: the position cases over
    (position 1–4, variant A–D), NaN where the design has no such case, and the others in their order."""
    names = [str(n) for n in by_case.index]
    parsed = {n: _CASE.match(n) for n in names}
    bad = [n for n, m in parsed.items() if m is None]
    if bad:
        raise InputError(f"case names {bad} are not a number and a letter (e.g. '2C'); give COUNTINGTRICKS cases")
    grid = xr.DataArray(
        np.full((len(POSITIONS), len(VARIANTS)), np.nan),
        coords={"position": list(POSITIONS), "variant": list(VARIANTS)},
        dims=("position", "variant"),
        name="accuracy",
    )
    special = []
    for name, value in zip(names, by_case.values.astype(float)):
        number, letter = int(parsed[name][1]), parsed[name][2]
        if number in POSITIONS and letter in VARIANTS:
            grid.loc[number, letter] = value
        else:
            special.append((name, value))
    strip = xr.DataArray(
        [v for _, v in special], coords={"case": [n for n, _ in special]}, dims="case", name="accuracy"
    )
    return grid, strip


def case_grid(by_case: pd.Series, title: str = "COUNTINGTRICKS accuracy per case (Table 5's layout)") -> Figure:
    """`case_layout` drawn: the 1–4 × A–D grid and the strip of special cases, one colour scale (0–1),
    every present case labelled with its accuracy."""
    grid, strip = case_layout(by_case)
    n_special = max(strip.sizes["case"], 1)
    fig, axes = new_figure(3.2 + 0.5 * n_special, 3.0, ncols=2, width_ratios=[4, n_special])
    colours = matplotlib.colormaps["viridis"].with_extremes(bad="white")  # white: a case the design lacks
    for ax, values, xs, ys, xlabel, ylabel in (
        (axes[0], grid.values, VARIANTS, POSITIONS, "variant", "position on the patch grid"),
        (axes[1], strip.values[None, :], strip.case.values, (), "special cases (dilation, adjacency)", ""),
    ):
        image = ax.imshow(values, cmap=colours, vmin=0.0, vmax=1.0, interpolation="nearest")  # square cells
        label_cells(ax, image, values)
        ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=90 if ax is axes[1] else 0, fontsize=8)
        ax.set_yticks(range(len(ys)), [str(y) for y in ys])
        ax.set(xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(image, ax=axes, shrink=0.7, label="accuracy")
    return finish(fig, title)


def plot_case_grid(by_case: pd.Series, path: str | Path) -> Path:
    """`case_grid`, saved as a PNG at ``path``."""
    return save(case_grid(by_case), path)


def accuracy_by_count(per_count: dict[int, float], n: dict[int, int], r: float) -> Figure:
    """Accuracy against the ground-truth count (``per_count``), each point's sample count ``n`` written
    above it; ``r``: the Pearson r between count and accuracy, in the title."""
    fig, (ax,) = new_figure(6.0, 3.6)
    counts = sorted(per_count)
    acc = [per_count[c] for c in counts]
    ax.plot(counts, acc, marker="o", color="tab:blue")
    for c, a in zip(counts, acc):
        ax.annotate(f"n={n.get(c, 0)}", (c, a), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=6)
    ax.set(xlabel="ground-truth count", ylabel="accuracy", ylim=(0, 1.1), xticks=counts)
    return finish(fig, f"Accuracy against the true count (Pearson r = {r:.2f})")


def plot_accuracy_by_count(per_count: dict[int, float], n: dict[int, int], r: float, path: str | Path) -> Path:
    """`accuracy_by_count`, saved as a PNG at ``path``."""
    return save(accuracy_by_count(per_count, n, r), path)


def modality_share(shares: pd.DataFrame, position: str) -> Figure:
    """Stacked horizontal bars: one row per outcome (``shares``' index, e.g. "correct (n=80)"), one
    segment per token set (its columns, shares summing to 1), each segment's share written in it."""
    fig, (ax,) = new_figure(6.4, 1.6 + 0.5 * len(shares))
    left = np.zeros(len(shares))
    colours = {"image": "tab:orange", "text": "tab:blue", "other (text, special)": "tab:blue"}
    spare = iter(["tab:grey", "tab:green", "tab:purple"])
    for column in shares.columns:
        width = shares[column].to_numpy(float)
        ax.barh(range(len(shares)), width, left=left, color=colours.get(column) or next(spare), label=column)
        for i, (x, w) in enumerate(zip(left, width)):
            if w >= 0.06:  # a narrower segment has no room for its label
                ax.text(x + w / 2, i, f"{w:.1%}", ha="center", va="center", fontsize=8, color="white")
        left += width
    ax.set_yticks(range(len(shares)), list(shares.index))
    ax.set(xlim=(0, 1), xlabel=f"share of the attention at the {position}")
    ax.invert_yaxis()
    fig.legend(loc="outside lower center", ncol=len(shares.columns), fontsize=8, frameon=False)
    return finish(fig, "Attention share by modality, right vs wrong answers")


def plot_modality_share(shares: pd.DataFrame, position: str, path: str | Path) -> Path:
    """`modality_share`, saved as a PNG at ``path``."""
    return save(modality_share(shares, position), path)


def probe_ap(probes: xr.Dataset) -> Figure:
    """AP@50 of the detection probes, one bar per tap, in the order the taps feed one another."""
    taps = [str(t) for t in probes.tap.values]
    fig, (ax,) = new_figure(max(4.4, 1.2 * len(taps)), 3.4)
    values = probes.ap50.values.astype(float)
    ax.bar(range(len(taps)), values, color="tab:green")
    for i, v in enumerate(values):
        ax.text(i, v + 0.02, f"{v:.3f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(taps)), taps)
    ax.set(ylabel="AP@50", ylim=(0, 1.05))
    return finish(fig, "Detection probes: AP@50 per tap")


def plot_probe_ap(probes: xr.Dataset, path: str | Path) -> Path:
    """`probe_ap`, saved as a PNG at ``path``."""
    return save(probe_ap(probes), path)
