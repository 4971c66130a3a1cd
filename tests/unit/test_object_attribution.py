"""Object attribution (`countlens.circuits.objects.gradients`): AtP per object is (x_clean − x_background) ·
∂LD/∂x summed over the object's tokens, as plain torch autograd computes it; EAP-IG's objects, background
and text add up to the whole image's change (completeness), closer as the steps grow; refusals come
before any forward. Edges by object span (`countlens.circuits.objects.edges`): EAP per (object,
receiver) is the difference times the gradient through that receiver alone, as plain torch computes it
with a zero leaf on each receiver's copy of the stream; an object's edges over every receiver add up
to its node score, and the spans with the background to the whole image's edge of `edge_attribution`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tolerance import assert_close

import countlens.circuits.objects.edges as oe
import countlens.circuits.objects.gradients as oa
from countlens.circuits import Objects, edge_attribution, edge_graph, object_attribution, object_edge_attribution
from countlens.circuits.sites import Residual
from countlens.datasets import countingtricks
from countlens.errors import InputError


def _scenes(vlm, n=3, cases=("1A", "4A"), **kw):
    return countingtricks(list(cases), n, grid=vlm.geometry, seed=0, **kw)


def _run(vlm, image, question, forced, ids, leaf=None):
    """One forward of ``image``: (its batch, the text model's input embeddings, LD), the embeddings
    replaced by ``leaf`` when given."""
    text_model = vlm.hf.get_submodule("model.language_model")
    batch = vlm.prepare([image], [question], forced=[forced])
    seen = {}

    def pre(module, args, kwargs):
        seen["x"] = kwargs["inputs_embeds"] if leaf is None else leaf
        return args, {**kwargs, "inputs_embeds": seen["x"]}

    handle = text_model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        logits = vlm.hf(**batch.inputs).logits[0, -1].float()
    finally:
        handle.remove()
    return batch, seen["x"], logits[ids[0]] - logits[ids[1]]


def _by_hand(vlm, samples):
    """AtP per object with plain torch: the language model's input embeddings (the text embeddings with
    the image tokens in place) taken by a hook on the text model, LD = logit(n) − logit(n − 1) read after
    the answers' shared prefix, one autograd gradient at the clean input."""
    out = []
    for sample in samples:
        n = len(sample.scene.objects)
        good, bad = vlm.answer_ids(sample.answer), vlm.answer_ids(sample.answer.replace(str(n), str(n - 1)))
        k = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
        ask = (sample.question, good[:k], (good[k], bad[k]))
        background = dataclasses.replace(sample.scene, objects=())
        with torch.no_grad():
            _, x_ref, _ = _run(vlm, background.render(), *ask)
            _, x_clean, _ = _run(vlm, sample.image, *ask)
        leaf = x_clean.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            batch, _, ld = _run(vlm, sample.image, *ask, leaf=leaf)
            (grad,) = torch.autograd.grad(ld, leaf)
        products = ((x_clean.double() - x_ref.double()) * grad.double()).sum(-1)[0]
        size = ((x_clean.double() - x_ref.double()) * grad.double()).abs().sum(-1)[0]
        spans = [Objects(i).tokens(batch, 0, sample) for i in range(n)]
        out.append(([float(products[s].sum()) for s in spans], [float(size[s].sum()) for s in spans]))
    return out


@pytest.mark.numeric
def test_atp_is_the_gradient_times_the_difference(loaded):
    vlm = loaded("toy")
    samples = _scenes(vlm, 2)
    ds = object_attribution(vlm, samples, method="atp", batch_size=3)
    assert ds.score.dims == ("scene", "object") and ds.attrs["method"] == "atp" and ds.attrs["steps"] == 1
    for s, (want, sizes) in enumerate(_by_hand(vlm, samples)):
        got = ds.score.isel(scene=s).values[: len(want)]
        assert_close(got, want, scale=max(1.0, *sizes), what=f"scene {s}: AtP per object")
        assert np.isnan(ds.score.isel(scene=s).values[len(want) :]).all()


