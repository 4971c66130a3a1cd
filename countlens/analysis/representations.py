"""Count representations: does the residual stream at the answer position sort images by count?

The language model answers "how many?" at the last prompt position, so its residual stream there
(the output of each decoder layer at position −1; `VLM.prepare` pads on the left, so −1 is every
sample's last prompt token) must end up encoding the count. `last_token_states` reads those states
for chosen layers; `pca` projects each layer's states onto their top principal components (torch SVD
of the centred states, each component's sign fixed so that its largest-magnitude loading is
positive, so the picture is the same on every run); `tsne` gives a non-linear 2-D map (an exact,
seeded t-SNE written here, because scikit-learn is not a dependency; up to 500 points). `separation`
turns "are the counts apart?" into a number per layer: the mean silhouette of the samples, grouped by
count, in the layer's top-``k`` PCA space (Euclidean). A silhouette is (b − a) / max(a, b) with a the
mean distance to the sample's own count and b the smallest mean distance to another count: near 1
for tight, distant clusters, ~0 when counts overlap (shuffled labels), negative when samples sit
nearer another count than their own. It is reported over all counts and separately within the
subitizing range (counts 1–4) and beyond it (counts ≥ 5), using the PCA fitted on all samples, so
one can see whether small counts are laid out more distinctly than large ones. `representation_view`
puts it together as an xarray Dataset, and `plot_representations` draws the PCA maps coloured by count.

    from countlens.analysis.representations import representation_view, plot_representations
    ds = representation_view(vlm, samples, layers=[0, 2, 5])
    ds.separation.to_pandas(); plot_representations(ds, "runs/repr.png")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.errors import InputError
from countlens.model.arguments import require_layers, require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.vlm import VLM

#: Count ranges of `separation`: all counts, the subitizing range, and beyond it.
RANGES: dict[str, tuple[int, int]] = {"all": (0, 10**9), "1-4": (1, 4), "5+": (5, 10**9)}
TSNE_MAX_POINTS = 500


# ----------------------------------------------------------------------------- states


def _counts(samples: Sequence) -> np.ndarray:
    """Int (sample,): each sample's ``meta["count"]`` (COUNTINGTRICKS and the count task set it)."""
    missing = [i for i, s in enumerate(samples) if "count" not in getattr(s, "meta", {})]
    if missing:
        raise InputError(
            f"samples {missing[:5]} have no meta['count']; use counting samples "
            "(datasets.countingtricks or task_samples('count', ...))"
        )
    return np.array([int(s.meta["count"]) for s in samples])


@torch.no_grad()
def last_token_states(
    vlm: VLM, samples: Sequence, layers: Sequence[int], batch_size: int = 16
) -> Float[Tensor, "layer sample d"]:
    """Decoder layer outputs at the last prompt position.

    ``layers`` are read in ascending order (the returned first axis follows that order); an index
    outside the model raises `countlens.errors.LayerError` naming the valid range.
    """
    if len(samples) == 0:
        raise InputError("no samples given to last_token_states; pass at least one sample")
    if len(layers) == 0:
        raise InputError("no layers given to last_token_states; pass e.g. layers=[0, 2, 5]")
    layers = sorted({int(x) for x in layers})
    paths = [vlm.arch.layer(layer) for layer in layers]
    out = []
    for _, batch in vlm.batches(samples, batch_size):
        saved = []
        with vlm.read(batch):
            for path in paths:  # ascending, the order the layers run in
                saved.append(vlm.module(path).output[:, -1].save())
        out.append(torch.stack([h.float().cpu() for h in saved]))
    return torch.cat(out, 1)


# ----------------------------------------------------------------------------- embeddings


class PCA(NamedTuple):
    coords: Float[Tensor, "sample k"]
    components: Float[Tensor, "k d"]  # unit rows
    explained: Float[Tensor, " k"]  # share of the total variance
    mean: Float[Tensor, " d"]


def pca(x: Float[Tensor, "sample d"], k: int = 2) -> PCA:
    """Top-``k`` principal components of the rows of ``x`` (deterministic sign)."""
    if x.ndim != 2 or len(x) < 2:
        raise InputError(f"pca needs a (sample, d) matrix with at least 2 samples; got shape {tuple(x.shape)}")
    if not 1 <= k <= min(x.shape):
        raise InputError(f"pca k={k} must be between 1 and min(samples, d) = {min(x.shape)}")
    x = x.double()
    mean = x.mean(0)
    _, s, vt = torch.linalg.svd(x - mean, full_matrices=False)
    vt = vt[:k]
    sign = torch.sign(vt.gather(1, vt.abs().argmax(1, keepdim=True)))
    vt = vt * torch.where(sign == 0, 1.0, sign)
    var = s**2
    explained = var[:k] / var.sum().clamp(min=1e-300)
    return PCA(((x - mean) @ vt.T).float(), vt.float(), explained.float(), mean.float())


