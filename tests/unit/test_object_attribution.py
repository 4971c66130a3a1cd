"""Object attribution (`countlens.circuits.object_gradients`): AtP per object is (x_clean − x_background) ·
∂LD/∂x summed over the object's tokens, as plain torch autograd computes it; EAP-IG's objects, background
and text add up to the whole image's change (completeness), closer as the steps grow; refusals come
before any forward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tolerance import assert_close

import countlens.circuits.object_gradients as oa
from countlens.circuits import Objects, object_attribution
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
    assert abs(whole - float(one.image_total)) == pytest.approx(abs(float(one.completeness_error)), abs=1e-9)


def test_a_later_layer_attributes_the_text_too(loaded):
    vlm = loaded("toy")
    ds = object_attribution(vlm, _scenes(vlm, 1, cases=("1A",)), method="eap-ig", steps=2, site=2)
    assert ds.attrs["site"] == "2" and float(abs(ds.text).max()) > 0


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
        "use 'embed'": dict(site=vlm.arch.n_layers - 1),
    }
    for match, kw in refused.items():
        with pytest.raises(InputError, match=match):
            object_attribution(vlm, samples, **kw)
    loaded_image = dataclasses.replace(samples[0], scene=dataclasses.replace(samples[0].scene, objects=()))
    with pytest.raises(InputError, match="no object list"):
        object_attribution(vlm, [samples[0], loaded_image])
    with pytest.raises(InputError, match="exactly once"):
        object_attribution(vlm, [dataclasses.replace(samples[0], answer="many")])


def test_a_method_the_family_refuses_is_refused(loaded, monkeypatch):
    vlm = loaded("toy")

    class Refusing:
        refusal = staticmethod(lambda vlm: "no gradients here")

    monkeypatch.setattr(oa, "registry_method", lambda name: Refusing)
    with pytest.raises(InputError, match="AtP does not run on .*no gradients here"):
        object_attribution(vlm, _scenes(vlm, 1, cases=("1A",)))
