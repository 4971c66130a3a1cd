"""Head paths of an attribution graph (`countlens.features.head_paths`) on the organism with tiny
transcoders: the exact linearity identities (direct effects and the no-head part add up to the value,
a layer's paths add up to removing the layer, the image total is the graph's image edges), each head's
path and image share against a plain torch hook on o_proj in the frozen model; with the features
linear, the image total and each head's path against the graph's own feature-to-feature edges
(propagated here by fixed-point iteration); a logit difference (``against``) against the two logits'
paths; recovery scoring, and every refusal before any forward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import xarray as xr
from tolerance import assert_close, bound, scale_of

from countlens.datasets.tasks import task_samples
from countlens.errors import InputError
from countlens.features import LocalReplacement, TranscoderSet, attribution_graph
from countlens.features.head_paths import VARIABLES, head_shares, planted_path_recovery


@pytest.fixture(scope="module")
def setup(small_transcoders, loaded):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    vlm = loaded("toy")
    tcs = small_transcoders
    sample = task_samples("count", 4, seed=0)[1]
    graph = attribution_graph(vlm, tcs, sample, batch_size=16)
    shares = head_shares(vlm, tcs, sample, graph=graph)
    yield vlm, tcs, sample, graph, shares
    torch.set_num_threads(before)


def _removed(vlm, tcs, sample, cells, target, blind_image=False, inputs=False):
    """The target's demeaned value in the frozen model with the heads ``cells`` zeroed by a plain
    forward pre-hook on o_proj (and the image embeddings zeroed if ``blind_image``); with ``inputs``,
    also the MLP inputs of that run and of the clean one (per layer)."""
    lr = LocalReplacement(vlm, tcs, sample)
    arch = vlm.arch
    handles = []
    for layer in {c[0] for c in cells}:
        gone = [h for c_layer, h in cells if c_layer == layer]
        d = arch.head_dim(layer)

        def zero(m, args, gone=gone, d=d):
            z = args[0].clone()
            for h in gone:
                z[..., h * d : (h + 1) * d] = 0
            return (z, *args[1:])

        handles.append(vlm.hf.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(zero))
    embed = lr.embed.clone()
    if blind_image:
        embed[:, lr.batch.image_pos[0]] = 0
    try:
        with torch.no_grad():
            got = lr.run(embed)
    finally:
        for h in handles:
            h.remove()
    value = float(got["final"][0, -1].float() @ lr.demeaned(torch.tensor([target]))[0])
    return (value, got["mlp_in"], lr.x) if inputs else value


@pytest.fixture(scope="module")
def logit_size(setup):
    """The size of the sample's logits and of its demeaned target logit (the value: larger than any logit
    where the mean is negative, 14 against 8 here). Every figure here is a sum or a difference of demeaned
    logits from float32 forwards (the frozen local replacement, plain hooks), which round like those do."""
    vlm, _, sample, _, d = setup
    with torch.no_grad():
        return scale_of(vlm.forward(vlm.prepare_samples([sample])).logits[0, -1], d.attrs["value"])


def _close(a, b, scale, what="head paths"):
    assert_close(a, b, scale=scale, what=what)


# ----------------------------------------------------------------------------- identities


@pytest.mark.numeric
def test_the_layout_and_the_value_is_the_real_models_demeaned_logit(setup, logit_size):
    vlm, _, sample, g, d = setup
    assert isinstance(d, xr.Dataset) and tuple(d.data_vars) == VARIABLES
    assert d["share"].dims == ("layer", "head") and d["share"].shape == (vlm.arch.n_layers, vlm.arch.n_heads)
    assert d.attrs["target"] == int(g.logit_tokens[0])  # the graph's first logit node by default
    with torch.no_grad():
        logits = vlm.forward(vlm.prepare_samples([sample])).logits[0, -1].float()
    want = float(logits[d.attrs["target"]] - logits.mean())
    _close(d.attrs["value"], want, logit_size, "value vs the model's demeaned logit")
    assert np.isfinite(d["share"].values).all()
    assert np.allclose(d["share"].values, d["image"].values / d.attrs["image_total"])


@pytest.mark.numeric
def test_no_heads_plus_every_direct_effect_is_the_value_exactly(setup, logit_size):
    d = setup[4]
    a = d.attrs
    _close(a["no_heads"] + float(d["direct"].sum()), a["value"], logit_size, "no heads + direct")
    _close(a["image_no_heads"] + float(d["image_direct"].sum()), a["image_total"], logit_size, "image parts")
    # The image tokens reach the last position only through attention: nothing is left with no heads.
    assert abs(a["image_no_heads"]) <= bound(logit_size)


@pytest.mark.numeric
def test_the_image_total_is_the_graphs_image_edges_into_the_logit(setup, logit_size):
    d = setup[4]
    _close(d.attrs["graph_image"], d.attrs["image_total"], logit_size, "graph's image edges")


@pytest.mark.numeric
def test_a_layers_paths_add_up_and_the_last_layers_paths_are_direct(setup, logit_size):
    vlm, tcs, sample, _, d = setup
    value, target, last = d.attrs["value"], d.attrs["target"], vlm.arch.n_layers - 1
    for layer in (0, last):
        cells = [(layer, h) for h in range(vlm.arch.heads(layer))]
        together = value - _removed(vlm, tcs, sample, cells, target)
        _close(float(d["path"].sel(layer=layer).sum()), together, logit_size, f"layer {layer}'s paths")
    _close(d["path"].sel(layer=last), d["direct"].sel(layer=last), logit_size, "last layer: paths are direct")
    # Removing every head at once, with a plain hook, leaves the no-heads part.
    everything = [(layer, h) for layer in range(vlm.arch.n_layers) for h in range(vlm.arch.heads(layer))]
    _close(_removed(vlm, tcs, sample, everything, target), d.attrs["no_heads"], logit_size, "every head removed")


@pytest.mark.numeric
def test_a_heads_path_and_image_share_match_a_plain_hook_on_o_proj(setup, logit_size):
    vlm, tcs, sample, _, d = setup
    value, target = d.attrs["value"], d.attrs["target"]
    blind = _removed(vlm, tcs, sample, [], target, blind_image=True)
    _close(value - blind, d.attrs["image_total"], logit_size, "image total vs blind")
    top = np.unravel_index(np.nanargmax(np.abs(d["share"].values)), d["share"].shape)
    for cell in {(int(top[0]), int(top[1])), (1, 2)}:
        cut = _removed(vlm, tcs, sample, [cell], target)
        cut_blind = _removed(vlm, tcs, sample, [cell], target, blind_image=True)
        _close(float(d["path"].sel(layer=cell[0], head=cell[1])), value - cut, logit_size, f"{cell}'s path")
        image = (value - blind) - (cut - cut_blind)
        _close(float(d["image"].sel(layer=cell[0], head=cell[1])), image, logit_size, f"{cell}'s image share")


@pytest.mark.numeric
def test_batching_does_not_change_the_result_and_another_target_can_be_asked(setup, logit_size):
    vlm, tcs, sample, g, d = setup
    again = head_shares(vlm, tcs, sample, batch_size=7)  # no graph: the top logit
    assert again.attrs["target"] == d.attrs["target"]  # the graph's first logit is the top one
    assert "graph_image" not in again.attrs
    for name in VARIABLES:
        # The share is image / image_total: both parts' rounding, over that denominator.
        total = abs(d.attrs["image_total"])
        share = 2 * logit_size * max(1.0, float(np.abs(d["share"]).max())) / total
        _close(again[name], d[name], share if name == "share" else logit_size, f"{name}, another batch size")
    if g.n_logits > 1:
        other = head_shares(vlm, tcs, sample, graph=g, target=int(g.logit_tokens[1]))
        assert other.attrs["target"] == int(g.logit_tokens[1])
        _close(other.attrs["graph_image"], other.attrs["image_total"], logit_size, "another target")


# ----------------------------------------------------------------------------- features linear


@pytest.fixture(scope="module")
def linear(setup):
    vlm, tcs, sample, graph, _ = setup
    return head_shares(vlm, tcs, sample, graph=graph, features="linear")


def _through_features(graph, direct):
    """Per unit of each feature's own input, its total effect on the graph's first logit: the logit row
    ``A_LF D⁻¹`` carried back through the feature-to-feature edges ``W = A_FF D⁻¹`` (``D`` the
    activations) by fixed-point iteration, ``g ← A_LF D⁻¹ + g W``, exact after n_layers rounds (a
    feature reads only earlier layers' writes); dotted with ``direct`` (n_features,), the features'
    input changes that no feature carried."""
    a, f = graph.adjacency.double(), graph.n_features
    acts = graph.activations.double()
    w = a[:f, :f] / acts[None, :]
    row = a[graph.logit_node(), :f] / acts
    g = row.clone()
    for _ in range(graph.n_layers):
        g = row + g @ w
    return float(g @ direct.double())


@pytest.mark.numeric
def test_linear_features_keep_the_identities_and_the_image_total_is_the_graphs_total(setup, linear, logit_size):
    d, lin = setup[4], linear
    a = lin.attrs
    assert a["features"] == "linear" and a["against"] == -1 and d.attrs["features"] == "frozen"
    _close(a["value"], d.attrs["value"], logit_size, "value: the clean point is the same")
    _close(a["no_heads"] + float(lin["direct"].sum()), a["value"], logit_size, "linear: no heads + direct")
    _close(a["image_no_heads"] + float(lin["image_direct"].sum()), a["image_total"], logit_size, "linear: image")
    # The graph's own figure: image embedding edges into the logit plus their routes through features.
    vlm, _, sample, g, _ = setup
    image = vlm.prepare_samples([sample]).image_pos[0].cpu()
    sources = torch.zeros(g.n_nodes, dtype=torch.bool)
    sources[g.start("embedding") : g.start("logit")] = torch.isin(g.embeddings, image)
    edges = g.adjacency.double()[:, sources].sum(1)
    through = _through_features(g, edges[: g.n_features])
    _close(float(edges[g.logit_node()]) + through, a["image_total"], logit_size, "graph's total vs linear image")
    _close(a["graph_image"], a["image_total"], logit_size, "graph_image, linear")
    assert abs(through) > 100 * bound(logit_size)  # the features carry a part: the two modes differ


@pytest.mark.numeric
def test_a_heads_linear_path_is_its_frozen_path_plus_its_inputs_to_features_through_the_graph(setup, linear):
    vlm, tcs, sample, g, d = setup
    target = d.attrs["target"]
    nodes = g.features
    scale = scale_of(d.attrs["value"], g.activations, g.values[: g.n_features])
    gap = np.abs(linear["path"].values - d["path"].values)
    most = tuple(int(i) for i in np.unravel_index(np.nanargmax(gap), gap.shape))  # the most feature-borne
    for cell in {most, (1, 2)}:
        cut, moved, clean = _removed(vlm, tcs, sample, [cell], target, inputs=True)
        direct = torch.zeros(g.n_features, dtype=torch.float64)
        for layer in nodes[:, 0].unique().tolist():
            here = (nodes[:, 0] == layer).nonzero().flatten()
            tc = tcs.layer(layer)
            with torch.no_grad():
                change = tc.pre_activations(moved[layer][0]) - tc.pre_activations(clean[layer][0])
            direct[here] = change[nodes[here, 1], nodes[here, 2]].double()
        frozen_path = d.attrs["value"] - cut
        want = frozen_path - _through_features(g, direct)
        got = float(linear["path"].sel(layer=cell[0], head=cell[1]))
        _close(got, want, scale, f"{cell}'s linear path vs the graph")
        if cell == most:  # the features carry a part of its path: the two modes differ
            assert abs(want - frozen_path) > 100 * bound(scale)


@pytest.mark.numeric
def test_against_reads_the_logit_difference(setup, logit_size):
    vlm, tcs, sample, g, d = setup
    other = int(g.logit_tokens[1])
    vs = head_shares(vlm, tcs, sample, graph=g, against=other)
    alone = head_shares(vlm, tcs, sample, target=other)
    with torch.no_grad():
        logits = vlm.forward(vlm.prepare_samples([sample])).logits[0, -1].float()
    a = vs.attrs
    assert a["against"] == other and a["target"] == d.attrs["target"]
    _close(a["value"], float(logits[a["target"]] - logits[other]), logit_size, "value: the logit difference")
    for name in ("path", "direct", "image", "image_direct"):
        _close(vs[name], d[name] - alone[name], logit_size, f"{name}: the difference of the two logits'")
    _close(a["graph_image"], a["image_total"], logit_size, "graph_image of a difference")


# ----------------------------------------------------------------------------- recovery


def test_planted_path_recovery_scores_the_ranking_of_abs_share(setup):
    d = setup[4]
    scores = xr.zeros_like(d["share"]) + 0.01
    scores.loc[{"layer": 0, "head": 2}] = -0.9  # |share| ranks it first
    got = planted_path_recovery(scores, {(0, 2)})
    assert got == {"auroc": 1.0, "precision": 1.0, "k": 1}
    assert planted_path_recovery(d, [(0, 2)])["k"] == 1  # a Dataset: its share
    worst = planted_path_recovery(scores, {(1, 1)})
    assert worst["precision"] == 0.0 and worst["auroc"] < 0.5


# ----------------------------------------------------------------------------- refusals


def test_bad_arguments_are_refused_before_any_forward(setup):
    vlm, tcs, sample, g, d = setup
    partial = TranscoderSet(list(tcs)[:2], [0, 1])
    other = task_samples("count", 4, seed=0)[2]
    absent = next(v for v in range(100) if v not in g.logit_tokens.tolist())
    cases = [
        (lambda: head_shares("toy", tcs, sample), "loaded model"),
        (lambda: head_shares(vlm, "tcs", sample), "TranscoderSet"),
        (lambda: head_shares(vlm, partial, sample), "every layer"),
        (lambda: head_shares(vlm, tcs, [sample]), "one sample"),
        (lambda: head_shares(vlm, tcs, sample, batch_size=0), "batch_size"),
        (lambda: head_shares(vlm, tcs, sample, graph="g"), "AttributionGraph"),
        (lambda: head_shares(vlm, tcs, other, graph=g), "not this sample"),
        (lambda: head_shares(vlm, tcs, sample, graph=replace(g, objects=g.objects.roll(1))), "not this sample"),
        (lambda: head_shares(vlm, tcs, sample, graph=g, target=absent), "no logit node"),
        (lambda: head_shares(vlm, tcs, sample, graph=replace(g, logit_tokens=g.logit_tokens[:0])), "no logit nodes"),
        (lambda: head_shares(vlm, tcs, sample, target=-1), "vocab id"),
        (lambda: head_shares(vlm, tcs, sample, target="3"), "vocab id"),
        (lambda: head_shares(vlm, tcs, sample, features="nonlinear"), "'frozen', 'linear'"),
        (lambda: head_shares(vlm, tcs, sample, against=-1), "against takes a vocab id"),
        (lambda: head_shares(vlm, tcs, sample, against=2.0), "against takes a vocab id"),
        (lambda: head_shares(vlm, tcs, sample, graph=g, against=int(g.logit_tokens[0])), "target itself"),
        (lambda: head_shares(vlm, tcs, sample, target=5, against=5), "target itself"),
        (lambda: planted_path_recovery(d, []), "empty"),
        (lambda: planted_path_recovery(d.drop_vars("share"), [(0, 2)]), "'share'"),
        (lambda: planted_path_recovery([0.1], [(0, 2)]), "DataArray"),
        (lambda: planted_path_recovery(d, [(9, 0)]), "not heads"),
    ]

    def no_forward(module, args, kwargs):
        raise AssertionError("a forward ran before the refusal")

    hook = vlm.hf.register_forward_pre_hook(no_forward, with_kwargs=True)
    try:
        for call, words in cases:
            with pytest.raises(InputError, match=words):
                call()
    finally:
        hook.remove()
