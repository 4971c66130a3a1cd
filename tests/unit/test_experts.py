"""Experts as sites on mixture-of-experts models — tiny Qwen3-VL-MoE (layer 0 dense, layer 1 four
experts, two per token, weighted outputs) and tiny Llama 4 (layer 1 four experts, one per token, scaled
inputs, a shared expert): contributions sum to the experts' output, patching every expert equals a
plain hook that swaps in the corrupt run's experts output, and the sweeps' invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerance import assert_close, scale_of

from countlens import circuits
from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.methods.patching import prepare_pairs
from countlens.circuits.sites import Expert, group_mask
from countlens.circuits.sites.expert_rules import expert_contribution
from countlens.datasets.pairs import count_pairs
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError, LayerError

MOE = ("qwen3_vl_moe", "llama4")


@pytest.fixture(scope="module")
def moe(loaded):
    return loaded("qwen3_vl_moe")


@pytest.fixture(scope="module")
def pairs():
    return count_pairs(2, 3, 5, kind="polygons", image_size=64, prompt="short", seed=1)


def test_the_spec_finds_the_experts(moe, loaded, pairs):
    assert moe.arch.expert_layers == (1,) and (moe.arch.n_experts, moe.arch.experts_top_k) == (4, 2)
    with pytest.raises(LayerError, match="mixture-of-experts layers are \\[1\\]"):
        moe.arch.experts(0)
    with pytest.raises(InputError, match="has no experts"):
        circuits.patch_experts(loaded("qwen3_vl"), pairs)


@pytest.mark.numeric
def test_contributions_sum_to_the_experts_output(moe, pairs):
    """The experts module's own forward (grouped kernels) against Σ_e contribution_e, token by token."""
    pb = prepare_pairs(moe, pairs)
    seen = {}
    module = moe.hf.get_submodule(moe.arch.experts(1))
    handle = module.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    try:
        moe.forward(pb.clean)
    finally:
        handle.remove()
    x, index, weights = seen["args"]
    total = sum(expert_contribution(module, x, index, weights, e) for e in range(moe.arch.n_experts))
    assert_close(total, seen["out"], scale=scale_of(seen["out"]), what="Σ expert contributions")
    # Each token's chosen experts, and only they, contribute: an unchosen expert's weight is 0 at every
    # token, and its (finite) output times 0 is exactly 0.
    unchosen = [e for e in range(4) if not (index == e).any()]
    for e in unchosen:
        assert expert_contribution(module, x, index, weights, e).abs().max() == 0


@pytest.mark.numeric
@pytest.mark.parametrize("name", MOE)
def test_patching_every_expert_equals_swapping_the_experts_output(name, loaded, pairs):
    """An independent plain hook: the clean run with layer 1's experts output replaced, at every real
    token, by the corrupt run's; patch all four experts' contributions must give the same logits."""
    moe = loaded(name)
    pb = prepare_pairs(moe, pairs)
    module = moe.hf.get_submodule(moe.arch.experts(1))
    corrupt = {}
    handle = module.register_forward_hook(lambda m, a, out: corrupt.setdefault("out", out.detach().clone()))
    try:
        moe.forward(pb.corrupt)
    finally:
        handle.remove()
    real = pb.clean.inputs["attention_mask"].bool().flatten()
    experts = 4 if name == "llama4" else 1  # Llama 4's output: every expert's rows, expert by expert

    def swap(m, a, out):
        out = out.clone().view(experts, len(real), -1)
        out[:, real] = corrupt["out"].view(experts, len(real), -1)[:, real]
        return out.view(experts * len(real), -1)

    handle = module.register_forward_hook(swap)
    try:
        ref = moe.forward(pb.clean).logits[:, -1].float()
    finally:
        handle.remove()
    cache = cache_run(moe, pb.corrupt, [1], resid=False, z=False, experts=True)
    mask = group_mask(pb.clean, "all")
    got = run_edits(moe, pb.clean, cache, [[Edit(Expert(1, e), mask) for e in range(4)]])[0]
    assert_close(got, ref, scale=scale_of(ref), what="all experts patched vs swapped output")
    assert not torch.allclose(ref, cache_run(moe, pb.clean, [])["logits"])  # the swap changes something


