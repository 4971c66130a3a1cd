"""Patching: the nnsight sweeps agree with an independent plain-torch-hook loop, and invariants hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_close, assert_effect, logit_scale, scale_of

from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.methods.patching import (
    attribution_patch,
    compare,
    patch_heads,
    patch_layers,
    prepare_pairs,
)
from countlens.circuits.sites import HeadZ, Residual, group_mask
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError, LayerError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


def _pairs(vlm, n=3, image_size=None):
    if image_size is None:
        return count_pairs(n, kind="shapes", grid=vlm.geometry, prompt="short", counts=range(2, 7), seed=4)
    return count_pairs(n, 3, 5, kind="polygons", image_size=image_size, prompt="short", seed=4)


def _hook_logit_diffs(vlm, pairs, sites):
    """Plain torch hooks, no nnsight: for each site (layer, head or None, group), the clean run with
    that site's corrupt activation copied in; returns (LD per site and pair, the largest |logit|)."""
    pb = prepare_pairs(vlm, pairs)
    model, arch = vlm.hf, vlm.arch
    # 1. Record the corrupt run's o_proj inputs and layer outputs with hooks.
    z_c, h_c, handles = {}, {}, []
    handles.append(
        model.get_submodule(arch.layer(0)).register_forward_pre_hook(
            lambda m, args, kwargs: h_c.__setitem__(
                -1, (args[0] if args else kwargs["hidden_states"]).detach().clone()
            ),
            with_kwargs=True,
        )
    )
    for layer in range(arch.n_layers):
        handles.append(
            model.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(
                lambda m, args, layer=layer: z_c.__setitem__(layer, args[0].detach().clone())
            )
        )
        handles.append(
            model.get_submodule(arch.layer(layer)).register_forward_hook(
                lambda m, args, out, layer=layer: h_c.__setitem__(
                    layer, (out[0] if isinstance(out, tuple) else out).detach().clone()
                )
            )
        )
    with torch.no_grad():
        model(**pb.corrupt.inputs)
    for h in handles:
        h.remove()
    out, scale = [], 0.0
    for layer, head, group in sites:
        mask = group_mask(pb.clean, group)
        if head is None and layer == -1:

            def pre_embed(m, args, kwargs, mask=mask):
                hid = (args[0] if args else kwargs["hidden_states"]).clone()
                hid[mask] = h_c[-1][mask]
                return ((hid, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hid})

            handle = model.get_submodule(arch.layer(0)).register_forward_pre_hook(pre_embed, with_kwargs=True)
        elif head is None:

            def hook(m, args, output, layer=layer, mask=mask):
                hid = output[0] if isinstance(output, tuple) else output
                hid = hid.clone()
                hid[mask] = h_c[layer][mask]
                return (hid, *output[1:]) if isinstance(output, tuple) else hid

            handle = model.get_submodule(arch.layer(layer)).register_forward_hook(hook)
        else:

            def pre(m, args, layer=layer, head=head, mask=mask):
                z = args[0].clone()
                d = arch.head_dim(layer)  # the layer's own head size (Qwen3.5: 8 on linear layers, 16 on softmax)
                cols = slice(head * d, (head + 1) * d)
                z[..., cols][mask] = z_c[layer][..., cols][mask]
                return (z, *args[1:])

            handle = model.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(pre)
        with torch.no_grad():
            logits = model(**pb.clean.inputs).logits[:, -1].float()
        handle.remove()
        rows = torch.arange(len(logits))
        out.append((logits[rows, pb.clean_id] - logits[rows, pb.corrupt_id]).numpy())
        scale = max(scale, scale_of(logits))
    return np.stack(out), scale


@pytest.mark.numeric
def test_layer_and_head_patching_agree_with_plain_hooks_on_the_organism(organism):
    pairs = _pairs(organism)
    vap = patch_layers(organism, pairs, groups=("image", "last", "text"), batch_size=2)
    heads = patch_heads(organism, pairs, layers=[0, 3, 5], batch_size=2)
    sites = [(layer, None, g) for layer in (-1, 2, 5) for g in ("image", "last", "text")]
    sites += [(layer, h, "all") for layer in (0, 5) for h in range(organism.arch.n_heads)]
    ref, scale = _hook_logit_diffs(organism, pairs, sites)
    got = [vap.logit_diff.sel(layer=layer, group=g).values for layer, _, g in sites[:9]]
    got += [heads.logit_diff.sel(layer=layer, head=h).values for layer, h, _ in sites[9:]]
    assert_close(np.stack(got), ref, scale=scale, what="nnsight vs hook LDs")


@pytest.mark.numeric
@pytest.mark.matrix
@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava_onevision", "gemma3", "qwen3_5"])
def test_patching_agrees_with_plain_hooks_on_tiny_architectures(name, loaded):
    """Qwen3.5: layer 0's heads are a Gated DeltaNet layer's 8 value heads of 8, layer 1's 4 softmax
    heads of 16 (the head axis is 8 wide: its heads 4-7 are NaN, no sites)."""
    vlm = loaded(name)
    pairs = _pairs(vlm, n=2, image_size=TINY_IMAGE_SIZE[name][0])
    heads = patch_heads(vlm, pairs, positions="image", layers=[0, 1])
    vap = patch_layers(vlm, pairs, groups=("image", "last"))
    own = [(layer, h) for layer in (0, 1) for h in range(vlm.arch.heads(layer))]
    sites = [(layer, h, "image") for layer, h in own] + [(-1, None, "image"), (0, None, "image"), (1, None, "last")]
    ref, scale = _hook_logit_diffs(vlm, pairs, sites)
    got = [heads.logit_diff.sel(layer=layer, head=h).values for layer, h in own]
    got += [vap.logit_diff.sel(layer=layer, group=g).values for layer, _, g in sites[-3:]]
    beyond = [(layer, h) for layer in (0, 1) for h in range(vlm.arch.heads(layer), vlm.arch.n_heads)]
    assert all(np.isnan(heads.logit_diff.sel(layer=layer, head=h).values).all() for layer, h in beyond)
    assert bool(beyond) == (name == "qwen3_5")
    assert_close(np.stack(got), ref, scale=scale, what=f"{name}: nnsight vs hook LDs")


