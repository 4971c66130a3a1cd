"""Count representations: last-token states, PCA, t-SNE, separation and the view on the organism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerance import assert_close

from countlens.analysis.representations import (
    last_token_states,
    pca,
    plot_representations,
    representation_view,
    separation,
    silhouette,
    tsne,
)
from countlens.datasets.countingtricks import countingtricks
from countlens.errors import InputError, LayerError

pytestmark = pytest.mark.usefixtures("one_thread")


def _clusters(counts: np.ndarray, spread: float, seed: int = 0, d: int = 16) -> torch.Tensor:
    """Float[Tensor, "sample d"]: one Gaussian blob per count, centres 10 apart along random directions."""
    g = torch.Generator().manual_seed(seed)
    centres = {c: 10 * torch.randn(d, generator=g) for c in np.unique(counts)}
    return torch.stack([centres[c] + spread * torch.randn(d, generator=g) for c in counts])


COUNTS = np.repeat(np.arange(1, 9), 12)


def test_separation_is_high_for_distinct_clusters_and_near_zero_for_shuffled_labels():
    states = torch.stack([_clusters(COUNTS, 0.5), _clusters(COUNTS, 0.5, seed=1)])
    sep = separation(states, COUNTS, layers=[3, 7])
    assert sep.dims == ("layer", "range") and list(sep.layer.values) == [3, 7]
    assert list(sep.range.values) == ["all", "1-4", "5+"]
    assert (sep > 0.8).all()
    shuffled = np.random.default_rng(0).permutation(COUNTS)
    # ~0, slightly negative: b is the nearest of 7 other (equally mixed) groups, a noisy minimum
    assert abs(separation(states, shuffled)).max() < 0.2


def test_separation_by_range_and_its_edge_cases():
    counts = np.repeat([1, 2, 3, 5], 10)
    x = _clusters(counts, 0.5)
    x[counts == 5] = x[counts == 3] + 0.01  # 5 sits on top of 3: the ranges tell them apart
    sep = separation(x[None], counts).isel(layer=0)
    assert sep.sel(range="1-4").item() > 0.8
    assert np.isnan(sep.sel(range="5+").item())  # one count only
    assert sep.sel(range="all").item() < sep.sel(range="1-4").item()
    assert np.isnan(silhouette(x, np.zeros(len(x))))
    with pytest.raises(InputError, match="one count per sample"):
        separation(x[None], counts[:-1])


@pytest.mark.numeric
def test_pca_is_deterministic_and_orders_components():
    x = _clusters(COUNTS, 1.0)
    a, b = pca(x, 3), pca(x.clone(), 3)
    assert torch.equal(a.coords, b.coords) and torch.equal(a.components, b.components)
    assert (a.explained[:-1] >= a.explained[1:]).all() and float(a.explained.sum()) <= 1
    assert_close(a.components @ a.components.T, torch.eye(3), what="orthonormal components")
    # the sign does not depend on the sign of the data's orientation
    flipped = pca(-x, 3)
    assert_close(flipped.components, a.components, what="components of -x")
    assert_close(flipped.coords, -a.coords, what="coordinates of -x")
    with pytest.raises(InputError, match="between 1 and"):
        pca(x, 100)


def test_tsne_is_seeded_and_keeps_clusters_apart():
    counts = np.repeat([1, 2, 3], 15)
    x = _clusters(counts, 0.5)
    y = tsne(x, perplexity=10, seed=0)
    assert y.shape == (45, 2) and torch.equal(y, tsne(x, perplexity=10, seed=0))
    assert silhouette(y, counts) > 0.7
    with pytest.raises(InputError, match="at most 500"):
        tsne(torch.zeros(501, 2))
    with pytest.raises(InputError, match="perplexity"):
        tsne(x, perplexity=50)


@pytest.mark.numeric
def test_last_token_states_and_the_view_on_the_organism(tmp_path, loaded):
    vlm = loaded("toy")
    samples = countingtricks(["1A"], 6, grid=vlm.geometry, seed=0, prompt="short")
    states = last_token_states(vlm, samples, [2, 0], batch_size=4)
    assert states.shape == (2, 6, vlm.arch.d_model)
    batch = vlm.prepare([s.image for s in samples[:2]], [s.question for s in samples[:2]])
    with torch.no_grad():
        out = vlm.forward(batch, output_hidden_states=True)
    # hidden_states[l + 1] is decoder layer l's output; layers come back in ascending order
    assert_close(states[0, :2], out.hidden_states[1][:, -1], what="layer-0 states")  # batches of 4 vs 2: rounding
    with pytest.raises(LayerError, match="out of range"):
        last_token_states(vlm, samples, [99])
    ds = representation_view(vlm, samples, [0, 5], with_tsne=True)
    assert ds.pca.dims == ("layer", "sample", "pc") and ds.pca.shape == (2, 6, 2)
    assert ds.tsne.shape == (2, 6, 2) and ds.separation.shape == (2, 3)
    assert list(ds["count"].values) == [s.meta["count"] for s in samples] and set(ds["case"].values) == {"1A"}
    path = plot_representations(ds, tmp_path / "repr.png")
    assert path.stat().st_size > 1000