def _conditional_p(d2: np.ndarray, perplexity: float, tol: float = 1e-5, steps: int = 64) -> np.ndarray:
    """Row-stochastic P(j|i) whose entropies match log(perplexity), by bisection on the precision."""
    n = len(d2)
    p = np.zeros((n, n))
    target = np.log(perplexity)
    for i in range(n):
        d = np.delete(d2[i], i)
        lo, hi, beta = 0.0, np.inf, 1.0
        for _ in range(steps):
            w = np.exp(-(d - d.min()) * beta)
            q = w / w.sum()
            h = -np.sum(q * np.log(np.maximum(q, 1e-300)))
            if abs(h - target) < tol:
                break
            if h > target:
                lo, beta = beta, beta * 2 if hi == np.inf else (beta + hi) / 2
            else:
                hi, beta = beta, (beta + lo) / 2
        p[i, np.arange(n) != i] = q
    return p


def tsne(
    x: Float[Tensor, "sample d"],
    dim: int = 2,
    perplexity: float = 30.0,
    n_iter: int = 750,
    learning_rate: float | None = None,
    seed: int = 0,
) -> Float[Tensor, "sample dim"]:
    """An exact t-SNE embedding of the rows of ``x`` (≤ 500 points).

    van der Maaten & Hinton (2008) with the usual schedule: early exaggeration 12 for the first
    250 iterations, momentum 0.5 then 0.8, per-parameter gains, learning rate max(n / 48, 50) unless
    given; initial points drawn from N(0, 10⁻⁴) with ``seed``. O(n²) memory and time per step.
    """
    n = len(x)
    if x.ndim != 2 or n < 4:
        raise InputError(f"tsne needs a (sample, d) matrix with at least 4 samples; got shape {tuple(x.shape)}")
    if n > TSNE_MAX_POINTS:
        raise InputError(
            f"tsne here is exact (O(n²)) and takes at most {TSNE_MAX_POINTS} points, got {n}; "
            "subsample, or install scikit-learn or openTSNE for Barnes-Hut t-SNE"
        )
    if not 1 <= perplexity < n:
        raise InputError(f"tsne perplexity {perplexity} must be in [1, n_samples={n}); lower it")
    xs = x.double().numpy()
    d2 = np.maximum(np.sum(xs**2, 1)[:, None] + np.sum(xs**2, 1)[None] - 2 * xs @ xs.T, 0)
    p = _conditional_p(d2 / max(d2.max(), 1e-300), perplexity)
    p = np.maximum((p + p.T) / (2 * n), 1e-12)
    lr = learning_rate or max(n / 48, 50.0)
    y = np.random.default_rng(seed).normal(0, 1e-4, (n, dim))
    step, gains = np.zeros_like(y), np.ones_like(y)
    for it in range(n_iter):
        exaggeration, momentum = (12.0, 0.5) if it < 250 else (1.0, 0.8)
        num = 1 / (1 + np.sum((y[:, None] - y[None]) ** 2, -1))
        np.fill_diagonal(num, 0)
        q = np.maximum(num / num.sum(), 1e-12)
        pq = (exaggeration * p - q) * num
        grad = 4 * (np.diag(pq.sum(1)) - pq) @ y
        gains = np.where(np.sign(grad) != np.sign(step), gains + 0.2, gains * 0.8).clip(min=0.01)
        step = momentum * step - lr * gains * grad
        y = y + step
        y = y - y.mean(0)
    return torch.from_numpy(y).float()


# ----------------------------------------------------------------------------- separation


def silhouette(x: Float[Tensor, "sample k"], labels: np.ndarray) -> float:
    """Mean silhouette of the rows of ``x`` grouped by ``labels`` (NaN with < 2 groups).

    A sample alone in its group scores 0, as in scikit-learn.
    """
    labels = np.asarray(labels)
    groups = np.unique(labels)
    if len(groups) < 2 or len(labels) < 3:
        return float("nan")
    d = torch.cdist(x.double(), x.double()).numpy()
    member = labels[None, :] == groups[:, None]  # (group, sample)
    sums = d @ member.T  # (sample, group): total distance to each group
    sizes = member.sum(1)
    own = np.searchsorted(groups, labels)
    own_size = sizes[own]
    a = sums[np.arange(len(labels)), own] / np.maximum(own_size - 1, 1)
    mean_other = sums / sizes[None]
    mean_other[np.arange(len(labels)), own] = np.inf
    b = mean_other.min(1)
    s = np.where(own_size > 1, (b - a) / np.maximum(np.maximum(a, b), 1e-300), 0.0)
    return float(s.mean())