@pytest.mark.numeric
def test_patching_clean_into_clean_changes_nothing(organism):
    pb = prepare_pairs(organism, _pairs(organism))
    clean = cache_run(organism, pb.clean, range(organism.arch.n_layers))
    mask = group_mask(pb.clean, "all")
    edits = [Edit(Residual(2), mask), Edit(HeadZ(4, 1), mask), Edit(Residual(0), group_mask(pb.clean, "image"))]
    patched = run_edits(organism, pb.clean, clean, edits)
    for logits in patched:  # replicas of the batch in one forward: another GEMM shape, so rounding only
        assert_close(logits, clean["logits"].cpu(), what="clean-into-clean logits")


@pytest.mark.numeric
def test_patching_everything_gives_the_corrupt_run(organism):
    pairs = _pairs(organism)
    vap = patch_layers(organism, pairs, groups=("all",), layers=[-1, 0, 5])
    scale = logit_scale(organism, prepare_pairs(organism, pairs))
    assert_effect(vap.effect, 1.0, clean=vap.clean_logit_diff, corrupt=vap.corrupt_logit_diff, scale=scale)
    assert_close(
        vap.logit_diff.sel(group="all").values[0],
        vap.corrupt_logit_diff,
        scale=scale,
        what="all-patched LD vs corrupt LD",
    )


def test_attribution_patching_tracks_exact_head_patching(organism):
    pairs = _pairs(organism, n=16)
    atp = attribution_patch(organism, pairs, batch_size=8)
    exact = patch_heads(organism, pairs, batch_size=8)
    score = compare(atp.effect, exact.effect, k=4)
    assert score["spearman"] > 0.7 and score["top_k_overlap"] >= 0.5, score
    assert atp.effect.dims == ("layer", "head") and "model" in atp.attrs


def test_a_killed_sweep_resumes_from_its_store(organism, tmp_path):
    pairs = _pairs(organism, n=4)
    full = patch_layers(organism, pairs, groups=("last",), batch_size=2)
    store_dir = tmp_path / "vap"
    calls = []
    real = run_edits

    def crash_after_one(*args, **kw):
        if calls:
            raise KeyboardInterrupt  # the second chunk dies mid-sweep
        calls.append(1)
        return real(*args, **kw)

    import countlens.circuits.engine.sweep as sweep

    sweep.run_edits = crash_after_one
    try:
        with pytest.raises(KeyboardInterrupt):
            patch_layers(organism, pairs, groups=("last",), batch_size=2, store=store_dir)
    finally:
        sweep.run_edits = real
    resumed_calls = []

    def count(*args, **kw):
        resumed_calls.append(1)
        return real(*args, **kw)

    sweep.run_edits = count
    try:
        resumed = patch_layers(organism, pairs, groups=("last",), batch_size=2, store=store_dir)
    finally:
        sweep.run_edits = real
    assert len(resumed_calls) == 1  # only the unfinished chunk is recomputed
    # The same chunks in the same process: the resumed sweep is the uninterrupted one, bit for bit.
    np.testing.assert_array_equal(resumed.logit_diff.values, full.logit_diff.values)


def test_bad_patching_input(organism):
    with pytest.raises(LayerError, match="out of range"):
        patch_layers(organism, _pairs(organism, n=1), layers=[99])
    with pytest.raises(InputError, match="unknown token group"):
        patch_layers(organism, _pairs(organism, n=1), groups=("pixels",))
    with pytest.raises(InputError, match="no pairs"):
        patch_heads(organism, [])


def test_pairs_must_share_the_token_grid_not_only_the_token_count(loaded):
    """64×64 and 128×32 images both give 16 Qwen image tokens, on a 4×4 and an 8×2 grid."""
    from dataclasses import replace

    from countlens.datasets.pairs import CountPair
    from countlens.datasets.scene import Scene

    vlm = loaded("qwen2_5_vl")
    p = count_pairs(1, 3, 5, kind="shapes", image_size=64, prompt="short", seed=1)[0]
    wide = replace(p.corrupt, scene=Scene(128, 32, p.corrupt.scene.objects[:0]))
    with pytest.raises(InputError, match=r"pair 0: .*\(4, 4\).*\(2, 8\)"):
        prepare_pairs(vlm, [CountPair(p.clean, wide, p.kind, 0)])


@pytest.mark.filterwarnings("ignore:An input array is constant")  # scipy's own warning for the NaN case
def test_spearman_is_scipys_with_ties_and_nan_when_constant():
    from scipy.stats import spearmanr

    from countlens.circuits.methods.patching import spearman

    rng = np.random.default_rng(0)
    for n in (2, 5, 40):
        a, b = rng.normal(size=n), rng.integers(0, 3, n).astype(float)  # b has ties
        for x, y in ((a, b), (b, a), (a, -a), (b, b)):
            assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12, nan_ok=True)
    assert np.isnan(spearman(np.ones(4), np.arange(4.0)))
