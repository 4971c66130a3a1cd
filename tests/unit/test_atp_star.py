"""AtP* (countlens.circuits.methods.atp_star) against an independent plain-torch computation on the organism.

The reference here never calls the module: it reads q_proj/k_proj/v_proj and o_proj's input with its
own hooks, applies rotary embedding itself (q·cos + rotate_half(q)·sin), builds the causal and padding
mask from the batch, recomputes each patched attention row from scratch (one softmax per patched
key), and cuts GradDrop's layer with a detach in the forward (``h_in + (h_out − h_in).detach()``)
instead of the module's backward switch.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_close, assert_normalised, logit_scale

import countlens
from countlens.circuits.engine.pair_batch import logit_diff, prepare_pairs
from countlens.circuits.methods.atp_star import SUPPORTED, atp_star, key_shift
from countlens.circuits.methods.patching import attribution_patch
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError

LAYER, HEAD = 1, 2  # the head whose QK fix the reference recomputes (kv head 1 of the organism's 2)
SATURATED = 3  # the layer whose q_proj the saturation test scales (its head HEAD is the one measured)


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


def _pairs(vlm, n=3, order="stratified"):
    return count_pairs(n, kind="shapes", grid=vlm.geometry, prompt="short", counts=range(2, 7), seed=4, order=order)


def _rotate_half(x):
    return torch.cat([-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]], -1)


def _forward(vlm, batch, drop=None, grad=False):
    """Plain hooks: per layer z (o_proj's input), and for the softmax layers q, k (rotary applied
    here) and v per head, (batch, heads, seq, d_head); ``drop``: that layer's output detached from
    its input's graph; with ``grad`` the last-position logits keep the graph to every z."""
    arch, model = vlm.arch, vlm.hf
    rec, handles, ins = {"z": {}, "q": {}, "k": {}, "v": {}, "rope": {}}, [], {}

    def split(t):
        b, s, _ = t.shape
        return t.view(b, s, -1, arch.d_head).transpose(1, 2)

    for layer in range(arch.n_layers):
        attn = model.get_submodule(arch.attention(layer))

        def keep_z(m, args, layer=layer):
            if grad and not args[0].requires_grad:
                args[0].requires_grad_(True)
            rec["z"][layer] = args[0]

        handles += [
            model.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(keep_z),
            attn.register_forward_pre_hook(
                lambda m, a, kw, layer=layer: rec["rope"].__setitem__(layer, kw["position_embeddings"]),
                with_kwargs=True,
            ),
        ]
        for name in ("q", "k", "v"):
            proj = getattr(attn, f"{name}_proj")
            handles.append(
                proj.register_forward_hook(lambda m, a, out, name=name, layer=layer: rec[name].__setitem__(layer, out))
            )
        if layer == drop:
            block = model.get_submodule(arch.layer(layer))
            handles += [
                block.register_forward_pre_hook(
                    lambda m, a, kw: ins.__setitem__("h", a[0] if a else kw["hidden_states"]), with_kwargs=True
                ),
                block.register_forward_hook(lambda m, a, out: ins["h"] + (out - ins["h"]).detach()),
            ]
    try:
        with torch.set_grad_enabled(grad):
            logits = model(**batch.inputs, use_cache=False).logits[:, -1].float()
    finally:
        for h in handles:
            h.remove()
    for layer in range(arch.n_layers):
        cos, sin = (t.unsqueeze(1).double() for t in rec["rope"][layer])
        for name in ("q", "k"):
            x = split(rec[name][layer].detach()).double()
            rec[name][layer] = x * cos + _rotate_half(x) * sin
        rec["v"][layer] = split(rec["v"][layer].detach()).double()
    return logits, rec


def _heads(t, arch):
    """(batch, seq, heads·d_head) → (batch, seq, heads, d_head), float64."""
    return t.detach().double().view(*t.shape[:2], -1, arch.d_head)


def _softmax_rows(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)


