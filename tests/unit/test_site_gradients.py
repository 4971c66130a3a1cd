"""Gradients at any site (`countlens.circuits.engine.site_gradients.gradients`), against plain torch: a leaf
tensor through a hook and autograd, written here; its refusals before any forward; and the overlay that
draws a signed map (`countlens.analysis.overlays`) on a diverging scale named after what it draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from tolerance import assert_close

import countlens.circuits.engine.site_gradients as site_gradients
from countlens.analysis import overlays
from countlens.circuits.engine.metrics import Metric, kl, log_prob, prob_mass
from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.engine.site_gradients import gradients
from countlens.circuits.sites import HeadZ, Pattern, Residual, VisionBlock
from countlens.circuits.sites.positions import Objects
from countlens.datasets import count_pairs, task_samples
from countlens.errors import CountlensError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def samples():
    return task_samples("count", 3, seed=7)


@pytest.fixture(scope="module")
def pairs(organism):
    return count_pairs(2, clean=3, corrupt=5, kind="shapes", grid=organism.geometry, prompt="short")


def plain(vlm, batch, metric, layer: int, head_layer: int):
    """(layer 0's input x, Residual(layer), the o_proj input of ``head_layer``) and their gradients of
    Σ metric(logits at the last position): the leaf x through a pre-hook, autograd for the rest."""
    arch, hf = vlm.arch, vlm.hf
    seen = {}

    def leaf(m, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
        seen["x"] = x
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handles = [
        hf.get_submodule(arch.layer(0)).register_forward_pre_hook(leaf, with_kwargs=True),
        hf.get_submodule(arch.layer(layer)).register_forward_hook(lambda m, a, o: seen.update(h=o)),
        hf.get_submodule(arch.o_proj(head_layer)).register_forward_pre_hook(lambda m, a: seen.update(z=a[0])),
    ]
    try:
        with torch.enable_grad():
            logits = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
            values = [seen["x"], seen["h"], seen["z"]]
            grads = torch.autograd.grad(metric(logits).sum(), values)
    finally:
        for h in handles:
            h.remove()
    return [v.detach().float() for v in values], [g.float() for g in grads]


def test_samples_gradient_at_residual_and_head_and_input_x_gradient_over_one_object_equal_plain_autograd(
    organism, samples
):
    """Default metric on samples: the log-probability of each sample's own answer. At one object's image
    tokens, each site's value and gradient, and input × gradient (Σ over the width), equal plain torch."""
    where = Objects([0])
    ds = gradients(organism, samples, [Residual(-1), Residual(2), HeadZ(1, 1)], positions=where)
    assert list(ds.site.values) == ["L-1.resid", "L2.resid", "L1H1"]
    assert ds.input_x_gradient.dims == ("site", "sample", "position") and ds.value.dims[-1] == "width"
    assert "log_prob" in ds.attrs["metric"] and ds.attrs["method"] == "gradients" and "data_recipe" in ds.attrs
    batch = organism.prepare_samples(samples, answers=True)
    ids = batch.answer_token

    def metric(logits):
        return torch.log_softmax(logits, -1)[torch.arange(len(logits)), ids]

    (x, h, z), (gx, gh, gz) = plain(organism, batch, metric, 2, 1)
    d = organism.arch.head_dim(1)
    z, gz = z[..., d : 2 * d], gz[..., d : 2 * d]
    with torch.no_grad():
        logits = organism.hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    assert_close(ds.log_prob.values, metric(logits), what="the metric per sample")
    mass = gradients(organism, samples, [Residual(2)], metric=prob_mass(["2", "3"]), positions="last")
    first = [organism.answer_ids(a)[0] for a in ("2", "3")]
    assert_close(mass.prob_mass.values, torch.softmax(logits, -1)[:, first].sum(-1), what="prob_mass on samples")
    for b, sample in enumerate(samples):
        tokens = where.tokens(batch, b, sample)
        n = int(ds.n_positions[b])
        assert n == len(tokens) >= 1
        first = int(torch.nonzero(batch.inputs["attention_mask"][b]).min())
        assert ds.token.values[b, :n].tolist() == (tokens - first).tolist()
        for label, value, grad in (("L-1.resid", x, gx), ("L2.resid", h, gh), ("L1H1", z, gz)):
            one = ds.sel(site=label).isel(sample=b, position=slice(0, n))
            w = int(ds.site_width.sel(site=label))
            assert_close(one.value.values[:, :w], value[b, tokens], what=f"{label}'s value")
            assert_close(one.gradient.values[:, :w], grad[b, tokens], what=f"{label}'s gradient")
            ixg = (value[b, tokens] * grad[b, tokens]).sum(-1)
            assert_close(one.input_x_gradient.values, ixg, what=f"{label}'s input × gradient")
        assert np.isnan(ds.value.sel(site="L1H1").values[b, :n, d:]).all()  # narrower than the stream: NaN


def test_pairs_gradient_of_the_logit_difference_at_the_clean_run_equals_plain_autograd(organism, pairs):
    """On pairs: the clean run, read where the answers differ, under the default metric (the logit
    difference); the donor's objects (of="donor") are their tokens in the clean image."""
    ds = gradients(organism, pairs, [Residual(2)], positions="last")
    pb = prepare_pairs(organism, pairs)

    def metric(logits):
        rows = torch.arange(len(logits))
        return logits[rows, pb.clean_id] - logits[rows, pb.corrupt_id]

    (_, h, _), (_, gh, _) = plain(organism, pb.clean, metric, 2, 0)
    assert_close(ds.gradient.sel(site="L2.resid").values[:, 0], gh[:, -1], what="the gradient at the read position")
    assert_close(ds.value.sel(site="L2.resid").values[:, 0], h[:, -1], what="the value at the read position")
    assert ds.attrs["run"] == "each pair's clean run" and "logit_diff" in ds
    donor = gradients(organism, pairs, [Residual(-1)], positions=Objects([3], of="donor"))
    want = [len(Objects([3]).tokens(pb.corrupt, b, p.corrupt)) for b, p in enumerate(pairs)]
    assert donor.n_positions.values.tolist() == want


def test_bad_input_is_refused_before_any_forward(organism, samples, pairs, monkeypatch):
    """A read-only site, an unknown position, a metric the data cannot feed: each refused, naming it,
    before the recorder runs."""

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(site_gradients, "record", no_forward)

    def reads_corrupt(logits, pb):
        return logits[torch.arange(len(logits)), pb.corrupt_id]

    cases = [
        (samples, [Pattern(0, 0)], {}, "Pattern L0H0.pattern is read only"),
        (samples, [VisionBlock(0)], {}, "VisionBlock V0 is read only"),
        (samples, [Residual(1)], {"positions": "imagez"}, "unknown token group 'imagez'"),
        (samples, [Residual(1)], {"positions": Objects([40])}, "has no object 40"),
        (samples, [Residual(1)], {"metric": "logit_diff"}, "samples have one answer each"),
        (samples, [Residual(1)], {"metric": log_prob(answer="corrupt")}, "reads a corrupt answer"),
        (samples, [Residual(1)], {"metric": kl()}, "'kl' compares the run with a clean run"),
        (
            samples,
            [Residual(1)],
            {"metric": reads_corrupt},
            "read pair_batch.corrupt_id, and samples have no corrupt answer",
        ),
        (samples, [Residual(1)], {"metric": Metric("value", log_prob().fn)}, "rename the metric"),
        (pairs, [Residual(1)], {"metric": "kl"}, "its gradient there is zero"),
        (pairs, ["L0H0"], {}, "is no site"),
        (pairs, [Residual(1)], {"batch_size": 0}, "batch_size"),
        ([p.clean for p in pairs][:0], [Residual(1)], {}, "no samples given"),
    ]
    for data, sites, kw, match in cases:
        with pytest.raises(CountlensError, match=match):
            gradients(organism, data, sites, **kw)


def _bar(ax):
    """The colour bar's axes of a single overlay's figure: (its limits, its label); the figure closed."""
    import matplotlib.pyplot as plt

    cax = ax.figure.axes[-1]
    drawn = cax.get_ylim(), cax.get_ylabel()
    plt.close(ax.figure)
    return drawn


def test_overlay_draws_a_signed_map_on_a_symmetric_diverging_scale_named_after_what_it_draws():
    """A signed map: limits −m … m (m its largest magnitude), a label from the DataArray; an unsigned
    attention map keeps its scale from 0 to its peak and its label."""
    image = np.full((60, 60, 3), 200, np.uint8)
    signed = xr.DataArray(
        np.array([[-0.3, 0.1], [0.0, 0.2]]), dims=("row", "col"), name="input_x_gradient", attrs={"long_name": "ixg"}
    )
    (low, high), label = _bar(overlays.overlay(image, signed))
    assert (low, high) == pytest.approx((-0.3, 0.3)) and label == "ixg"
    (low, high), label = _bar(overlays.overlay(image, signed.values, label="input × gradient"))
    assert (low, high) == pytest.approx((-0.3, 0.3)) and label == "input × gradient"
    (low, high), label = _bar(overlays.overlay(image, np.array([[0.1, 0.4], [0.0, 0.2]])))
    assert (low, high) == pytest.approx((0.0, 0.4)) and label == "attention"
    drawn = overlays.blend(np.zeros((2, 2, 3), np.uint8), np.array([[-1.0, 0.0], [0.0, 1.0]]), alpha=1.0)
    assert drawn[0, 0, 2] > drawn[0, 0, 0] and drawn[1, 1, 0] > drawn[1, 1, 2]  # blue below 0, red above
    assert np.ptp(drawn[0, 1]) < 10  # 0 is white-grey, not the bottom of the scale


def test_cell_map_puts_one_samples_values_on_its_image_grid(organism, samples):
    ds = gradients(organism, samples[:1], [Residual(-1)], positions="image")
    one = ds.input_x_gradient.sel(site="L-1.resid").isel(sample=0)
    grid = overlays.cell_map(one)
    assert grid.shape == (int(one.grid_rows), int(one.grid_cols)) and grid.name == "input_x_gradient"
    (low, high), label = _bar(overlays.overlay(np.zeros((60, 60, 3), np.uint8), abs(grid).assign_attrs(grid.attrs)))
    assert low == -high and label == "input × gradient of log_prob"  # a gradient's map is signed by its attrs
    assert float(grid.sum()) == pytest.approx(float(one.sum()), rel=1e-6, abs=1e-9)
    assert float(grid[int(one.cell_row[0]), int(one.cell_col[0])]) == pytest.approx(float(one[0]), rel=1e-6)
    with pytest.raises(CountlensError, match="one sample's values over position"):
        overlays.cell_map(ds.input_x_gradient)
