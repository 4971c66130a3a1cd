"""object_effects and object_misses on the organism: the exact object effect against a plain-torch
patch of the same tokens, the background as every object removed, hidden and overlapping objects,
placement classes, refusals before any forward, and the misses table's intervals."""

from __future__ import annotations

import importlib
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xarray as xr

from countlens.analysis import object_misses
from countlens.circuits import Objects, object_effects
from countlens.circuits.sites import Residual
from countlens.datasets import countingtricks
from countlens.datasets.scene import Obj, Scene
from countlens.datasets.tasks import TaskSample
from countlens.errors import InputError
from countlens.model.answers import divergence
from tests.tolerance import assert_close


@pytest.fixture(scope="module")
def toy(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def tricks(toy):
    # One sample each of the four position cases, 3 and 4 circles.
    return [
        countingtricks([c], 1, grid=toy.geometry, seed=0, prompt="short", counts=[3])[0] for c in "1A 2A 3A 4A".split()
    ]


def _plain_ld(vlm, sample, ref_image, tokens: torch.Tensor, layer: int) -> tuple[float, float, float]:
    """(LD clean, LD reference, LD patched) by hand: torch hooks on the HF decoder layer, one sample."""
    n = len(sample.scene.objects)
    fewer = sample.answer.replace(str(n), str(n - 1))
    forced, a, b = divergence(vlm.answer_ids(sample.answer), vlm.answer_ids(fewer))
    clean = vlm.prepare([sample.image], [sample.question], forced=[forced])
    ref = vlm.prepare([ref_image], [sample.question], forced=[forced])
    module = vlm.hf.get_submodule(vlm.arch.layer(max(layer, 0)))
    kept = {}

    def hidden_of(args, kwargs):
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def keep_in(mod, args, kwargs):
        kept["h"] = hidden_of(args, kwargs).detach().clone()

    def keep_out(mod, args, out):
        kept["h"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    def put_in(mod, args, kwargs):
        h = hidden_of(args, kwargs).clone()
        h[0, tokens] = kept["h"][0, tokens]
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": h}
        return (h, *args[1:]), kwargs

    def put_out(mod, args, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[0, tokens] = kept["h"][0, tokens]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def ld(batch, hook=None):
        handle = None
        if hook == "keep":
            handle = (
                module.register_forward_pre_hook(keep_in, with_kwargs=True)
                if layer == -1
                else module.register_forward_hook(keep_out)
            )
        elif hook == "put":
            handle = (
                module.register_forward_pre_hook(put_in, with_kwargs=True)
                if layer == -1
                else module.register_forward_hook(put_out)
            )
        try:
            with torch.no_grad():
                logits = vlm.hf(**batch.inputs, use_cache=False).logits[0, -1].float()
        finally:
            if handle is not None:
                handle.remove()
        return float(logits[a] - logits[b])

    return ld(clean), ld(ref, "keep"), ld(clean, "put")


@pytest.mark.numeric
@pytest.mark.parametrize(("reference", "layer"), [("removed", -1), ("background", 1)])
def test_exact_effect_equals_a_plain_torch_patch(toy, tricks, reference, layer):
    samples = tricks[:2]
    ds = object_effects(toy, samples, reference=reference, site=Residual(layer), batch_size=4)
    for s, i in [(0, 0), (1, 2)]:
        sample = samples[s]
        batch = toy.prepare_samples([sample])
        tokens = Objects(i).tokens(batch, 0, sample).cpu()
        assert int(ds.n_tokens[s, i]) == len(tokens) >= 1
        ref_scene = sample.scene.without([i] if reference == "removed" else range(len(sample.scene.objects)))
        clean, ref, patched = _plain_ld(toy, sample, ref_scene.render(), tokens, layer)
        scale = max(abs(clean), abs(ref), abs(patched), 1.0)
        assert_close(float(ds.clean_logit_diff[s]), clean, scale=scale, what="clean LD")
        assert_close(float(ds.reference_logit_diff[s, i]), ref, scale=scale, what="reference LD")
        assert_close(float(ds.effect[s, i]), clean - patched, scale=scale, what="object effect")


@pytest.mark.numeric
def test_removing_every_object_is_the_background(toy, tricks):
    scene = tricks[0].scene
    emptied = scene
    while emptied.objects:
        emptied = emptied.without([len(emptied.objects) - 1])
    assert np.array_equal(emptied.render_array(), scene.without(range(len(scene.objects))).render_array())
    # A one-object scene: its removed reference is the background, so the two references agree.
    one = TaskSample(replace(scene, objects=scene.objects[:1]), tricks[0].question, "1", "count")
    removed = object_effects(toy, [one], reference="removed")
    background = object_effects(toy, [one], reference="background")
    # One computation by construction: each reference is one run of the same pixels (asserted above) with the
    # same forced answer, one row per forward, and the same patch after it: bit for bit.
    for var in ("reference_logit_diff", "effect", "normalised"):
        np.testing.assert_array_equal(removed[var].values, background[var].values, err_msg=var)


def test_placement_classes_offsets_and_result_layout(toy, tricks):
    ds = object_effects(toy, tricks, reference="background", batch_size=5)
    assert ds.effect.dims == ("scene", "object") and list(ds.scene.values) == [0, 1, 2, 3]
    first = ds.isel(object=0)
    assert list(first.placement.values) == ["centred", "edge", "edge", "intersection"]
    assert list(first.anchor.values) == ["center", "vline", "hline", "cross"]
    np.testing.assert_allclose(first.offset.values, [0, 0.5, 0.5, np.sqrt(0.5)])
    assert list(ds.case.values) == ["1A", "2A", "3A", "4A"]
    assert (ds.size.where(ds.exists) == 1).sum() == 12 and not ds.touches.any()
    assert bool(ds.exists.all()) and np.isfinite(ds.effect).all()
    # Spans: n_tokens counts each object's tokens; the cells are the token grid's.
    assert (ds.covers.sum("token") == ds.n_tokens).all()
    assert int(ds.token_row.max()) == toy.geometry.token_grid[0] - 1
    for key in ("model", "countlens_version", "date", "data_recipe"):
        assert key in ds.attrs
    assert ds.attrs["method"] == "object_effects" and ds.attrs["reference"] == "background"


def _hand_scene(toy, objs, answer=None):
    g = toy.geometry
    scene = Scene(g.image_width, g.image_height, tuple(objs))
    return TaskSample(scene, "how many circles are there in the image?", answer or str(len(objs)), "count")


def test_hidden_object_covers_no_token_and_is_reported_nan(toy):
    sample = _hand_scene(toy, [Obj("circle", "red", 40, 40, 16), Obj("circle", "red", 120, 120, 16)])
    hidden = Obj("circle", "red", -60, -60, 16)  # outside the image: Scene refuses it, so set it past the check
    scene = sample.scene
    object.__setattr__(scene, "objects", scene.objects + (hidden,))
    sample = replace(sample, answer="3")
    ds = object_effects(toy, [sample], reference="removed")
    assert ds.n_tokens.values[0, 2] == 0 and (ds.n_tokens.values[0, :2] >= 1).all()
    assert np.isnan(ds.effect.values[0, 2]) and np.isfinite(ds.effect.values[0, :2]).all()
    assert "no token" in ds.attrs["no_tokens"]


def test_overlapping_objects_share_a_token_and_touching_is_reported(toy):
    g = toy.geometry
    t = g.token_size
    # Two circles overlapping across one token cell, and a third apart.
    objs = [Obj("circle", "red", 1.5 * t, 1.5 * t, 40), Obj("circle", "red", 1.5 * t + 20, 1.5 * t, 40)]
    objs.append(Obj("circle", "red", 4.5 * t, 4.5 * t, 16))
    ds = object_effects(toy, [_hand_scene(toy, objs)], reference="background")
    both = ds.covers[0, 0] & ds.covers[0, 1]
    assert int(both.sum()) >= 1
    assert int(ds.shared_tokens[0, 0]) == int(ds.shared_tokens[0, 1]) == int(both.sum())
    assert int(ds.shared_tokens[0, 2]) == 0
    assert list(ds.touches.values[0]) == [True, True, False]


def test_refusals_come_before_any_forward(toy, tricks, monkeypatch):
    def no_forward(*a, **k):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(importlib.import_module("countlens.circuits.objects.effects"), "cache_run", no_forward)
    with pytest.raises(InputError, match="no object 7"):
        object_effects(toy, tricks[:1], objects=[7])
    loaded_image = SimpleNamespace(image=tricks[0].image, question=tricks[0].question, answer="3", scene=None)
    with pytest.raises(InputError, match="no object list"):
        object_effects(toy, [loaded_image])
    with pytest.raises(InputError, match="covers an image token"):
        object_effects(toy, tricks[:1], coverage=1.0, peak=False)
    with pytest.raises(InputError, match="reference"):
        object_effects(toy, tricks[:1], reference="nothing")
    with pytest.raises(InputError, match="site"):
        object_effects(toy, tricks[:1], site="mlp")
    with pytest.raises(InputError, match="does not name its count"):
        object_effects(toy, [replace(tricks[0], answer="many")])


def _fake_effects(effect, correct, placement, size, touches):
    effect = np.asarray(effect, float)
    return xr.Dataset(
        {
            "effect": (("scene", "object"), effect),
            "exists": (("scene", "object"), np.isfinite(effect)),
            "n_tokens": (("scene", "object"), np.isfinite(effect).astype(int)),
            "placement": (("scene", "object"), np.asarray(placement)),
            "size": (("scene", "object"), np.asarray(size, float)),
            "touches": (("scene", "object"), np.asarray(touches, bool)),
            "clean_correct": ("scene", np.asarray(correct, bool)),
        },
        attrs={"method": "object_effects", "model": "m"},
    )


def test_misses_table_counts_the_least_object_of_wrong_scenes():
    fx = _fake_effects(
        effect=[[1.0, 2.0, np.nan], [0.5, 3.0, 0.2], [4.0, 0.1, 1.0]],
        correct=[True, False, False],
        placement=[["centred", "edge", ""], ["centred", "edge", "intersection"], ["edge", "intersection", "centred"]],
        size=[[1, 1, np.nan], [1, 2, 3], [0.5, 1, 1]],
        touches=[[False, False, False], [True, True, False], [False, False, False]],
    )
    table = object_misses(fx, n_boot=200, seed=1)
    row = table.sel(group="all")
    assert int(row.n_objects) == 8 and int(row.n_wrong_objects) == 6 and int(row.missed) == 2
    inter = table.sel(group="placement:intersection")
    assert int(inter.missed) == 2 and int(inter.n_wrong_objects) == 2 and float(inter.missed_rate) == 1.0
    np.testing.assert_allclose(float(inter.chance_rate), 1 / 3)  # one of three objects in each wrong scene
    np.testing.assert_allclose(float(row.chance_rate), 2 / 6)
    # Wilson 95 % for 2 of 6.
    z, n, p = 1.959963984540054, 6, 2 / 6
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    np.testing.assert_allclose([row.missed_low, row.missed_high], [centre - half, centre + half])
    assert float(row.effect_low) <= float(row.mean_effect) <= float(row.effect_high)
    np.testing.assert_allclose(float(row.mean_effect), np.nansum(fx.effect) / 8)
    assert table.attrs["method"] == "object_misses" and table.attrs["model"] == "m"
    assert table.equals(object_misses(fx, n_boot=200, seed=1))  # the seed fixes the bootstrap
    with pytest.raises(InputError, match="size_bins"):
        object_misses(fx, size_bins=(2.0, 1.0))
    with pytest.raises(InputError, match="wrong"):
        object_misses(fx, wrong=xr.DataArray([True], dims="scene"))


def test_a_reference_with_another_token_layout_is_refused(toy, tricks, monkeypatch):
    module = importlib.import_module("countlens.circuits.objects.effects")
    bigger = replace(tricks[0].scene, width=2 * tricks[0].scene.width, objects=())
    monkeypatch.setattr(module, "without_objects", lambda sample, indices: replace(sample, scene=bigger))
    with pytest.raises(InputError, match="token layout"):
        object_effects(toy, tricks[:1], reference="background")


def test_a_model_without_image_tokens_is_refused_with_the_reason(loaded, tricks):
    from countlens.errors import NoObjectTokensError

    with pytest.raises(NoObjectTokensError, match="no image tokens .*cross-attention"):
        object_effects(loaded("mllama"), tricks)
