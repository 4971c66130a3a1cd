"""A metric is an argument of every attribution method and of faithfulness: AtP under the answer's
log-probability and EAP-IG on nodes under a probability mass equal their definitions computed with plain
torch hooks and autograd; faithfulness under KL keeps its end points (m(N) = 0, m(∅) the corrupt run's KL);
a method that needs a linear metric (RelP) or a moving one (the first-order methods, at the clean run)
refuses the others by name before any forward; every result names its metric in its provenance."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tolerance import assert_close

from countlens.circuits import (
    Metric,
    attribution_patch,
    edge_attribution,
    faithfulness,
    metrics,
    node_attribution,
    object_attribution,
    object_edge_attribution,
    object_effects,
    prepare_pairs,
)
from countlens.circuits.graph.nodes import graph_nodes
from countlens.circuits.methods.registry import METHODS, method
from countlens.circuits.methods.relp import relevance_patch
from countlens.datasets import countingtricks
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def pairs(organism):
    return count_pairs(4, 3, 5, kind="shapes", grid=organism.geometry, prompt="short", seed=11)


@pytest.fixture(scope="module")
def high(pairs):
    """P(count ≥ 5) for these pairs' shapes, written as the model writes its answers."""
    return metrics.prob_mass(sorted({p.corrupt.answer.replace("5", str(n)) for p in pairs for n in range(5, 10)}))


def _hooked_run(vlm, batch, *, embed=None, grad=False):
    """One forward of ``batch`` with plain torch hooks: (read-position logits, each layer's o_proj input z,
    layer 0's input). ``embed`` replaces layer 0's input; with ``grad`` the graph is kept (every z then
    requires a gradient, from the model's own parameters or from ``embed``)."""
    arch, hf = vlm.arch, vlm.hf
    zs, got, handles = {}, {}, []

    def keep_z(layer):
        def hook(module, args):
            zs[layer] = args[0]

        return hook

    def layer0(module, args, kwargs):
        got["embed"] = args[0]
        if embed is not None:
            return (embed, *args[1:]), kwargs
        return None

    handles.append(hf.get_submodule(arch.layer(0)).register_forward_pre_hook(layer0, with_kwargs=True))
    for layer in range(arch.n_layers):
        handles.append(hf.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(keep_z(layer)))
    try:
        with torch.set_grad_enabled(grad):
            logits = hf(**batch.inputs, use_cache=False).logits[:, -1].float()
    finally:
        for h in handles:
            h.remove()
    return logits, zs, got["embed"]


def _per_head(vlm, dz_times_g):
    """Σ over rows, positions and the head's columns of (z_corrupt − z_clean) · g, per head of a layer."""
    d = vlm.arch.head_dim(0)
    return torch.stack([dz_times_g[..., h * d : (h + 1) * d].sum() for h in range(vlm.arch.n_heads)])


def _mass(vlm, pb, logits, answers):
    """The probability of the tokens that begin an answer of ``answers`` after each pair's shared prefix."""
    rows = []
    for k, prefix in enumerate(pb.forced):
        ids = {tuple(vlm.answer_ids(a)) for a in answers}
        nxt = sorted({seq[len(prefix)] for seq in ids if list(seq[: len(prefix)]) == prefix and len(seq) > len(prefix)})
        rows.append(torch.softmax(logits[k], -1)[nxt].sum())
    return torch.stack(rows)


@pytest.mark.numeric
def test_atp_under_log_prob_equals_plain_torch(organism, pairs):
    pairs = pairs[:2]
    ds = attribution_patch(organism, pairs, metric="log_prob", batch_size=len(pairs))
    assert json.loads(ds.attrs["metric"]) == {"name": "log_prob", "answer": "clean"}
    pb = prepare_pairs(organism, pairs)
    rows = torch.arange(len(pairs))

    def log_prob(logits):
        return torch.log_softmax(logits, -1)[rows, pb.clean_id]

    corrupt_logits, corrupt_z, _ = _hooked_run(organism, pb.corrupt)
    logits, zs, _ = _hooked_run(organism, pb.clean, grad=True)
    m_clean = log_prob(logits)
    layers = range(organism.arch.n_layers)
    grads = torch.autograd.grad(m_clean.sum(), [zs[layer] for layer in layers])  # no parameter's .grad
    denom = float(log_prob(corrupt_logits).sum() - m_clean.detach().sum())
    for layer, g in zip(layers, grads):
        terms = (corrupt_z[layer] - zs[layer].detach()).double() * g.double()
        want = _per_head(organism, terms) / denom
        scale = float(terms.abs().sum()) / abs(denom)
        assert_close(ds.effect.sel(layer=layer), want, scale=scale, what=f"AtP under log_prob, layer {layer}")
    assert_close(ds.attrs["normaliser"], denom, scale=float(corrupt_logits.abs().max()) * len(pairs))