def test_the_parts_account_for_every_token(loaded):
    """Σ scores − overlap = the spans' union; objects + background + text = Σ over every token."""
    vlm = loaded("toy")
    samples = _scenes(vlm, 2, cases=("4A",))
    ds = object_attribution(vlm, samples, method="atp")
    # float64 sums of the same per-token scores, grouped two ways: ≈ 1e-16 of their size apart, ≪ 1e-9.
    np.testing.assert_allclose(ds.score.sum("object") - ds.overlap, ds.objects, atol=1e-9)
    assert (ds.text == 0).all()  # at the embeddings the text is the same in both inputs
    assert int(ds.tokens.max()) == 4  # an object on a grid intersection owns its four cells


@pytest.mark.numeric
def test_integrated_gradients_are_complete(loaded):
    """objects + background + text = m(clean) − m(reference) up to the Riemann sum's error, smaller with
    more steps; a one-object scene's object and background make the whole."""
    vlm = loaded("toy")
    samples = [*_scenes(vlm, 2, cases=("1A",)), *_scenes(vlm, 1, cases=("1A",), counts=(1,))]
    coarse, fine = (object_attribution(vlm, samples, method="eap-ig", steps=s) for s in (4, 32))
    assert coarse.attrs["method"] == "eap-ig" and fine.attrs["steps"] == 32
    err_coarse, err_fine = np.abs(coarse.completeness_error.values), np.abs(fine.completeness_error.values)
    assert err_fine.mean() < err_coarse.mean() / 4
    assert (err_fine <= 0.1 * np.maximum(1.0, np.abs(fine.image_total.values))).all()
    one = fine.isel(scene=-1)
    assert int(one["count"]) == 1 and np.isnan(one.score.values[1:]).all()
    whole = float(one.score[0] + one.background)
    # The completeness error is that same float64 difference: only the order of a few float64 sums differs.
    assert abs(whole - float(one.image_total)) == pytest.approx(abs(float(one.completeness_error)), abs=1e-9)


def test_a_later_layer_attributes_the_text_too(loaded):
    vlm = loaded("toy")
    ds = object_attribution(vlm, _scenes(vlm, 1, cases=("1A",)), method="eap-ig", steps=2, site=Residual(2))
    assert ds.attrs["site"] == "L2.resid" and float(abs(ds.text).max()) > 0


def test_refusals_come_before_any_forward(loaded, monkeypatch):
    vlm = loaded("toy")
    samples = _scenes(vlm, 1, cases=("1A",))

    def no_forward(*args, **kw):
        raise AssertionError("a forward ran before the arguments were checked")

    monkeypatch.setattr(oa, "per_token", no_forward)
    refused = {
        "method": dict(method="ig"),
        "one gradient": dict(method="atp", steps=4),
        "steps": dict(method="eap-ig", steps=0),
        "coverage": dict(coverage=1.5),
        "batch_size": dict(batch_size=0),
        "after the last layer": dict(site=Residual(vlm.arch.n_layers - 1)),
        "write Residual\\(-1\\)": dict(site="embed"),
        "write Residual\\(2\\)": dict(site=2),
    }
    for match, kw in refused.items():
        with pytest.raises(InputError, match=match):
            object_attribution(vlm, samples, **kw)
    loaded_image = dataclasses.replace(samples[0], scene=dataclasses.replace(samples[0].scene, objects=()))
    with pytest.raises(InputError, match="no object list"):
        object_attribution(vlm, [samples[0], loaded_image])
    with pytest.raises(InputError, match="exactly once"):
        object_attribution(vlm, [dataclasses.replace(samples[0], answer="many")])


def test_a_method_the_family_refuses_is_refused(loaded):
    vlm = loaded("toy")
    scenes = _scenes(vlm, 1, cases=("1A",))
    with pytest.raises(InputError, match="method='atp' does not run on .*no gradients here"):
        oa.check_request(
            vlm,
            scenes,
            "atp",
            None,
            0.25,
            16,
            Residual(-1),
            "object_attribution",
            refusal=lambda vlm: "no gradients here",
        )


