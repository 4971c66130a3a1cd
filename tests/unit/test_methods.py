"""The method registry and RelP: every method ranks or is refused by name, and RelP's coefficients for
the last layer's heads equal an independent hand computation of LRP's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerance import assert_close

from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.methods.registry import METHODS, discover_methods, method
from countlens.circuits.methods.relp import lrp_rules, relevance_patch
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def pairs(organism):
    return count_pairs(4, 3, 5, kind="shapes", grid=organism.geometry, prompt="short", seed=21)


def test_the_registry_names_each_method_once_and_discover_keeps_its_order():
    names = [m.name for m in METHODS]
    assert len(set(names)) == len(names) and len({m.label for m in METHODS}) == len(names)
    # discover's faithfulness table keeps its rows (the demo report is unchanged).
    assert [m.label for m in discover_methods()] == ["exact patching", "AtP", "EAP-IG", "mean-ablation drop", "AtP*"]
    with pytest.raises(InputError, match="registered ones are"):
        method("atp*")


def test_every_method_ranks_the_organism_s_heads(organism, pairs):
    for m in METHODS:
        ranking = m.ranking(organism, pairs, batch_size=4)
        assert ranking.dims == ("layer", "head") and ranking.shape == (6, 4), m.name
        assert np.isfinite(ranking.values).all(), m.name


def test_families_a_method_lacks_are_refused_by_name(loaded):
    llava = loaded("llava")
    for name, label in (("relp", "RelP"), ("atp_star", "AtP*")):
        assert not method(name).supports(llava)
        with pytest.raises(InputError, match=f"{label.replace('*', '.')} does not run on"):
            method(name).ranking(llava, [])


@pytest.mark.numeric
def test_lrp_rules_leave_the_forward_unchanged(organism, pairs):
    batch = prepare_pairs(organism, pairs).clean
    plain = organism.forward(batch).logits[:, -1].float()
    with lrp_rules(organism), torch.no_grad():
        ruled = organism.hf(**batch.inputs).logits[:, -1].float()
    assert_close(ruled, plain, what="logits under the LRP rules")


def _rms(norm, x):
    """Qwen2's RMSNorm written out: (y, the frozen scale w·rsqrt(mean x² + ε))."""
    scale = norm.weight * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return scale * x, scale


@pytest.mark.numeric
def test_relp_of_the_last_layer_s_heads_is_lrp_by_hand(organism, pairs):
    """For the last layer, z reaches LD only at the read position through o_proj, the last MLP and the
    final norm: the rules give ĝ_z = W_Oᵀ(ĝ_y + s₂ ⊙ (W_gᵀ(ρ ⊙ ½b ⊙ W_dᵀĝ_y) + W_uᵀ(½a ⊙ W_dᵀĝ_y)))
    with ĝ_y = s_f ⊙ W_Uᵀ(e_clean − e_corrupt), every scale and ratio the clean run's."""
    vlm, arch = organism, organism.arch
    last = arch.n_layers - 1
    layer = vlm.hf.get_submodule(arch.layer(last))
    mlp, o_proj = layer.mlp, vlm.hf.get_submodule(arch.o_proj(last))
    unembed = vlm.hf.get_submodule(arch.spec.lm_head).weight
    pb = prepare_pairs(vlm, pairs)
    got = {}
    hooks = [
        o_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("z", a[0][:, -1].clone())),
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: got.__setitem__("mid", a[0][:, -1])),
        layer.register_forward_hook(lambda m, a, out: got.__setitem__("y", out[:, -1])),
    ]
    try:
        with torch.no_grad():
            corrupt_ld = vlm.hf(**pb.corrupt.inputs).logits[:, -1].float()
            z_corrupt = got["z"]
            clean_ld = vlm.hf(**pb.clean.inputs).logits[:, -1].float()  # the clean run's values stay in got
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        rows = torch.arange(len(pairs))
        _, s_f = _rms(vlm.hf.get_submodule(arch.spec.final_norm), got["y"])
        g_y = s_f * (unembed[pb.clean_id] - unembed[pb.corrupt_id])
        n, s_2 = _rms(layer.post_attention_layernorm, got["mid"])
        g = n @ mlp.gate_proj.weight.T
        rho = mlp.act_fn(g) / g
        a, b = g * rho, n @ mlp.up_proj.weight.T
        back = g_y @ mlp.down_proj.weight
        g_n = (rho * 0.5 * b * back) @ mlp.gate_proj.weight + (0.5 * a * back) @ mlp.up_proj.weight
        g_z = (g_y + s_2 * g_n) @ o_proj.weight
        per_head = ((z_corrupt - got["z"]) * g_z).view(len(pairs), arch.n_heads, -1).sum(-1).sum(0)
        denom = float((corrupt_ld[rows, pb.clean_id] - corrupt_ld[rows, pb.corrupt_id]).sum()) - float(
            (clean_ld[rows, pb.clean_id] - clean_ld[rows, pb.corrupt_id]).sum()
        )
    relp = relevance_patch(vlm, pairs)
    assert_close(relp.effect.sel(layer=last).values, (per_head / denom).numpy(), what="RelP's last layer by hand")