@pytest.mark.numeric
def test_eap_ig_nodes_under_a_probability_mass_equal_their_definition(organism, pairs, high):
    steps, pairs = 2, pairs[:2]
    ds = node_attribution(organism, pairs, steps=steps, batch_size=len(pairs), metric=high)
    assert json.loads(ds.attrs["metric"])["name"] == "prob_mass" and "answers" in json.loads(ds.attrs["metric"])
    pb = prepare_pairs(organism, pairs)
    corrupt_logits, corrupt_z, corrupt_embed = _hooked_run(organism, pb.corrupt)
    clean_logits, clean_z, clean_embed = _hooked_run(organism, pb.clean)
    layers = range(organism.arch.n_layers)
    mean_grad = {layer: 0 for layer in layers}
    for k in range(1, steps + 1):  # the straight path from the corrupt input to the clean, right end points
        point = (corrupt_embed + (k / steps) * (clean_embed - corrupt_embed)).detach().requires_grad_(True)
        logits, zs, _ = _hooked_run(organism, pb.clean, embed=point, grad=True)
        grads = torch.autograd.grad(_mass(organism, pb, logits, high.answers).sum(), [zs[layer] for layer in layers])
        for layer, g in zip(layers, grads):
            mean_grad[layer] = mean_grad[layer] + g.double() / steps
    m_clean, m_corrupt = (_mass(organism, pb, x, high.answers) for x in (clean_logits, corrupt_logits))
    denom = float(m_corrupt.sum() - m_clean.sum())
    for layer in layers:
        terms = (corrupt_z[layer] - clean_z[layer]).double() * mean_grad[layer]
        want = _per_head(organism, terms) / denom
        scale = float(terms.abs().sum()) / abs(denom)
        assert_close(ds.effect.sel(layer=layer), want, scale=scale, what=f"EAP-IG under prob_mass, layer {layer}")


@pytest.mark.numeric
def test_faithfulness_under_kl_keeps_its_end_points(organism, pairs):
    kinds = ("head", "mlp", "input")  # every node: m(∅) is the corrupt run itself
    nodes = graph_nodes(organism, kinds)
    scores = {n.label: float(i % 5) - 2.0 for i, n in enumerate(nodes)}
    pairs = pairs[:2]
    ds = faithfulness(organism, pairs, scores, sizes=(0.0, 0.25, 1.0), nodes=kinds, metric="kl", batch_size=2)
    assert json.loads(ds.attrs["metric"]) == {"name": "kl", "from": "clean"}
    assert "kl" in ds and "logit_diff" not in ds and ds.kl.dims == ("size", "pair")
    assert ds.attrs["metric_full"] == 0.0  # KL of the clean run from itself
    pb = prepare_pairs(organism, pairs)
    clean, corrupt = (_hooked_run(organism, b)[0] for b in (pb.clean, pb.corrupt))
    p, q = torch.log_softmax(clean, -1), torch.log_softmax(corrupt, -1)
    by_hand = float((p.exp() * (p - q)).sum())
    assert_close(ds.attrs["metric_empty"], by_hand, scale=float(clean.abs().max()) * len(pairs), what="m(∅) under KL")
    assert list(ds.faithfulness.values[[0, -1]]) == [0.0, 1.0]
    assert_close(ds.metric, ds.kl.sum("pair"), what="m(C) is the per-pair KL summed")


def _scenes(vlm):
    return countingtricks(["1A"], 1, grid=vlm.geometry, seed=0)