def _reference(vlm, pairs):
    """Per pair: AtP's Δz·G for every head, and the QK fix's Δz·G for (LAYER, HEAD), under the plain
    gradient (index 0) and with each layer dropped (index 1 + ℓ); and the two runs' LD sums."""
    arch = vlm.arch
    pb = prepare_pairs(vlm, pairs)
    with torch.no_grad():
        lx, x = _forward(vlm, pb.corrupt)
    real = pb.clean.inputs["attention_mask"].bool()
    seq = real.shape[1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None] & real[:, None, :]  # batch query key
    kv = HEAD // (arch.n_heads // arch.n_kv_heads)
    out = {"z": [], "q": [], "k": [], "v": []}
    for drop in [None, *range(arch.n_layers)]:
        lc, c = _forward(vlm, pb.clean, drop=drop, grad=True)
        ld = logit_diff(lc, pb.clean_id, pb.corrupt_id)
        layers = list(range(arch.n_layers))
        grads = torch.autograd.grad(ld.sum(), [c["z"][la] for la in layers], allow_unused=True)
        g = [torch.zeros_like(c["z"][la]) if gr is None else gr for la, gr in zip(layers, grads)]
        g = [_heads(t, arch) * real[..., None, None] for t in g]
        out["z"].append(
            torch.stack(
                [(g[la] * (_heads(x["z"][la], arch) - _heads(c["z"][la], arch))).sum((1, 3)) for la in layers], 1
            )
        )
        q, k, v = c["q"][LAYER][:, HEAD], c["k"][LAYER][:, kv], c["v"][LAYER][:, kv]
        qx, kx, vx = x["q"][LAYER][:, HEAD], x["k"][LAYER][:, kv], x["v"][LAYER][:, kv]
        scale = arch.d_head**-0.5
        scores = q @ k.transpose(-1, -2) * scale
        a = _softmax_rows(scores, allowed)
        dq = (_softmax_rows(qx @ k.transpose(-1, -2) * scale, allowed) - a) @ v
        dk = torch.zeros_like(dq)
        for t in range(seq):  # key t alone patched: its column of the scores, the rows recomputed
            patched = scores.clone()
            patched[..., t] = (q @ kx[:, t, :, None]).squeeze(-1) * scale
            dk += (_softmax_rows(patched, allowed) - a) @ v
        dv = a @ (vx - v)
        gh = g[LAYER][:, :, HEAD]
        for name, d in (("q", dq), ("k", dk), ("v", dv)):
            out[name].append((gh * d).sum((1, 2)))
        clean_ld = float(ld.detach().sum())
    corrupt_ld = float(logit_diff(lx, pb.clean_id, pb.corrupt_id).sum())
    return {name: torch.stack(v) for name, v in out.items()}, corrupt_ld - clean_ld


@pytest.fixture(scope="module")
def reference(organism):
    pairs = _pairs(organism)
    return pairs, *_reference(organism, pairs)


@pytest.mark.numeric
def test_qk_fix_matches_a_plain_torch_recomputation(organism, reference, one_thread):
    pairs, ref, denom = reference
    got = atp_star(organism, pairs, batch_size=2, graddrop=False)
    assert got.attrs["method"] == "atp+qk-fix"
    for name in ("q", "k", "v"):
        want = float(ref[name][0].sum()) / denom
        assert_close(got[f"{name}_effect"].sel(layer=LAYER, head=HEAD), want, what=f"{name} effect")
    # Without GradDrop the head's z keeps AtP's estimate, through the same gradient.
    assert_close(got.effect, (ref["z"][0].sum(0) / denom).numpy(), what="z effect")
    assert_close(got.effect, attribution_patch(organism, pairs, batch_size=2).effect, what="AtP's effect")
    last = atp_star(organism, pairs, batch_size=2, positions="last", graddrop=False)
    assert_close(last.effect, attribution_patch(organism, pairs, positions="last").effect, what="AtP at 'last'")
    assert not np.allclose(last.q_effect.values, got.q_effect.values)  # the queries patched are the last rows only


