"""Logit lens, head temperature and mean ablation: invariants and independent reimplementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_close, bound, scale_of

from countlens.circuits.engine.temperature import beta_from_importance, head_temperature
from countlens.circuits.lenses.lens import logit_lens
from countlens.circuits.methods.ablation import ablate, ablation_scan, group_means, jaccard, top_heads
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


def _batch(vlm, samples):
    return vlm.prepare([s.image for s in samples], [s.question for s in samples], [s.answer for s in samples])


@pytest.mark.numeric
def test_logit_lens_last_layer_is_the_model_output(organism):
    samples = task_samples("count", 6, 1)
    lens = logit_lens(organism, samples, batch_size=4)
    logits = organism.forward(_batch(organism, samples)).logits[:, -1]
    gold = _batch(organism, samples).answer_token
    last = lens.sel(layer=organism.arch.n_layers - 1)
    # Arg-maxes of two computations (the lens in batches of 4, the forward of all 6): equal unless the top
    # two logits tie within rounding; here they stand ≥ 0.28 apart (measured), 2,000× the logits' bound.
    np.testing.assert_array_equal(last.top.values, logits.argmax(-1).numpy())
    # A probability's rounding is at most the logits' (dp ≤ p·dlogit ≤ dlogit).
    assert_close(last.prob, logits.softmax(-1)[torch.arange(6), gold], scale=scale_of(logits), what="lens prob")
    assert (lens["rank"].values >= 0).all() and lens["rank"].dims == ("layer", "sample")


@pytest.mark.matrix
@pytest.mark.numeric
@pytest.mark.parametrize("name", ["toy", "qwen3_vl", "gemma3"])
def test_temperature_on_every_head_of_a_layer_equals_scaling_the_attention(name, loaded):
    """Independent reimplementation: β on all heads of a layer = the attention module's ``scaling`` × β."""
    vlm = loaded(name)
    size = vlm.geometry.image_height if name == "toy" else TINY_IMAGE_SIZE[name][0]
    batch = _batch(vlm, task_samples("count", 3, 2, image_size=size))
    layer, beta = 1, 1.7
    with head_temperature(vlm, {(layer, h): beta for h in range(vlm.arch.n_heads)}):
        ours = vlm.forward(batch).logits
    attn = vlm.hf.get_submodule(vlm.arch.attention(layer))
    old = attn.scaling
    attn.scaling = old * beta
    try:
        ref = vlm.forward(batch).logits
    finally:
        attn.scaling = old
    assert_close(ours, ref, what=f"{name}: β on q vs β on the scaling")  # another product order: rounding only
    assert (ours - vlm.forward(batch).logits).abs().max() > 10 * bound(scale_of(ours))  # the edit did something


@pytest.mark.parametrize("name", ["toy", "qwen3_vl", "gemma3"])
def test_temperature_beta_one_is_exact_and_one_head_only_touches_that_head(name, loaded):
    vlm = loaded(name)
    size = vlm.geometry.image_height if name == "toy" else TINY_IMAGE_SIZE[name][0]
    batch = _batch(vlm, task_samples("count", 3, 2, image_size=size))
    base = vlm.forward(batch).logits
    with head_temperature(vlm, {(1, 0): 1.0, (0, 1): 1.0}):
        assert torch.equal(vlm.forward(batch).logits, base)
    seen = {}
    o_proj = vlm.hf.get_submodule(vlm.arch.o_proj(1))
    handle = o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0].clone()))
    vlm.forward(batch)
    z0 = seen["z"]
    with head_temperature(vlm, {(1, 1): 2.0}):
        vlm.forward(batch)
    handle.remove()
    d = vlm.arch.d_head
    changed = (seen["z"] - z0).abs().view(*z0.shape[:-1], -1, d).amax((0, 1, 3))
    others = [h for h in range(vlm.arch.n_heads) if h != 1]
    # The other heads' z: the same operations on the same q, k and v, head by head: bit for bit.
    assert changed[1] > 1e-6 and changed[others].max() == 0


def test_beta_from_importance(loaded):
    imp = xr.DataArray(np.array([[0.1, 0.9], [0.5, -0.2]]), dims=("layer", "head"))
    betas = beta_from_importance(imp, alpha=1.2, top_k=3)
    assert betas == pytest.approx({(0, 1): 1.2})  # 1.2·0.5/0.9 < 1: not flattened
    loose = beta_from_importance(imp, alpha=1.2, top_k=3, floor=0.0)
    assert loose == pytest.approx({(0, 1): 1.2, (1, 0): 1.2 * 0.5 / 0.9, (1, 1): 1.2 * 0.2 / 0.9})
    with pytest.raises(InputError):
        with head_temperature(loaded("toy"), {(0, 9): 1.2}):
            pass


