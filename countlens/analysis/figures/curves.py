"""Quantities along the layers, or along a circuit's size, and one scatter.

- `layers`: visual activation patching, effect and overwrite rate by layer, one colour per token group.
- `lens`: the logit lens, mean p(gold) and the median rank of the gold answer by layer.
- `rank_emergence`: Counting Circuits' reading of the logit lens, the layer at which the answer becomes
  rank 1 (the top token) and stays so to the last layer: per layer, the share of samples whose
  answer is rank 1 there, and the share whose answer first becomes and stays rank 1 there
  (`emergence_layer`).
- `faithfulness`: f(C) over the fraction of the node set kept, one line per ranking.
- `scatter`: one estimate against another (AtP against exact patching), with the diagonal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr
from matplotlib.figure import Figure

from countlens.analysis.figures.canvas import finish, new_figure, save


def layers(vap: xr.Dataset, title: str = "Visual activation patching") -> Figure:
    """Effect (normalised logit difference) and overwrite rate by layer, one line per token group."""
    fig, (ax,) = new_figure(6.4, 3.8)
    for g in vap.group.values:
        (line,) = ax.plot(vap.layer, vap.effect.sel(group=g), marker="o", label=f"{g} (effect)")
        ax.plot(
            vap.layer, vap.overwrite.sel(group=g), ls="--", alpha=0.6, color=line.get_color(), label=f"{g} (overwrite)"
        )
    ax.set(xlabel="layer", ylabel="share of the corrupt behaviour", ylim=(-0.05, 1.05))
    ax.legend(fontsize=7, ncol=2)
    return finish(fig, title)


def plot_layers(vap: xr.Dataset, path: str | Path, title: str = "Visual activation patching") -> Path:
    """`layers`, saved as a PNG at ``path``."""
    return save(layers(vap, title), path)


def lens(ds: xr.Dataset) -> Figure:
    """Logit lens: mean probability and median rank of the gold answer by layer."""
    fig, (ax,) = new_figure(6.4, 3.8)
    ax.plot(ds.layer, ds.prob.mean("sample"), marker="o", label="p(gold)")
    ax.set(xlabel="layer", ylabel="mean p(gold)", ylim=(0, 1))
    twin = ax.twinx()
    twin.plot(ds.layer, ds["rank"].median("sample"), marker="s", color="tab:red", label="median rank")
    twin.set_ylabel("median rank of gold", color="tab:red")
    return finish(fig, "Logit lens at the last prompt token")


def plot_lens(ds: xr.Dataset, path: str | Path) -> Path:
    """`lens`, saved as a PNG at ``path``."""
    return save(lens(ds), path)


def emergence_layer(ds: xr.Dataset) -> xr.DataArray:
    """Per sample of a logit-lens result, the first layer from which the gold answer is rank 1 (rank 0)
    at every later layer; -1 when it is not rank 1 at the last layer."""
    top = (ds["rank"] == 0).transpose("sample", "layer").values
    # Rank 1 from layer i to the end: a reversed cumulative AND along the layers.
    stays = np.flip(np.logical_and.accumulate(np.flip(top, 1), 1), 1)
    first = np.where(stays.any(1), stays.argmax(1), -1)
    layer_of = np.append(ds.layer.values.astype(int), -1)  # index -1 (never) maps to -1
    return xr.DataArray(layer_of[first], coords={"sample": ds.sample}, dims="sample", name="emergence_layer")


def rank_emergence(ds: xr.Dataset) -> Figure:
    """The share of samples whose gold answer is rank 1 at each layer (line), and the share whose
    answer becomes rank 1 at that layer and stays so (bars; `emergence_layer`)."""
    fig, (ax,) = new_figure(6.4, 3.8)
    layer = ds.layer.values.astype(int)
    first = emergence_layer(ds).values
    n = len(first)
    ax.bar(layer, [(first == la).sum() / n for la in layer], color="tab:blue", alpha=0.5, label="becomes rank 1 here")
    ax.plot(layer, (ds["rank"] == 0).mean("sample"), marker="o", color="tab:red", label="rank 1 at this layer")
    never = (first < 0).sum() / n
    ax.set(xlabel="layer", ylabel="share of samples", ylim=(0, 1.05))
    ax.legend(fontsize=7, title=f"never rank 1 at the end: {never:.0%}", title_fontsize=7)
    return finish(fig, "Logit lens: the layer at which the answer becomes rank 1")


def plot_rank_emergence(ds: xr.Dataset, path: str | Path) -> Path:
    """`rank_emergence`, saved as a PNG at ``path``."""
    return save(rank_emergence(ds), path)


def faithfulness(ds: xr.Dataset, title: str = "Faithfulness of each ranking's top nodes") -> Figure:
    """f(C) over the fraction of the node set kept, one line per ranking; random rankings as their
    mean with a band of ± one standard deviation over the draws."""
    fig, (ax,) = new_figure(6.4, 3.8)
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
    ax.set(xlabel="fraction of the nodes kept", ylabel="faithfulness f(C)")
    ax.legend(fontsize=7)
    return finish(fig, title)


def plot_faithfulness(
    ds: xr.Dataset, path: str | Path, title: str = "Faithfulness of each ranking's top nodes"
) -> Path:
    """`faithfulness`, saved as a PNG at ``path``."""
    return save(faithfulness(ds, title), path)


def scatter(x: xr.DataArray, y: xr.DataArray, xlabel: str, ylabel: str, title: str) -> Figure:
    """``y`` against ``x`` (aligned on ``x``'s dimensions), with the diagonal y = x dotted."""
    fig, (ax,) = new_figure(4.4, 4.2)
    xv, yv = x.values.ravel(), y.transpose(*x.dims).values.ravel()
    ax.scatter(xv, yv, s=14)
    lo, hi = min(xv.min(), yv.min()), max(xv.max(), yv.max())
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls=":")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    return finish(fig, title)


def plot_scatter(x: xr.DataArray, y: xr.DataArray, path: str | Path, xlabel: str, ylabel: str, title: str) -> Path:
    """`scatter`, saved as a PNG at ``path``."""
    return save(scatter(x, y, xlabel, ylabel, title), path)