@pytest.mark.numeric
@pytest.mark.parametrize("name", MOE)
def test_expert_sweeps_and_their_invariants(name, loaded, pairs):
    moe = loaded(name)
    top_k = moe.arch.experts_top_k
    assert (moe.arch.expert_layers, top_k) == ((1,), 2 if name == "qwen3_vl_moe" else 1)
    ds = circuits.patch_experts(moe, pairs, positions="all")
    assert ds.effect.dims == ("layer", "expert") and ds.effect.shape == (1, 4)
    assert np.isfinite(ds.effect.values).all() and ds.logit_diff.shape == (1, 4, 2)
    samples = task_samples("count", 3, 1, image_size=64)
    usage = circuits.expert_usage(moe, samples, positions="all")
    assert usage.shape == (1, 4) and usage.sum("expert").item() == pytest.approx(top_k)  # top-k per token
    batch = moe.prepare_samples(samples)
    index, weights = circuits.routing(moe, batch)[1]
    assert index.shape == weights.shape == (3, batch.inputs["input_ids"].shape[1], top_k) and (weights > 0).all()
    means = circuits.expert_means(moe, samples)
    assert means.shape == (1, 3, 4, moe.arch.d_model)
    scan = circuits.expert_ablation_scan(moe, samples, means=means)
    assert scan.logp_drop.shape == (1, 4) and np.isfinite(scan.logp_drop.values).all()
    joint = circuits.ablate_experts(moe, samples, [(1, 0), (1, 1)], means=means)
    assert joint.logp.shape == (3,) and np.isfinite(joint.logp.values).all()
    # One expert alone in the joint ablation equals the scan's figure for it.
    alone = circuits.ablate_experts(moe, samples, [(1, 2)], means=means)
    drop = (alone.base_logp - alone.logp).mean()
    # The scan's batches against the joint ablation's: a difference of log p's, rounding of their size.
    scale = scale_of(alone.base_logp, alone.logp)
    assert_close(drop, scan.logp_drop.sel(layer=1, expert=2), scale=scale, what="joint ablation of one expert vs scan")
    with pytest.raises(InputError, match="expert_means"):
        circuits.ablate_experts(moe, samples, [(1, 0)], means=means[:, :2])


@pytest.mark.numeric
def test_patching_one_llama4_expert_overwrites_only_its_rows(loaded, pairs):
    """The scaled-inputs rule: patching one expert equals a plain hook that copies the corrupt run's rows
    of that expert (and no other expert's) into the clean run's experts output. The expert is the one
    the clean run routes the read position to: layer 1 is the last, so only that token reaches the
    logits read there."""
    moe = loaded("llama4")
    pb = prepare_pairs(moe, pairs)
    chosen = int(circuits.routing(moe, pb.clean)[1][0][0, -1, 0])
    module = moe.hf.get_submodule(moe.arch.experts(1))
    corrupt = {}
    handle = module.register_forward_hook(lambda m, a, out: corrupt.setdefault("out", out.detach().clone()))
    try:
        moe.forward(pb.corrupt)
    finally:
        handle.remove()
    real = pb.clean.inputs["attention_mask"].bool().flatten()

    def swap_one(m, a, out):
        out = out.clone().view(4, len(real), -1)
        out[chosen, real] = corrupt["out"].view(4, len(real), -1)[chosen, real]
        return out.view(4 * len(real), -1)

    handle = module.register_forward_hook(swap_one)
    try:
        ref = moe.forward(pb.clean).logits[:, -1].float()
    finally:
        handle.remove()
    cache = cache_run(moe, pb.corrupt, [1], resid=False, z=False, experts=True)
    got = run_edits(moe, pb.clean, cache, [[Edit(Expert(1, chosen), group_mask(pb.clean, "all"))]])[0]
    assert_close(got, ref, scale=scale_of(ref), what="one expert patched vs its rows swapped")
    assert not torch.allclose(ref, cache_run(moe, pb.clean, [])["logits"])  # the patch changes something


@pytest.mark.numeric
def test_qwen3_5_moe_experts_follow_the_weighted_outputs_rule(loaded):
    """Qwen3.5-35B-A3B's layout (tests/data/checkpoints): the tiny random Qwen3.5-MoE (hybrid layers,
    linear and full, of four experts, two per token, and a shared expert). Its experts module's own
    forward equals Σ_e of the rule's contributions, token by token, on every layer; the shared expert
    is outside the experts module."""
    vlm = loaded("qwen3_5_moe")
    model, arch = vlm.hf, vlm.arch
    assert arch.name == "qwen3_5_moe" and arch.kinds == ("linear", "full") * 2
    assert (arch.expert_layers, arch.n_experts, arch.experts_top_k) == ((0, 1, 2, 3), 4, 2)
    for layer in arch.expert_layers:
        module = model.get_submodule(arch.experts(layer))
        assert isinstance(model.get_submodule(arch.router(layer)), torch.nn.Module)
        seen: dict = {}
        handle = module.register_forward_hook(lambda m, args, out, seen=seen: seen.update(args=args, out=out))
        try:
            with torch.no_grad():
                model(input_ids=torch.randint(0, 50, (2, 7)), use_cache=False)
        finally:
            handle.remove()
        x, index, weights = seen["args"]
        total = sum(expert_contribution(module, x, index, weights, e) for e in range(arch.n_experts))
        assert_close(total, seen["out"], scale=scale_of(seen["out"]), what=f"layer {layer}: Σ expert contributions")
