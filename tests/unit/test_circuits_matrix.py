"""Every circuits function runs on every supported architecture's tiny config, with the invariants
that hold whatever the weights: clean-into-clean patching is exact, β = 1 is exact, lens shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_arch_matrix import SUPPORTED
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_close, assert_effect, logit_scale

from countlens import circuits
from countlens.analysis.evaluate import score
from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.methods.patching import prepare_pairs
from countlens.circuits.sites import HeadZ, ImageStates, Residual, group_mask
from countlens.datasets.pairs import count_pairs
from countlens.datasets.tasks import task_samples


@pytest.mark.numeric(every_case=True)  # every family under every kernel
@pytest.mark.matrix
@pytest.mark.parametrize("name", SUPPORTED)
def test_every_circuit_function_runs(name, loaded):
    vlm = loaded(name)
    size = TINY_IMAGE_SIZE[name][0]
    pairs = count_pairs(2, 3, 5, kind="polygons", image_size=size, prompt="short", seed=1)
    samples = task_samples("count", 3, 1, image_size=size)
    n_layers, n_heads = vlm.arch.n_layers, vlm.arch.n_heads

    vap = circuits.patch_layers(vlm, pairs)
    assert vap.effect.shape == (n_layers + 1, 3)
    cross = vlm.arch.cross_layers
    # Every cell is a site, but a cross-attention model's self-attention layers read no image states.
    no_site = [layer for layer in range(n_layers) if cross and layer not in cross]
    assert np.isnan(vap.effect.sel(group="image_states", layer=no_site)).all() if cross else True
    assert np.isfinite(vap.effect.drop_sel(layer=no_site).values).all()
    # Patching every position of the last layer gives the corrupt run; so does the embedding layer
    # except in Qwen3-VL, whose DeepStack adds image features inside its first decoder layers, in Gemma 4
    # with per-layer inputs (computed from the embeddings, image features included), and in a
    # cross-attention model, whose image is not in the embeddings but in the states every
    # cross-attention layer reads (patched at "layer -1").
    everything = [n_layers - 1] + ([-1] if vlm.arch.image_in_embeddings and not cross else [])
    assert vlm.arch.image_in_embeddings == (name not in ("qwen3_vl", "qwen3_vl_moe", "gemma4"))
    wholes = [circuits.patch_layers(vlm, pairs, groups=("all",), layers=everything)]
    if cross:
        wholes.append(circuits.patch_layers(vlm, pairs, groups=("image_states",), layers=[-1]))
    pb = prepare_pairs(vlm, pairs)
    scale = logit_scale(vlm, pb)
    for whole in wholes:
        assert_effect(
            whole.effect,
            1.0,
            clean=whole.clean_logit_diff,
            corrupt=whole.corrupt_logit_diff,
            scale=scale,
            what=f"{name}: all-patched effect",
        )
    heads = circuits.patch_heads(vlm, pairs, positions="last")
    assert heads.effect.shape == (n_layers, n_heads)
    kinds = ["cross" if layer in cross else "full" for layer in range(n_layers)]
    if name in ("gemma3", "gemma4", "paligemma"):  # layer_types: a sliding-window layer, then a global one
        kinds = ["sliding", "full"]
    if name in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet layers, then softmax ones
        kinds = ["linear", "full"] * 2
    if name == "llama4":  # chunked attention with RoPE, then global attention without
        kinds = ["chunked", "full"]
    assert heads.kind.values.tolist() == kinds
    # Every layer's own heads are sites (finite); beyond them (Qwen3.5's softmax layers: 4 of 8) NaN.
    own = np.array([[h < vlm.arch.heads(layer) for h in range(n_heads)] for layer in range(n_layers)])
    assert np.isfinite(heads.effect.values[own]).all() and np.isnan(heads.effect.values[~own]).all()
    atp = circuits.attribution_patch(vlm, pairs)
    assert atp.effect.shape == (n_layers, n_heads) and np.isfinite(atp.effect.values[own]).all()
    assert np.isnan(atp.effect.values[~own]).all()

    clean = cache_run(vlm, pb.clean, range(n_layers))
    mask = group_mask(pb.clean, "all")
    replicas = [Edit(Residual(1), mask), Edit(HeadZ(1, 0), mask), Edit(HeadZ(0, 1), mask)]
    if cross:  # the image states, at the projector and at a cross-attention layer's own input
        every = torch.ones(len(pb.clean), len(pb.clean.state_cells[0]), dtype=torch.bool)
        replicas += [Edit(ImageStates(-1), every), Edit(ImageStates(cross[0]), every)]
    patched = run_edits(vlm, pb.clean, clean, replicas)
    for logits in patched:  # replicas in one forward: another GEMM shape, so rounding only
        assert_close(logits, clean["logits"].cpu(), what=f"{name}: clean-into-clean logits")

    scored = score(vlm, samples, batch_size=3)
    assert len(scored["correct"]) == 3 and scored["correct"].dtype == bool
    lens = circuits.logit_lens(vlm, samples)
    assert lens["rank"].shape == (n_layers, 3)
    hl = circuits.HeadLens.fit(vlm, samples * 2)
    decoded = hl.decode(vlm, samples, top_k=3)
    assert decoded.token.shape == (n_layers, n_heads, 3, 3)
    assert np.isfinite(decoded.cter.values[own]).all() and np.isnan(decoded.cter.values[~own]).all()
    share = circuits.image_attention_share(vlm, samples)
    # Probabilities on softmax layers' own heads; none (NaN) on linear-attention layers or beyond the heads.
    softmax_heads = own & np.array([vlm.arch.softmax(layer) for layer in range(n_layers)])[:, None]
    assert ((share.values[softmax_heads] >= 0) & (share.values[softmax_heads] <= 1 + 1e-5)).all()
    assert np.isnan(share.values[~softmax_heads]).all()
    scan = circuits.ablation_scan(vlm, {"count": samples}, batch_size=3)
    assert scan.logp_drop.shape == (1, n_layers, n_heads)
    assert np.isfinite(scan.logp_drop.values[0][own]).all() and np.isnan(scan.logp_drop.values[0][~own]).all()

    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples])
    base = vlm.forward(batch).logits
    with circuits.head_temperature(vlm, {(vlm.arch.softmax_layers[0], 0): 1.0}):
        assert torch.equal(vlm.forward(batch).logits, base)
    for layer in (vlm.arch.softmax_layers[0], *cross):  # a cross-attention head's q too (after its q-norm)
        with circuits.head_temperature(vlm, {(layer, 0): 3.0}):
            assert not torch.allclose(vlm.forward(batch).logits, base), layer
    for layer in set(range(n_layers)) - set(vlm.arch.softmax_layers):  # no softmax, no temperature
        with pytest.raises(IndexError, match="no softmax"), circuits.head_temperature(vlm, {(layer, 0): 3.0}):
            pass
    proj = circuits.tap(vlm, samples, "projector")
    assert proj.shape[0] == 3 and proj.shape[1] == vlm.arch.d_model