def separation(
    states: Float[Tensor, "layer sample d"], counts: Sequence[int], k: int = 10, layers: Sequence[int] | None = None
) -> xr.DataArray:
    """Silhouette of count groups per layer, over (layer, range) with ranges "all", "1-4", "5+".

    ``states`` is Float[Tensor, "layer sample d"]; each layer's states are projected on their top
    ``k`` principal components (fitted on all samples) and the silhouette is taken over the samples
    whose count lies in the range. A range with fewer than two distinct counts gives NaN.
    """
    if states.ndim != 3:
        raise InputError(
            f"states must be (layer, sample, d), e.g. from last_token_states; got shape {tuple(states.shape)}"
        )
    counts = np.asarray(counts, dtype=int)
    if len(counts) != states.shape[1]:
        raise InputError(f"got {len(counts)} counts for {states.shape[1]} samples; pass one count per sample")
    layers = list(range(states.shape[0])) if layers is None else [int(x) for x in layers]
    if len(layers) != states.shape[0]:
        raise InputError(f"got {len(layers)} layer labels for {states.shape[0]} layers of states")
    k = min(k, *states.shape[1:])
    values = np.full((len(layers), len(RANGES)), np.nan)
    for li, layer_states in enumerate(states):
        coords = pca(layer_states, k).coords
        for ri, (lo, hi) in enumerate(RANGES.values()):
            keep = (counts >= lo) & (counts <= hi)
            values[li, ri] = silhouette(coords[torch.from_numpy(keep)], counts[keep])
    return xr.DataArray(
        values,
        dims=("layer", "range"),
        coords={"layer": layers, "range": list(RANGES)},
        name="separation",
        attrs={"metric": "silhouette", "pca_k": k},
    )


# ----------------------------------------------------------------------------- view


def representation_view(
    vlm: VLM,
    samples: Sequence,
    layers: Sequence[int],
    k: int = 2,
    separation_k: int = 10,
    with_tsne: bool = False,
    seed: int = 0,
    batch_size: int = 16,
) -> xr.Dataset:
    """Last-token states of ``samples`` at ``layers``: PCA maps, explained variance and separation.

    Variables: ``pca`` (layer, sample, pc), ``explained`` (layer, pc), ``separation`` (layer, range)
    and, with ``with_tsne``, ``tsne`` (layer, sample, pc). Coords: ``count`` and ``case`` per sample.
    """
    require_vlm(vlm, "representation_view")
    check_samples(samples, "representation_view")
    counts = _counts(samples)
    if layers is None:
        raise InputError("representation_view: give the layers to read, e.g. layers=[0, 3]")
    layers = sorted(set(require_layers(vlm, layers, "representation_view")))
    states = last_token_states(vlm, samples, layers, batch_size)
    fits = [pca(s, k) for s in states]
    data = {
        "pca": (("layer", "sample", "pc"), torch.stack([f.coords for f in fits]).numpy()),
        "explained": (("layer", "pc"), torch.stack([f.explained for f in fits]).numpy()),
        "separation": separation(states, counts, separation_k, layers),
    }
    if with_tsne:
        perplexity = min(30.0, (len(samples) - 1) / 3)
        maps = [tsne(s, k, perplexity=perplexity, seed=seed) for s in states]
        data["tsne"] = (("layer", "sample", "pc"), torch.stack(maps).numpy())
    cases = [str(s.meta.get("case", s.task)) for s in samples]
    coords = {
        "layer": layers,
        "sample": np.arange(len(samples)),
        "pc": np.arange(k),
        "count": ("sample", counts),
        "case": ("sample", cases),
    }
    attrs = provenance(
        vlm.name,
        vlm.arch.name,
        dataset={"samples": len(samples)},
        seed=seed,
        samples=samples,
        method="representation_view",
        position="last prompt token",
    )
    return xr.Dataset(data, coords=coords, attrs=attrs)


def plot_representations(ds: xr.Dataset, path: str | Path, var: str = "pca") -> Path:
    """One panel per layer: the first two ``var`` ("pca" or "tsne") coordinates coloured by count."""
    if var not in ds or ds.sizes.get("pc", 0) < 2:
        raise InputError(
            f"the dataset has no 2-D {var!r} map; build it with representation_view(..., k≥2"
            f"{', with_tsne=True' if var == 'tsne' else ''})"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = ds.sizes["layer"]
    fig, axes = plt.subplots(1, n, squeeze=False, figsize=(3.0 * n + 0.8, 3.2), dpi=110, layout="constrained")
    axes = axes[0]
    counts = ds["count"].values
    norm = plt.Normalize(counts.min() - 0.5, counts.max() + 0.5)
    for ax, layer in zip(axes, ds.layer.values):
        xy = ds[var].sel(layer=layer).values
        sc = ax.scatter(xy[:, 0], xy[:, 1], c=counts, cmap="viridis", norm=norm, s=10)
        title = f"layer {layer}"
        if "separation" in ds:
            title += f" · silhouette {float(ds.separation.sel(layer=layer, range='all')):.2f}"
        ax.set(title=title, xlabel=f"{var} 1", ylabel=f"{var} 2")
        ax.title.set_fontsize(8)
    fig.colorbar(sc, ax=list(axes), label="count", ticks=np.unique(counts))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