@pytest.mark.numeric
def test_qk_fix_matches_a_plain_torch_recomputation_on_qwen2_5_vl(loaded, one_thread):
    """The other supported family: Qwen2.5-VL's text attention (tiny: 2 layers, 4 heads on 2 kv heads)."""
    vlm = loaded("qwen2_5_vl")
    side = TINY_IMAGE_SIZE["qwen2_5_vl"][0]
    pairs = count_pairs(2, 3, 5, kind="polygons", image_size=side, prompt="short", seed=4)
    ref, denom = _reference(vlm, pairs)
    got = atp_star(vlm, pairs, batch_size=2, graddrop=False)
    # Normalised effects: the logits' rounding over the denominator, which this random-init model's
    # pairs make small (tests/tolerance.py).
    close = partial(
        assert_normalised,
        denominator=denom,
        n=len(pairs),
        scale=logit_scale(vlm, prepare_pairs(vlm, pairs)),
        want_rounded=True,
    )
    for name in ("q", "k", "v"):
        want = float(ref[name][0].sum()) / denom
        close(got[f"{name}_effect"].sel(layer=LAYER, head=HEAD), want, what=f"qwen2_5_vl {name} effect")
    close(got.effect, (ref["z"][0].sum(0) / denom).numpy(), what="qwen2_5_vl z effect")


@pytest.mark.numeric
def test_graddrop_matches_a_plain_torch_recomputation(organism, reference, one_thread):
    pairs, ref, denom = reference
    n_layers = organism.arch.n_layers
    got = attribution_patch(organism, pairs, batch_size=2, method="atp*")
    assert got.attrs["method"] == "atp*" and got.attrs["graddrop"] == 1

    def graddrop(per_pair):  # (1 + L, pairs, …): the paper's (1/(L−1)) Σ_ℓ |Î_ℓ| per pair, over |denominator|
        return (per_pair[1:].abs().sum((0, 1)) / (n_layers - 1) / abs(denom)).numpy()

    assert_close(got.effect, graddrop(ref["z"]), what="AtP* effect")
    for name in ("q", "k", "v"):
        assert_close(got[f"{name}_effect"].sel(layer=LAYER, head=HEAD), graddrop(ref[name]), what=f"AtP* {name}")
    # A head's own layer dropped sends it no gradient: that is why the paper divides by L − 1.
    assert torch.all(torch.stack([ref["z"][1 + la][:, la] for la in range(n_layers)]) == 0)
    assert np.all(got.effect.values >= 0)


