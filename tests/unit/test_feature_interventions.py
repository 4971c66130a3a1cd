"""Feature interventions in the real model (`countlens.features.interventions`) and the graph's predicted
effects against them (`countlens.features.effects.feature_effects`): each edit against a plain forward hook
that writes ``y + (a'_f − a_f) · W_dec[f]`` at one position (an independent re-implementation), the
identities between the edits, the effects' columns, and every refusal before any forward."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from test_transcoders import random_set

from countlens.circuits import intervene
from countlens.circuits.sites.positions import Mask
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError
from countlens.features import attribution_graph, removal_effects
from countlens.features.effects import agreement, feature_effects
from countlens.features.interventions import clamp_feature, remove_feature, steer_feature
from countlens.features.transcoder import TranscoderSet

#: Two float32 forwards of the organism that differ in where one MLP write is added (an engine hook
#: rewriting the output against a plain hook adding to it): logits of order 10 agree to rounding.
TOL = 1e-4


@pytest.fixture(scope="module")
def setup(small_transcoders, loaded):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    vlm = loaded("toy")
    sample = task_samples("count", 4, seed=0)[1]
    graph = attribution_graph(vlm, small_transcoders, sample, max_features=64, batch_size=16)
    yield vlm, small_transcoders, sample, graph
    torch.set_num_threads(before)


def at(sample, graph, pos: int) -> Mask:
    where = torch.zeros(1, len(graph.tokens), dtype=torch.bool)
    where[0, pos] = True
    return Mask(where, samples=[sample])


@torch.no_grad()
def logits(vlm, sample, edits=None) -> torch.Tensor:
    batch = vlm.prepare_samples([sample])
    if edits is None:
        return vlm.forward(batch).logits[0, -1].float()
    with intervene(vlm, edits):
        return vlm.forward(batch).logits[0, -1].float()


@torch.no_grad()
def hooked_logits(vlm, tcs, sample, layer, pos, f, new) -> torch.Tensor:
    """The last position's logits with ``new(a_f)`` in place of feature f's activation at ``pos`` by a
    plain forward hook on the MLP module: its output plus (new − a_f) · W_dec[f] there."""
    tc = tcs.layer(layer)

    def hook(module, args, output):
        a_f = tc.encode(args[0][0, pos].float())[f]
        out = output.clone()
        out[0, pos] += ((new(a_f) - a_f) * tc.W_dec[f]).to(out.dtype)
        return out

    handle = vlm.hf.get_submodule(vlm.arch.mlp(layer)).register_forward_hook(hook)
    try:
        return logits(vlm, sample)
    finally:
        handle.remove()


def top_node(graph) -> int:
    """The layer-0 feature node of largest activation (its write reaches later positions through attention)."""
    return int(graph.activations.masked_fill(graph.features[:, 0] != 0, -1).argmax())


def top_feature(graph) -> tuple[int, int, int]:
    return tuple(int(v) for v in graph.features[top_node(graph)])


@pytest.mark.parametrize(
    "edit, new",
    [
        (lambda tcs, layer, f, where: remove_feature(tcs, layer, f, positions=where), lambda a: a * 0),
        (lambda tcs, layer, f, where: clamp_feature(tcs, layer, f, 10.0, positions=where), lambda a: a * 0 + 10),
        (lambda tcs, layer, f, where: steer_feature(tcs, layer, f, 3.0, positions=where), lambda a: 3 * a),
    ],
    ids=["remove", "clamp", "steer"],
)
def test_an_edit_is_the_feature_rewritten_at_its_position(setup, edit, new):
    vlm, tcs, sample, graph = setup
    layer, pos, f = top_feature(graph)
    got = logits(vlm, sample, [edit(tcs, layer, f, at(sample, graph, pos))])
    want = hooked_logits(vlm, tcs, sample, layer, pos, f, new)
    clean = logits(vlm, sample)
    assert (want - clean).abs().max() > 100 * TOL  # the edit moves the logits
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_identities_between_the_edits(setup):
    vlm, tcs, sample, graph = setup
    layer, pos, f = top_feature(graph)
    where = at(sample, graph, pos)
    act = float(graph.activations[top_node(graph)])
    clean = logits(vlm, sample)
    # y + (a_f − a_f)·W_dec: the error held is the whole difference, so nothing moves
    torch.testing.assert_close(logits(vlm, sample, [steer_feature(tcs, layer, f, 1.0, positions=where)]), clean)
    torch.testing.assert_close(logits(vlm, sample, [clamp_feature(tcs, layer, f, act, positions=where)]), clean)
    removed = logits(vlm, sample, [remove_feature(tcs, layer, f, positions=where)])
    torch.testing.assert_close(logits(vlm, sample, [steer_feature(tcs, layer, f, 0.0, positions=where)]), removed)
    # an edit at every position reaches further than one at the feature's own (layer 0, attention after it)
    everywhere = logits(vlm, sample, [clamp_feature(tcs, layer, f, 2 * act)])
    assert not torch.allclose(everywhere, logits(vlm, sample, [clamp_feature(tcs, layer, f, 2 * act, positions=where)]))


def test_feature_effects_columns(setup):
    vlm, tcs, sample, graph = setup
    ds = feature_effects(vlm, tcs, graph, sample, features=6, factor=2.5)
    assert ds.sizes["node"] == 6
    nodes = torch.tensor(ds["node"].values)
    target = int(graph.logit_tokens[0])
    np.testing.assert_allclose(ds["removal_graph"], removal_effects(graph, target)[nodes].numpy(), rtol=1e-6)
    np.testing.assert_allclose(ds["steer_graph"], -1.5 * ds["removal_graph"].values, rtol=1e-6)
    assert (ds[["layer", "position", "feature"]].to_array().values.T == graph.features[nodes].numpy()).all()
    # the real removal of the first node, re-measured by a plain hook
    layer, pos, f = (int(ds[v][0]) for v in ("layer", "position", "feature"))
    clean, gone = logits(vlm, sample), hooked_logits(vlm, tcs, sample, layer, pos, f, lambda a: a * 0)
    want = float((gone[target] - gone.mean()) - (clean[target] - clean.mean()))
    assert math.isclose(float(ds["removal_real"][0]), want, abs_tol=TOL)
    rho = spearmanr(ds["removal_graph"], ds["removal_real"]).statistic
    assert math.isclose(ds.attrs["removal_spearman"], rho, abs_tol=1e-12)
    same = (np.sign(ds["steer_graph"].values) * np.sign(ds["steer_real"].values) > 0).mean()
    assert math.isclose(ds.attrs["steer_same_sign"], same)
    assert ds.attrs["model"] and ds.attrs["target"] == target and ds.attrs["factor"] == 2.5
    # by node index; factor 0 steers as removal does
    again = feature_effects(vlm, tcs, graph, sample, features=[int(nodes[0])], factor=0.0)
    assert math.isclose(float(again["steer_real"][0]), float(ds["removal_real"][0]), abs_tol=TOL)
    assert math.isnan(again.attrs["removal_spearman"])  # one feature: no rank correlation


def test_agreement_counts_signs():
    rho, same = agreement(np.array([1.0, -2.0, 3.0, 0.5]), np.array([2.0, -1.0, 0.0, -0.1]))
    assert same == 0.5 and math.isclose(rho, spearmanr([1, -2, 3, 0.5], [2, -1, 0, -0.1]).statistic)


def test_refusals_before_any_forward(setup):
    vlm, tcs, sample, graph = setup
    other = next(s for s in task_samples("count", 16, seed=0) if s.question != sample.question)
    no_logits = dataclasses.replace(graph, logit_tokens=graph.logit_tokens[:0], logit_probs=graph.logit_probs[:0])
    width = tcs.layer(0).d_transcoder
    cases = [
        (lambda: remove_feature(tcs, 0, width), f"features 0 … {width - 1}"),
        (lambda: remove_feature(tcs, 0, -1), "feature"),
        (lambda: remove_feature(tcs, 99, 0), "no layer 99"),
        (lambda: remove_feature("tcs", 0, 0), "TranscoderSet"),
        (lambda: clamp_feature(tcs, 0, 0, float("nan")), "finite number"),
        (lambda: clamp_feature(tcs, 0, 0, "1"), "finite number"),
        (lambda: steer_feature(tcs, 0, 0, float("inf")), "finite number"),
        (lambda: steer_feature(tcs, 0, 0, 2.0, positions="nowhere"), "token group"),
        (lambda: feature_effects(vlm, tcs, graph, sample, factor=float("-inf")), "finite number"),
        (lambda: feature_effects(vlm, tcs, no_logits, sample), "no logit nodes"),
        (lambda: feature_effects(vlm, tcs, graph, sample, logit=99999), "no logit node"),
        (lambda: feature_effects(vlm, tcs, graph, other), "another prompt"),
        (lambda: feature_effects(vlm, tcs, graph, sample, features=0), "features"),
        (lambda: feature_effects(vlm, tcs, graph, sample, features=[graph.n_features]), "past the graph"),
        (lambda: feature_effects(vlm, tcs, graph, sample, features=[]), "empty"),
        (lambda: feature_effects(vlm, tcs, "graph", sample), "AttributionGraph"),
    ]
    forwards = []
    handle = vlm.hf.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        for call, words in cases:
            with pytest.raises(InputError, match=words):
                call()
    finally:
        handle.remove()
    assert not forwards


def test_a_graph_of_another_scene_or_transcoder_set_is_refused(setup):
    """Same prompt, another scene: refused before any forward (the image tokens' objects differ). Another
    transcoder set without a scan name: refused at the clean forward (the features' activations differ)."""
    vlm, tcs, sample, graph = setup
    twin = next(s for s in task_samples("count", 16, seed=1) if s.question == sample.question)
    with pytest.raises(InputError, match="another scene"):
        feature_effects(vlm, tcs, graph, twin, features=2)
    other = TranscoderSet(list(random_set(width=tcs.d_transcoder, k=4)), model_name="toy", scan="")
    with pytest.raises(InputError, match="other transcoders"):
        feature_effects(vlm, other, graph, sample, features=2)
