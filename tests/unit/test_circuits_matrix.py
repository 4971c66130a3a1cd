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
from countlens.circuits.patching import Edit, cache_run, prepare_pairs, run_edits
from countlens.circuits.sites import group_mask
from countlens.datasets.pairs import count_pairs
from countlens.datasets.tasks import task_samples


@pytest.mark.numeric
@pytest.mark.parametrize("name", SUPPORTED)
def test_every_circuit_function_runs(name, loaded):
    vlm = loaded(name)
    size = TINY_IMAGE_SIZE[name][0]
    pairs = count_pairs(2, 3, 5, kind="polygons", image_size=size, prompt="short", seed=1)
    samples = task_samples("count", 3, 1, image_size=size)
    n_layers, n_heads = vlm.arch.n_layers, vlm.arch.n_heads

    vap = circuits.patch_layers(vlm, pairs)
    assert vap.effect.shape == (n_layers + 1, 3) and np.isfinite(vap.effect.values).all()
    # Patching every position of the last layer gives the corrupt run; so does the embedding layer
    # except in Qwen3-VL, whose DeepStack adds image features inside its first decoder layers.
    everything = [n_layers - 1] + ([] if name == "qwen3_vl" else [-1])
    full = circuits.patch_layers(vlm, pairs, groups=("all",), layers=everything)
    pb = prepare_pairs(vlm, pairs)
    scale = logit_scale(vlm, pb)
    assert_effect(
        full.effect,
        1.0,
        clean=full.clean_logit_diff,
        corrupt=full.corrupt_logit_diff,
        scale=scale,
        what=f"{name}: all-patched effect",
    )
    heads = circuits.patch_heads(vlm, pairs, positions="last")
    assert heads.effect.shape == (n_layers, n_heads)
    atp = circuits.attribution_patch(vlm, pairs)
    assert atp.effect.shape == (n_layers, n_heads) and np.isfinite(atp.effect.values).all()

    clean = cache_run(vlm, pb.clean, range(n_layers))
    mask = group_mask(pb.clean, "all")
    patched = run_edits(vlm, pb.clean, clean, [Edit(1, mask), Edit(1, mask, head=0), Edit(0, mask, head=1)])
    for logits in patched:  # replicas in one forward: another GEMM shape, so rounding only
        assert_close(logits, clean["logits"].cpu(), what=f"{name}: clean-into-clean logits")

    lens = circuits.logit_lens(vlm, samples)
    assert lens["rank"].shape == (n_layers, 3)
    hl = circuits.HeadLens.fit(vlm, samples * 2)
    assert hl.decode(vlm, samples, top_k=3).token.shape == (n_layers, n_heads, 3, 3)
    share = circuits.image_attention_share(vlm, samples)
    assert ((share >= 0) & (share <= 1 + 1e-5)).all()
    scan = circuits.ablation_scan(vlm, {"count": samples}, batch_size=3)
    assert scan.logp_drop.shape == (1, n_layers, n_heads)

    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples])
    base = vlm.forward(batch).logits
    with circuits.head_temperature(vlm, {(0, 0): 1.0}):
        assert torch.equal(vlm.forward(batch).logits, base)
    with circuits.head_temperature(vlm, {(0, 0): 3.0}):
        assert not torch.allclose(vlm.forward(batch).logits, base)
    proj = circuits.tap(vlm, samples, "projector")
    assert proj.shape[0] == 3 and proj.shape[1] == vlm.arch.d_model