@pytest.mark.numeric
def test_key_shift_stays_exact_where_attention_saturates():
    """The fast K fix against one softmax per patched key, on rows whose top weight is 1 − 10⁻²⁰ and
    patched keys that beat or lose to it by hundreds of logits."""
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 3, 7, 4
    scores = torch.randn(b, h, s, s, generator=g, dtype=torch.float64)
    scores[..., 2] += 46.0  # key 2 takes 1 − e^−46 of every row it is in
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    key_scores = (scores + 300 * torch.randn(b, h, s, s, generator=g, dtype=torch.float64)).masked_fill(
        ~allowed, float("-inf")
    )
    v = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    z = torch.softmax(scores, -1) @ v
    want = torch.zeros_like(z)
    for t in range(s):
        patched = scores.clone()
        patched[..., t] = key_scores[..., t]
        want += torch.softmax(patched, -1) @ v - z
    got = key_shift(scores, key_scores, v, z, torch.ones(b, 1, s, 1, dtype=torch.bool))
    # float64 throughout, z and v of size ≈ 1: the two ways round ≈ 1e-16 apart; 1e-12 leaves 10⁴ ulps for the
    # saturated rows' cancellations and still fails any formula error.
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_qk_fix_tracks_a_saturated_head_where_the_gradient_does_not(one_thread):
    """A head's attention saturated (its layer's q_proj scaled): patching its query moves the
    attention from one token to another. AtP on q linearises the softmax, whose gradient is ≈ 0 there;
    the QK fix recomputes the attention and lands near the exact patch of the query."""
    vlm = countlens.load("toy")  # a private copy: its weights are edited
    arch = vlm.arch
    attn = vlm.hf.get_submodule(arch.attention(SATURATED))
    with torch.no_grad():
        attn.q_proj.weight.mul_(30.0)
        attn.q_proj.bias.mul_(30.0)
    pairs = _pairs(vlm, 4, order="cycle")  # the pairs the figures below were measured on: (2, 3) … (2, 6)
    pb = prepare_pairs(vlm, pairs)
    cols = slice(HEAD * arch.d_head, (HEAD + 1) * arch.d_head)
    with torch.no_grad():
        lx, x = _forward(vlm, pb.corrupt)
    q_corrupt = x["q"][SATURATED][:, HEAD]
    # The exact patch: the head's query columns of q_proj's output from the corrupt run.
    raw = {}
    h = attn.q_proj.register_forward_hook(lambda m, a, out: raw.__setitem__("q", out))
    with torch.no_grad():
        vlm.hf(**pb.corrupt.inputs, use_cache=False)
    h.remove()

    def patch(m, a, out):
        out = out.clone()
        out[..., cols] = raw["q"][..., cols]
        return out

    h = attn.q_proj.register_forward_hook(patch)
    with torch.no_grad():
        patched = logit_diff(
            vlm.hf(**pb.clean.inputs, use_cache=False).logits[:, -1].float(), pb.clean_id, pb.corrupt_id
        )
    h.remove()
    # AtP on the query: the gradient through the softmax times the query's change.
    grabbed = {}

    def keep(m, a, out):
        out.requires_grad_(True)
        grabbed["q"] = out
        return out

    h = attn.q_proj.register_forward_hook(keep)
    for p in vlm.hf.parameters():
        p.requires_grad_(False)
    with torch.enable_grad():
        lc, c = _forward(vlm, pb.clean, grad=True)
        ld = logit_diff(lc, pb.clean_id, pb.corrupt_id)
        (grad,) = torch.autograd.grad(ld.sum(), [grabbed["q"]])
    h.remove()
    denom = float(logit_diff(lx, pb.clean_id, pb.corrupt_id).sum() - ld.detach().sum())
    exact = float((patched - ld.detach()).sum()) / denom
    linear = float((grad[..., cols] * (raw["q"][..., cols] - grabbed["q"][..., cols].detach())).sum()) / denom
    fixed = float(atp_star(vlm, pairs, batch_size=4, graddrop=False).q_effect.sel(layer=SATURATED, head=HEAD))
    # The premise: the head's last-position attention is saturated on the clean run.
    kv = HEAD // (arch.n_heads // arch.n_kv_heads)
    last = torch.einsum("bd,bsd->bs", c["q"][SATURATED][:, HEAD, -1], c["k"][SATURATED][:, kv]) * arch.d_head**-0.5
    real = pb.clean.inputs["attention_mask"].bool()
    assert float(torch.softmax(last.masked_fill(~real, float("-inf")), -1).max(-1).values.min()) > 0.99
    assert not torch.equal(q_corrupt, c["q"][SATURATED][:, HEAD])
    # The gradient misses the patch (measured: AtP on q 0.0000, exact −0.0174, QK fix −0.0191).
    assert abs(linear) < 0.1 * abs(exact), (linear, exact)
    assert abs(fixed - exact) < 0.25 * abs(exact), (fixed, exact)


def test_atp_is_the_default_and_unchanged(organism):
    pairs = _pairs(organism, 2)
    default = attribution_patch(organism, pairs, batch_size=2)
    named = attribution_patch(organism, pairs, batch_size=2, method="atp")
    assert np.array_equal(default.effect.values, named.effect.values, equal_nan=True)
    assert np.array_equal(default.resid_effect.values, named.resid_effect.values)
    assert default.attrs["method"] == named.attrs["method"] == "attribution_patch"


def test_bad_method_and_unsupported_models_are_refused(organism, loaded):
    pairs = _pairs(organism, 2)
    with pytest.raises(InputError, match=r"'atp', 'atp\*'"):
        attribution_patch(organism, pairs, method="AtP-star")
    other = loaded("llava")
    assert other.arch.name not in SUPPORTED
    with pytest.raises(InputError, match=r"llava.*use method='atp'"):
        attribution_patch(other, pairs, method="atp*")