# Edge attribution by object span (`countlens.circuits.objects.edges`): object → receiver.


def _receiver_gradients_by_hand(vlm, image, ask, leaf):
    """∂LD/∂x_r of every receiver r with plain torch, labelled as edges name them: a zero leaf δ_r is
    added to r's own copy of the residual stream (a head's q / kv head's k, v: its projection's columns
    recomputed from norm(x + δ_r); an MLP: its norm's input; the logits: the final norm's input), one
    forward at layer 0's input ``leaf``, one backward."""
    text = vlm.hf.get_submodule("model.language_model")
    seq = vlm.prepare([image], [ask[0]], forced=[ask[1]]).inputs["input_ids"].shape[1]
    deltas, hooks, inputs = {}, [], {}

    def zero(label):
        deltas[label] = torch.zeros(1, seq, leaf.shape[-1], requires_grad=True)
        return deltas[label]

    for layer, block in enumerate(text.layers):
        attn, heads = block.self_attn, vlm.arch.heads(layer)
        width = attn.q_proj.out_features // heads
        norm = block.input_layernorm
        hooks.append(norm.register_forward_hook(lambda m, args, out, layer=layer: inputs.__setitem__(layer, args[0])))
        for part, proj in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)):
            count = proj.out_features // width
            label = [f"L{layer}H{h}.q" if part == "q" else f"L{layer}K{h}.{part}" for h in range(count)]
            ds = [zero(x) for x in label]

            def projection(m, args, out, layer=layer, ds=ds, norm=norm, w=width):
                cols = [m.forward(norm.forward(inputs[layer] + d))[..., h * w : (h + 1) * w] for h, d in enumerate(ds)]
                return torch.cat(cols, -1)

            hooks.append(proj.register_forward_hook(projection))
        mlp = zero(f"MLP{layer}.in")
        hooks.append(block.post_attention_layernorm.register_forward_hook(lambda m, a, o, d=mlp: m.forward(a[0] + d)))
    d_out = zero("logits")
    hooks.append(text.norm.register_forward_pre_hook(lambda m, args, d=d_out: (args[0] + d,)))
    try:
        with torch.enable_grad():
            _, _, ld = _run(vlm, image, *ask, leaf=leaf)
            grads = torch.autograd.grad(ld, list(deltas.values()))
    finally:
        for h in hooks:
            h.remove()
    return dict(zip(deltas, grads))


def _edges_by_hand(vlm, samples):
    """EAP per (object, receiver): (x_clean − x_background) · ∂LD/∂x_r summed over the object's tokens, and
    the size of the summed products (the rounding's scale)."""
    out = []
    for sample in samples:
        n = len(sample.scene.objects)
        good, bad = vlm.answer_ids(sample.answer), vlm.answer_ids(sample.answer.replace(str(n), str(n - 1)))
        k = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
        ask = (sample.question, good[:k], (good[k], bad[k]))
        with torch.no_grad():
            _, x_ref, _ = _run(vlm, dataclasses.replace(sample.scene, objects=()).render(), *ask)
            batch, x_clean, _ = _run(vlm, sample.image, *ask)
        grads = _receiver_gradients_by_hand(vlm, sample.image, ask, x_clean.detach().clone())
        diff = x_clean.double() - x_ref.double()
        spans = [Objects(i).tokens(batch, 0, sample) for i in range(n)]
        score, size = {}, 0.0
        for label, g in grads.items():
            products = (diff * g.double()).sum(-1)[0]
            score[label] = [float(products[s].sum()) for s in spans]
            size = max(size, float((diff * g.double()).abs().sum()))
        out.append((score, size))
    return out


@pytest.mark.numeric
def test_object_edges_are_the_receiver_gradient_times_the_difference(loaded):
    vlm = loaded("toy")
    samples = _scenes(vlm, 1)
    ds = object_edge_attribution(vlm, samples, method="eap", batch_size=2)
    assert ds.score.dims == ("scene", "object", "receiver") and ds.attrs["method"] == "eap"
    assert list(ds.receiver.values) == [r.label for r in edge_graph(vlm).receivers]
    for s, (want, size) in enumerate(_edges_by_hand(vlm, samples)):
        assert set(want) == set(ds.receiver.values)
        got = ds.score.isel(scene=s).sel(receiver=list(want)).values[: len(want["logits"])]
        assert_close(got.T, np.array(list(want.values())), scale=max(1.0, size), what=f"scene {s}: EAP per edge")
        assert np.isnan(ds.score.isel(scene=s).values[len(want["logits"]) :]).all()


