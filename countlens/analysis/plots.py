"""Plots of circuit results, one PNG per figure (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr


def _figure(width: float = 6.0, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height), dpi=110)


def _save(plt, fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_layers(vap: xr.Dataset, path: str | Path, title: str = "Visual activation patching") -> Path:
    """Effect (normalised logit difference) and overwrite rate by layer, one line per token group."""
    plt, fig, ax = _figure()
    for g in vap.group.values:
        (line,) = ax.plot(vap.layer, vap.effect.sel(group=g), marker="o", label=f"{g} (effect)")
        ax.plot(
            vap.layer, vap.overwrite.sel(group=g), ls="--", alpha=0.6, color=line.get_color(), label=f"{g} (overwrite)"
        )
    ax.set(xlabel="layer", ylabel="share of the corrupt behaviour", title=title, ylim=(-0.05, 1.05))
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def plot_heatmap(da: xr.DataArray, path: str | Path, title: str, cmap: str = "viridis", center: bool = False) -> Path:
    """A (layer, head) map with values written in each cell."""
    da = da.transpose("layer", "head")
    plt, fig, ax = _figure(1.2 + 0.55 * da.sizes["head"], 1.0 + 0.42 * da.sizes["layer"])
    vmax = float(np.nanmax(np.abs(da.values))) or 1.0
    im = ax.imshow(
        da.values,
        cmap="RdBu_r" if center else cmap,
        vmin=-vmax if center else None,
        vmax=vmax if center else None,
        aspect="auto",
    )
    for (i, j), v in np.ndenumerate(da.values):
        ax.text(
            j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white" if abs(v) < 0.6 * vmax else "black"
        )
    ax.set(xlabel="head", ylabel="layer", title=title, xticks=range(da.sizes["head"]), yticks=range(da.sizes["layer"]))
    ax.set_yticklabels(da.layer.values)
    fig.colorbar(im, ax=ax, fraction=0.05)
    return _save(plt, fig, path)


def plot_scatter(x: xr.DataArray, y: xr.DataArray, path: str | Path, xlabel: str, ylabel: str, title: str) -> Path:
    plt, fig, ax = _figure(4.2, 4.0)
    xv, yv = x.values.ravel(), y.transpose(*x.dims).values.ravel()
    ax.scatter(xv, yv, s=14)
    lo, hi = min(xv.min(), yv.min()), max(xv.max(), yv.max())
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls=":")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(plt, fig, path)


def plot_lens(lens: xr.Dataset, path: str | Path) -> Path:
    """Logit lens: mean probability and median rank of the gold answer by layer."""
    plt, fig, ax = _figure()
    ax.plot(lens.layer, lens.prob.mean("sample"), marker="o", label="p(gold)")
    ax.set(xlabel="layer", ylabel="mean p(gold)", title="Logit lens at the last prompt token", ylim=(0, 1))
    twin = ax.twinx()
    twin.plot(lens.layer, lens["rank"].median("sample"), marker="s", color="tab:red", label="median rank")
    twin.set_ylabel("median rank of gold", color="tab:red")
    return _save(plt, fig, path)


def plot_bars(series: pd.Series, path: str | Path, title: str, ylabel: str = "accuracy") -> Path:
    plt, fig, ax = _figure(max(5.0, 0.28 * len(series)), 3.4)
    ax.bar(range(len(series)), series.values, color="tab:blue")
    ax.set_xticks(range(len(series)), [str(i) for i in series.index], rotation=90, fontsize=7)
    ax.set(ylabel=ylabel, title=title, ylim=(0, 1))
    return _save(plt, fig, path)


def plot_faithfulness(
    ds: xr.Dataset, path: str | Path, title: str = "Faithfulness of each ranking's top nodes"
) -> Path:
    """f(C) over the fraction of the node set kept, one line per ranking; random rankings as their
    mean with a band of ± one standard deviation over the draws."""
    plt, fig, ax = _figure()
    x = ds.kept_fraction.values
    draws = [str(r) for r in ds.ranking.values if str(r).startswith("random") and str(r) != "random"]
    for r in ds.ranking.values:
        name = str(r)
        if name in draws:
            continue
        y = ds.faithfulness.sel(ranking=name).values
        if name == "random" and draws:
            spread = ds.faithfulness.sel(ranking=draws).std("ranking").values
            ax.fill_between(x, y - spread, y + spread, color="grey", alpha=0.25)
            ax.plot(x, y, color="grey", ls="--", label=f"random (mean of {len(draws)})")
        else:
            ax.plot(x, y, marker="o", label=name)
    ax.axhline(0.8, color="black", lw=0.6, ls=":")
    ax.set(xlabel="fraction of the nodes kept", ylabel="faithfulness f(C)", title=title)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)