def _refusals(vlm, pairs):
    scenes = _scenes(vlm)
    return {
        "RelP.*linear in the logits.*'log_prob' is not": lambda: relevance_patch(vlm, pairs, metric="log_prob"),
        "attribution_patch \\(AtP\\) takes the metric's gradient at the clean run.*'kl'.*zero": lambda: (
            attribution_patch(vlm, pairs, metric="kl")
        ),
        "AtP\\*.*gradient there is zero": lambda: attribution_patch(vlm, pairs, method="atp*", metric="kl"),
        "EAP \\(edge_attribution, method='eap'\\).*gradient there is zero": lambda: edge_attribution(
            vlm, pairs, method="eap", steps=1, metric="kl"
        ),
        "node_attribution with steps=1 \\(AtP\\)": lambda: node_attribution(vlm, pairs, steps=1, metric="kl"),
        "object_attribution \\(method='atp'\\).*zero": lambda: object_attribution(vlm, scenes, "atp", metric="kl"),
        "object_edge_attribution \\(method='eap'\\).*zero": lambda: object_edge_attribution(
            vlm, scenes, "eap", metric="kl"
        ),
        "mean-ablation drop takes no metric": lambda: method("ablation").result(vlm, pairs, metric="kl"),
        "the metric 'metric' names its per-pair variables.*is already a name of the result": lambda: faithfulness(
            vlm, pairs, {"L0H0": 1.0}, nodes=("head",), metric=Metric("metric", lambda logits, pb: logits[:, 0])
        ),
        "metric 'broken' returned \\(1, 2\\)": lambda: object_effects(
            vlm, scenes, metric=Metric("broken", lambda logits, pb: logits[:, :2])
        ),
    }


def test_a_metric_a_method_cannot_take_is_refused_by_name_before_any_forward(organism, pairs):
    def no_forward(module, args, kwargs):
        raise AssertionError("a forward ran before the metric was refused")

    hook = organism.hf.register_forward_pre_hook(no_forward, with_kwargs=True)
    try:
        for match, call in _refusals(organism, pairs).items():
            with pytest.raises(InputError, match=match):
                call()
    finally:
        hook.remove()


def test_the_registry_says_which_metrics_each_method_takes(organism, pairs):
    needs = {m.name: m.metric for m in METHODS}
    assert needs == {
        "exact": "any",
        "atp": "moving",
        "eap_ig": "any",
        "ablation": "none",
        "atp_star": "moving",
        "eap_edges": "moving",
        "eap_ig_edges": "any",
        "relp": "linear",
    }

    def no_forward(module, args, kwargs):
        raise AssertionError("a forward ran before the metric was refused")

    hook = organism.hf.register_forward_pre_hook(no_forward, with_kwargs=True)
    try:
        for m in METHODS:  # each entry's word is what its method refuses
            refused = {"moving": "kl", "linear": "log_prob", "none": "kl"}.get(m.metric)
            if refused is not None:
                with pytest.raises(InputError, match=f"'{refused}'|takes no metric"):
                    m.result(organism, pairs, batch_size=4, metric=refused)
    finally:
        hook.remove()


def test_object_effects_under_log_prob_are_exact_and_named(organism):
    scenes = _scenes(organism)
    ds = object_effects(organism, scenes, metric="log_prob")
    assert json.loads(ds.attrs["metric"]) == {"name": "log_prob", "answer": "clean"}
    assert {"clean_log_prob", "patched_log_prob", "reference_log_prob"} <= set(ds) and "clean_logit_diff" not in ds
    live = ds.exists & (ds.n_tokens > 0)
    assert_close(ds.effect.where(live, 0), (ds.clean_log_prob - ds.patched_log_prob).where(live, 0))
    assert bool((ds.clean_log_prob <= 0).all())  # log-probabilities


def test_object_and_edge_attributions_under_kl_integrate_from_the_reference(organism, pairs):
    scenes = _scenes(organism)
    ds = object_attribution(organism, scenes, "eap-ig", steps=2, metric="kl")
    assert json.loads(ds.attrs["metric"])["name"] == "kl"
    assert float(np.abs(ds.clean_metric).max()) == 0.0 and bool((ds.reference_metric > 0).all())
    edges = edge_attribution(organism, pairs[:1], method="eap-ig", steps=2, metric="kl", batch_size=1)
    assert json.loads(edges.attrs["metric"])["name"] == "kl" and np.isfinite(edges.effect.values).all()