def _hook_ablation_logits(vlm, samples, heads, means):
    """Plain-torch reimplementation of joint mean ablation: o_proj pre-hooks write the group means."""
    from countlens.circuits.methods.ablation import ABLATION_GROUPS
    from countlens.circuits.sites import group_mask

    batch = _batch(vlm, samples)
    masks = [group_mask(batch, g) for g in ABLATION_GROUPS]
    d = vlm.arch.d_head
    handles = []
    for layer, head in heads:

        def pre(m, args, layer=layer, head=head):
            z = args[0].clone()
            for g, mask in enumerate(masks):
                z[..., head * d : (head + 1) * d][mask] = means[layer, g, head * d : (head + 1) * d]
            return (z, *args[1:])

        handles.append(vlm.hf.get_submodule(vlm.arch.o_proj(layer)).register_forward_pre_hook(pre))
    try:
        return vlm.forward(batch).logits[:, -1].float()
    finally:
        for h in handles:
            h.remove()


@pytest.mark.numeric
def test_joint_mean_ablation_agrees_with_plain_hooks(organism):
    samples = task_samples("count", 6, 3)
    means = group_means(organism, samples, batch_size=4)
    heads = [(0, 0), (2, 3), (5, 1)]
    res = ablate(organism, samples, heads, means=means, batch_size=6)
    ref = _hook_ablation_logits(organism, samples, heads, means).log_softmax(-1)
    gold = _batch(organism, samples).answer_token
    assert_close(res.logp, ref[torch.arange(6), gold], what="mean-ablated log p vs hooks")


@pytest.mark.numeric
def test_ablation_scan_single_heads_match_joint_ablation_of_one_head(organism):
    tasks = {"count": task_samples("count", 4, 5), "color": task_samples("color", 4, 5)}
    scan = ablation_scan(organism, tasks, batch_size=4)
    assert scan.acc_drop.dims == ("task", "layer", "head")
    one = ablate(organism, tasks["color"], [(1, 2)], batch_size=4)
    assert_close(
        scan.logp_drop.sel(task="color", layer=1, head=2),
        (one.base_logp - one.logp).mean(),
        scale=scale_of(one.base_logp, one.logp),
        what="scan vs joint drop",
    )  # a difference of log p
    tops = top_heads(scan, k=3)
    assert set(tops) == {"count", "color"} and all(len(v) == 3 for v in tops.values())
    jac = jaccard(scan, k=3)
    assert np.allclose(np.diag(jac.values), 1.0) and np.allclose(jac.values, jac.values.T)


def test_ablation_scan_streams_chunks_and_resumes_without_recomputing(organism, tmp_path, monkeypatch):
    from countlens.circuits.methods import ablation

    tasks = {"count": task_samples("count", 6, 3), "color": task_samples("color", 4, 3)}
    plain = ablation_scan(organism, tasks, batch_size=4)
    stored = ablation_scan(organism, tasks, batch_size=4, store=tmp_path / "abl")
    for var in ("acc_drop", "logp_drop", "base_acc"):  # the same chunks, one process: bit for bit
        np.testing.assert_array_equal(stored[var].values, plain[var].values)
    chunks = sorted(p.stem for p in (tmp_path / "abl" / "chunks").glob("*.nc"))
    assert chunks == ["color_000000", "count_000000", "count_000004", "means_color", "means_count"]
    # A killed run: one chunk never finished. The rerun computes that chunk alone (and no means).
    (tmp_path / "abl" / "chunks" / "count_000004.nc").unlink()
    calls = {"chunk": 0, "means": 0}
    real_chunk, real_means = ablation._scan_chunk, ablation.group_means
    monkeypatch.setattr(
        ablation, "_scan_chunk", lambda *a: (calls.__setitem__("chunk", calls["chunk"] + 1), real_chunk(*a))[1]
    )
    monkeypatch.setattr(
        ablation, "group_means", lambda *a: (calls.__setitem__("means", calls["means"] + 1), real_means(*a))[1]
    )
    resumed = ablation_scan(organism, tasks, batch_size=4, store=tmp_path / "abl")
    assert calls == {"chunk": 1, "means": 0}
    np.testing.assert_array_equal(resumed.logp_drop.values, plain.logp_drop.values)
