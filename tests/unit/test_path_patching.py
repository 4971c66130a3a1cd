"""Path patching and edge sets (`countlens.circuits.graph.paths`): a path patch equals plain torch written
here with hooks, and the edge engine's forward of the same edges; an edge set ablated or kept ends at
the corrupt and the clean run; every bad input is refused by name before any forward."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_close, assert_normalised, logit_scale, scale_of

from countlens.circuits.engine.pair_batch import logit_diff, prepare_pairs
from countlens.circuits.graph import edges
from countlens.circuits.graph.edge_ablation import edge_ablated_logits
from countlens.circuits.graph.nodes import image_positions, record_nodes
from countlens.circuits.graph.paths import ablate_edges, edge_indices, keep_edges, path_patch
from countlens.circuits.sites import HeadZ, K, Q, Residual, V
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError


def _pairs(vlm, n=3):
    return count_pairs(n, 3, 5, kind="polygons", image_size=vlm.geometry.image_height, prompt="short", seed=4)


@pytest.mark.numeric
def test_a_path_patch_is_plain_torch(loaded):
    """L0H0 → layer 1's queries by hand: record layer 0's z in both runs, then run the clean input with
    layer 1's q projection reading norm(x − (L0H0's clean output − its corrupt output)), x the stream
    entering layer 1; k, v, the MLP and every other layer read the stream as it is."""
    vlm = loaded("toy")
    pairs = _pairs(vlm)
    ds = path_patch(vlm, pairs, "L0H0", [Q(1, h) for h in range(vlm.arch.heads(1))], batch_size=len(pairs))

    arch, hf = vlm.arch, vlm.hf
    pb = prepare_pairs(vlm, pairs)
    o_proj, layer1 = hf.get_submodule(arch.o_proj(0)), hf.get_submodule(arch.layer(1))
    norm1, q_proj = hf.get_submodule(arch.attn_norm(1)), hf.get_submodule(arch.q_proj(1))
    d = arch.head_dim(0)
    seen = {}

    def keep_z(module, args, kwargs):
        seen["z"] = args[0] if args else kwargs["input"]

    def run(batch):  # a plain forward, layer 0's z kept
        handle = o_proj.register_forward_pre_hook(keep_z, with_kwargs=True)
        try:
            with torch.no_grad():
                return hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        finally:
            handle.remove()

    clean_logits = run(pb.clean)
    z_clean = seen["z"][..., :d]
    corrupt_logits = run(pb.corrupt)
    z_corrupt = seen["z"][..., :d]
    delta = F.linear(z_clean - z_corrupt, o_proj.weight[:, :d])  # L0H0's clean output − its corrupt output

    def keep_x(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    def patched_q(module, args, out):
        return F.linear(norm1(seen["x"] - delta), module.weight, module.bias)

    handles = [layer1.register_forward_pre_hook(keep_x, with_kwargs=True), q_proj.register_forward_hook(patched_q)]
    try:
        with torch.no_grad():
            path_logits = hf(**pb.clean.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    finally:
        for h in handles:
            h.remove()

    want = logit_diff(path_logits, pb.clean_id, pb.corrupt_id)
    clean = logit_diff(clean_logits, pb.clean_id, pb.corrupt_id)
    corrupt = logit_diff(corrupt_logits, pb.clean_id, pb.corrupt_id)
    scale = scale_of(clean_logits, corrupt_logits)
    assert_close(ds.logit_diff.values, want, scale=scale, what="path patch vs plain torch")
    assert_close(ds.clean_logit_diff.values, clean, scale=scale, what="clean runs")
    assert_close(ds.corrupt_logit_diff.values, corrupt, scale=scale, what="corrupt runs")
    effect = float((want.double().sum() - clean.double().sum()) / (corrupt.double().sum() - clean.double().sum()))
    assert_normalised(float(ds.effect), effect, denominator=float((corrupt - clean).sum()), n=len(pairs), scale=scale)
    # The patch has teeth: its logit differences are off the clean run's by far more than the tolerance.
    assert float((want - clean).abs().max()) > 100 * 1e-5 * scale
    assert ds.attrs["senders"] == '["L0H0"]' and ds.attrs["method"] == "path_patch"


@pytest.mark.numeric
def test_a_path_patch_is_the_edge_engines_figure_for_its_edges(loaded):
    """Senders of every kind (a head, an MLP, the image tokens' embeddings) into receivers of every kind:
    the figure is `edge_ablated_logits` with exactly the edges sender → receiver corrupted, under the
    default metric and another; `ablate_edges` of those edges, as (sender, receiver) pairs, is the same."""
    vlm = loaded("toy")
    pairs = _pairs(vlm, n=2)
    graph = edges.edge_graph(vlm)
    senders = ["L0H0", "MLP1", "IN.image"]
    receivers = [K(2, 0), V(2, 1), "MLP3.in", Q(4, 2), "logits"]
    ds = path_patch(vlm, pairs, senders, receivers, graph=graph)
    lp = path_patch(vlm, pairs, senders, receivers, metric="log_prob", graph=graph)

    pb = prepare_pairs(vlm, pairs)
    labels = graph.labels()
    into = ["L2K0.k", "L2K1.v", "MLP3.in", "L4H2.q", "logits"]
    chosen = frozenset(labels.index(f"{u}→{r}") for u in senders for r in into)
    values = record_nodes(vlm, pb.corrupt, graph.nodes)
    (logits,) = edge_ablated_logits(vlm, graph, pb.clean, [chosen], values, image_positions(vlm, pb.clean))
    scale = logit_scale(vlm, pb)
    assert_close(ds.logit_diff.values, logit_diff(logits, pb.clean_id, pb.corrupt_id), scale=scale, what="LD")
    want = torch.log_softmax(logits, -1)[torch.arange(len(pairs)), pb.clean_id]
    assert_close(lp.log_prob.values, want, scale=scale, what="log-probability")
    assert ds.attrs["edges_corrupted"] == len(chosen) and ds.attrs["receivers"].count(".") == 4

    pairs_of = [(u, r) for u in senders for r in receivers]
    same = ablate_edges(vlm, pairs, pairs_of, graph=graph)
    assert_close(same.logit_diff.values, ds.logit_diff.values, scale=scale, what="ablate_edges vs path_patch")


@pytest.mark.numeric
def test_every_edge_ablated_is_the_corrupt_run_and_kept_the_clean_run(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, n=2)
    graph = edges.edge_graph(vlm)
    every = graph.labels()
    ablated = ablate_edges(vlm, pairs, every, graph=graph)
    kept = keep_edges(vlm, pairs, every, graph=graph)
    scale = logit_scale(vlm, prepare_pairs(vlm, pairs))
    assert_close(ablated.logit_diff, ablated.corrupt_logit_diff, scale=scale, what="every edge ablated")
    assert_close(kept.logit_diff, kept.clean_logit_diff, scale=scale, what="every edge kept")
    # The kept run is a second row of the stacked forward beside the clean one, not the clean row itself: equal
    # on this CPU, but rows of one batch are two computations, so both end points get the same bound.
    assert abs(float(kept.effect)) < 1e-4 and abs(float(ablated.effect) - 1) < 1e-4
    assert kept.attrs["edges_corrupted"] == 0 and ablated.attrs["edges_corrupted"] == len(every)
    # One edge, given alone as its label or as a (sender, receiver) pair; kept, every other is corrupted.
    one_edge = [every.index("L0H0→L1H0.q")]
    assert edge_indices(graph, "L0H0→L1H0.q") == edge_indices(graph, ("L0H0", Q(1, 0))) == one_edge
    assert edge_indices(graph, [((0, 0), "L1H0.q"), "L0H0→L1H1.q"]) == [*one_edge, every.index("L0H0→L1H1.q")]
    one = keep_edges(vlm, pairs, every[0], graph=graph)
    assert one.attrs["edges_corrupted"] == len(every) - 1 and json.loads(one.attrs["edges"]) == [every[0]]


@contextmanager
def _no_forward(vlm):
    """Fail if the model runs: every refusal comes before any forward."""

    def refuse(module, args, kwargs):
        raise AssertionError("a forward ran before the refusal")

    handle = vlm.hf.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda v, p: path_patch(v, p, "L2H0", "L1H0.q"), r"L2H0→L1H0\.q is no edge.*upstream of, or at"),
        (lambda v, p: path_patch(v, p, "L1H0", ["L1H1.q"]), r"upstream of, or at.*downstream of every sender"),
        (lambda v, p: path_patch(v, p, [], "L1H0.q"), r"senders is empty.*senders=\['L0H0'\]"),
        (lambda v, p: path_patch(v, p, "L0H0", []), r"receivers is empty"),
        (lambda v, p: path_patch(v, p, "L0H0", HeadZ(1, 0)), r"HeadZ cannot receive an edge; give an edge receiver"),
        (lambda v, p: path_patch(v, p, "L0H0", Residual(1)), r"Residual cannot receive"),
        (lambda v, p: path_patch(v, p, "L0H0", "MLP1"), r"'MLP1' is a node.*cannot receive.*'MLP3\.in'"),
        (lambda v, p: path_patch(v, p, "L0H0", "L9H0.q"), r"'L9H0\.q' is no receiver of this model"),
        (lambda v, p: path_patch(v, p, Q(0, 0), "logits"), r"receiver site.*cannot send.*HeadZ"),
        (lambda v, p: path_patch(v, p, ["L0H0", (0, 0)], "logits"), r"senders names L0H0 more than once"),
        (lambda v, p: ablate_edges(v, p, ["L0H0→nowhere"]), r"'L0H0→nowhere' is not in this model's edge graph"),
        (lambda v, p: ablate_edges(v, p, ["L3H0→L1H0.q"]), r"not in this model's edge graph.*upstream"),
        (lambda v, p: keep_edges(v, p, ["L9H0→logits"]), r"'L9H0' is no node"),
        (lambda v, p: keep_edges(v, p, "L0H0"), r"write an edge as 'upstream→receiver'"),
        (lambda v, p: keep_edges(v, p, []), r"edges is empty"),
        (lambda v, p: ablate_edges(v, p, ["L0H0→logits", ("L0H0", "logits")]), r"more than once"),
        (lambda v, p: path_patch(v, p, "L0H0", "logits", metric=lambda lg, pb: lg.sum()), r"returned \(\) of .* for 1"),
    ],
)
def test_bad_paths_and_edges_are_refused_by_name_before_any_forward(call, match, loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, n=2)
    with _no_forward(vlm), pytest.raises(InputError, match=match):
        call(vlm, pairs)