@pytest.mark.numeric
def test_an_objects_edges_add_up_to_its_node_score(loaded):
    """Σ over every receiver of an object's edges = its node score (the same gradients' points: EAP and
    AtP at the clean input, EAP-IG's steps); the parts account for every image token; EAP-IG's
    objects + background make m(clean) − m(reference) as the node scores do."""
    vlm = loaded("toy")
    samples = _scenes(vlm, 1)
    for edge_method, node_method, steps in (("eap", "atp", None), ("eap-ig", "eap-ig", 3)):
        edges = object_edge_attribution(vlm, samples, method=edge_method, steps=steps)
        nodes = object_attribution(vlm, samples, method=node_method, steps=steps)
        real = ~np.isnan(nodes.score.values)
        scale = max(1.0, float(np.abs(edges.score).sum("receiver").max()))
        summed = edges.score.sum("receiver").values
        assert_close(summed[real], nodes.score.values[real], scale=scale, what=f"{edge_method}: Σ_r edges")
        for part in ("objects", "overlap", "background"):
            assert_close(edges[part].sum("receiver"), nodes[part], scale=scale, what=f"{edge_method}: {part}")
        np.testing.assert_array_equal(edges.tokens.values[real], nodes.tokens.values[real])
        np.testing.assert_allclose(edges.score.sum("object") - edges.overlap, edges.objects, atol=1e-12)
    assert_close(edges.completeness_error, nodes.completeness_error, scale=scale, what="completeness")


@pytest.mark.numeric
def test_the_spans_make_the_whole_image_edge(loaded):
    """Σ_scenes (objects + background) per receiver = −(Σ LD_ref − Σ LD_clean) × edge_attribution's
    IN.image → receiver effect on the (scene, background) pairs."""
    vlm = loaded("toy")
    samples = _scenes(vlm, 1)
    ds = object_edge_attribution(vlm, samples, method="eap")
    pairs = [oa.ReferencePair(s, oa.reference_sample(s)) for s in samples]
    whole = edge_attribution(vlm, pairs, method="eap", steps=1)
    image = whole.effect[whole.upstream.values == "IN.image"]
    assert list(image.receiver.values) == list(ds.receiver.values)
    denom = float((ds.reference_metric - ds.clean_metric).sum())
    mine = (ds.objects + ds.background).sum("scene")
    assert_close(mine, -denom * image.values, what="whole image per receiver")


def test_object_edge_refusals_come_before_any_forward(loaded, monkeypatch):
    vlm = loaded("toy")
    samples = _scenes(vlm, 1, cases=("1A",))

    def no_forward(*args, **kw):
        raise AssertionError("a forward ran before the arguments were checked")

    monkeypatch.setattr(oe, "span_edges", no_forward)
    monkeypatch.setattr(oe, "check_additive", no_forward)
    refused = {
        "method": dict(method="atp"),
        "one gradient": dict(method="eap", steps=4),
        "steps": dict(method="eap-ig", steps=0),
        "coverage": dict(coverage=-0.1),
        "batch_size": dict(batch_size=0),
        "peak": dict(peak="yes"),
    }
    for match, kw in refused.items():
        with pytest.raises(InputError, match=match):
            object_edge_attribution(vlm, samples, **kw)
    with pytest.raises(InputError, match="exactly once"):
        object_edge_attribution(vlm, [dataclasses.replace(samples[0], answer="many")])

    monkeypatch.setattr(oe, "edge_refusal", lambda vlm: "a norm after attention")
    with pytest.raises(InputError, match="method='eap' does not run on .*a norm after attention"):
        object_edge_attribution(vlm, samples)
