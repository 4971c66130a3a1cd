"""AuxK's loss (`countlens.features.dead`): its two normalisations against a hand computation, the
refusal of an unknown one, and that normalising by the error keeps more of a transcoder's features alive
on the organism's activations than normalising by the outputs' variance (``aux_norm="variance"``)."""

from __future__ import annotations

import pytest
import torch

import countlens.features.train as train_module
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError
from countlens.features import Transcoder, collect_activations, train_transcoders
from countlens.features.dead import AUX_WEIGHT, DEAD_AFTER, auxk_loss
from countlens.features.train import train_step


def test_auxk_loss_matches_a_hand_computation():
    # 2 tokens, 3 features (feature 0 alive, 1 and 2 dead), d_model 2; AUX_K ≥ 2 keeps both dead ones.
    pre = torch.tensor([[5.0, 1.0, -2.0], [4.0, 0.5, 3.0]])
    W_dec = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    error = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    dead = torch.tensor([False, True, True])
    # a_aux: token 0 → (0, 1, 0) (ReLU drops −2), token 1 → (0, 0.5, 3); ê = (0, 1) and (3, 0.5)
    sse = (0**2 + 1**2) + (2**2 + 0.5**2)  # ‖ê − e‖²: 1 + 4.25
    energy = 0 + 4 + 1 + 1  # Σ‖e‖²
    assert float(auxk_loss(pre, W_dec, error, dead, 3.0, "error")) == pytest.approx(sse / energy)
    assert float(auxk_loss(pre, W_dec, error, dead, 3.0, "variance")) == pytest.approx(sse / (2 * 3.0))
    assert auxk_loss(pre, W_dec, error, torch.zeros(3, dtype=torch.bool), 3.0) is None  # nothing dead
    # the "error" term is a share of the error: the same whatever the error's scale, once ê scales with it
    assert float(auxk_loss(pre * 1e-3, W_dec, error * 1e-3, dead, 3.0, "error")) == pytest.approx(sse / energy)


def test_an_unknown_aux_norm_is_refused_before_any_forward(loaded, monkeypatch, one_thread):
    monkeypatch.setattr(train_module, "collect_activations", lambda *a, **k: pytest.fail("a forward"))
    with pytest.raises(InputError, match="aux_norm='mean': use one of 'error', 'variance'"):
        train_transcoders(loaded("toy"), layers=[0], width=8, k=2, steps=1, aux_norm="mean")


def dead_after_training(x, y, aux_norm, steps=200, width=128, k=8, batch=256) -> int:
    """``train_transcoders``'s loop (same init, AuxK after `DEAD_AFTER` steps) on one layer's
    activations; the features that never fire on them at the end."""
    g = torch.Generator().manual_seed(0)
    tc = Transcoder(x.shape[1], width, "topk", k=k)
    with torch.no_grad():
        tc.W_enc.copy_(torch.randn(tc.W_enc.shape, generator=g) / x.shape[1] ** 0.5)
        tc.W_dec.copy_(tc.W_enc / tc.W_enc.norm(dim=1, keepdim=True))
        tc.b_dec.copy_(y.mean(0))
    optimizer = torch.optim.Adam(tc.parameters(), lr=2e-3)
    scale, since = float(y.var(0, unbiased=False).sum()), torch.zeros(width, dtype=torch.long)
    for _ in range(steps):
        i = torch.randint(len(x), (batch,), generator=g)
        _, fired = train_step(tc, optimizer, x[i], y[i], scale, since >= DEAD_AFTER, aux_norm)
        since = torch.where(fired, 0, since + 1)
    with torch.no_grad():
        return int((tc.encode(x) == 0).all(0).sum())


def test_auxk_normalised_by_the_error_keeps_more_features_alive(loaded, one_thread):
    # Layer 4 of the organism, 40 counting scenes (2,080 tokens), 200 steps: 14 dead features of 128 against
    # 25 (every layer of the organism goes the same way). Normalised by the variance, the AuxK term shrinks
    # with the main error, and so do Adam's updates of the dead features' rows.
    acts = collect_activations(loaded("toy"), [4], task_samples("count", 40, seed=7000))
    x, y = acts.inputs[4], acts.outputs[4]
    by_error, by_variance = dead_after_training(x, y, "error"), dead_after_training(x, y, "variance")
    assert by_error <= by_variance - 5, (by_error, by_variance)
    assert AUX_WEIGHT == 1 / 32  # Gao et al.'s weight, with their normalisation
