"""Attribution graphs (`countlens.features.graph`, `prune`, `graph_files`) on the organism with small
trained transcoders: the exact sum identities of logit and feature rows, edges against perturbing a
source in the frozen model, the node layout, pruning's invariants, the viewer JSON, the Dataset, and
every refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tolerance import assert_close, scale_of

import countlens
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError
from countlens.features import (
    LocalReplacement,
    TranscoderSet,
    attribution_graph,
    graph_dataset,
    graph_json,
    node_influence,
    prune,
    removal_effects,
    save_graph,
    train_transcoders,
)
from countlens.features.graph_files import cantor
from countlens.features.influence import influence, normalized
from countlens.features.scores import graph_scores

SMALL_MIX = {"count": 8, "color": 1, "shape": 1, "text": 2}


@pytest.fixture(scope="module")
def setup():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    vlm = countlens.load("toy")
    tcs = train_transcoders(vlm, width=64, k=4, steps=30, mix=SMALL_MIX, progress=False).transcoders
    sample = task_samples("count", 4, seed=0)[1]
    graph = attribution_graph(vlm, tcs, sample, batch_size=48)
    yield vlm, tcs, sample, graph
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- the sum identities


@pytest.mark.numeric
def test_each_logit_row_sums_to_its_demeaned_logit_up_to_the_bias_constant(setup):
    vlm, _, sample, g = setup
    with torch.no_grad():
        logits = vlm.forward(vlm.prepare_samples([sample])).logits[0, -1].float()
    want = logits[g.logit_tokens] - logits.mean()
    rows = g.adjacency[g.start("logit") :]
    # A sum of the row's edges against a forward: float32 rounding of the larger of the logits (the
    # demeaned ones) and the edges' magnitudes summed.
    summed = scale_of(logits, want, rows.abs().sum(1))
    assert_close(rows.sum(1) + g.constant[g.start("logit") :], want, scale=summed, what="logit rows")
    assert rows[:, g.start("logit") :].abs().sum() == 0  # nothing feeds a logit from a logit
    # The constant is what the biases alone make (b_dec, v bias): small next to the logits here.
    assert g.constant[g.start("logit") :].abs().max() < want.abs().max()


@pytest.mark.numeric
def test_each_feature_row_sums_to_its_pre_activation_including_b_enc(setup):
    g = setup[3]
    n_f = g.n_features
    pre = torch.stack([g.values[j] for j in range(n_f)])
    got = g.adjacency[:n_f].sum(1) + g.constant[:n_f]
    assert_close(got, pre, scale=scale_of(pre, g.adjacency[:n_f].abs().sum(1)), what="feature rows")
    # Independently: the value is W_enc · x + b_enc at the clean run's MLP input.
    vlm, tcs, sample, _ = setup
    lr = LocalReplacement(vlm, tcs, sample)
    layer, pos, f = g.features[n_f // 2].tolist()
    tc = tcs.layer(layer)
    x = lr.x[layer][0, pos].detach()
    want = (tc.W_enc[f] @ x + tc.b_enc[f]).detach()
    summed = scale_of(want, tc.W_enc[f].detach().abs() @ x.abs())  # the dot product's terms
    assert_close(g.values[n_f // 2], want, scale=summed, what="a feature's pre-activation by hand")
    assert torch.isnan(g.values[g.start("error") : g.start("logit")]).all()  # sources only have no value


def test_error_and_embedding_rows_are_empty_and_edges_respect_causality(setup):
    _, _, _, g = setup
    n_f, e, m = g.n_features, g.start("error"), g.start("logit")
    assert g.adjacency[e:m].abs().sum() == 0
    fl, fp = g.features[:, 0], g.features[:, 1]
    a = g.adjacency[:n_f, :n_f]
    later_layer = fl[None, :] >= fl[:, None]  # source layer ≥ target layer: no direct effect
    later_pos = fp[None, :] > fp[:, None]  # source after the target: causal attention
    assert a[later_layer | later_pos].abs().sum() == 0
    emb = g.adjacency[:n_f, g.start("embedding") : m]
    assert emb[fp[:, None] < torch.arange(g.n_embeddings)[None, :]].abs().sum() == 0


# ----------------------------------------------------------------------------- edges vs perturbation


def test_an_edge_is_the_change_of_its_target_when_its_source_is_removed_in_the_frozen_model(setup):
    vlm, tcs, sample, g = setup
    lr = LocalReplacement(vlm, tcs, sample)
    logit = g.start("logit")
    w_u = lr.demeaned(g.logit_tokens[:1])[0]
    with torch.no_grad():
        clean = lr.run()
        # The feature with the largest edge into the top logit.
        j = int(g.adjacency[logit, : g.n_features].abs().argmax())
        layer, pos, f = g.features[j].tolist()
        tc = tcs.layer(layer)
        writes = {layer: lr.writes[layer].clone()}
        writes[layer][0, pos] -= g.activations[j] * tc.W_dec[f]
        off = lr.run(writes=writes)
        change = w_u @ (off["final"][0, -1] - clean["final"][0, -1])
        assert abs(float(change) + float(g.adjacency[logit, j])) < 1e-4 * max(1.0, abs(float(g.adjacency[logit, j])))
        # The same source's edge into a later feature: the change of that feature's pre-activation.
        later = (g.features[:, 0] > layer).nonzero().flatten()
        t = int(later[g.adjacency[later, j].abs().argmax()])
        tl, tp, tf = g.features[t].tolist()
        w_enc = tcs.layer(tl).W_enc[tf]
        change = w_enc @ (off["mlp_in"][tl][0, tp] - clean["mlp_in"][tl][0, tp])
        assert abs(float(change) + float(g.adjacency[t, j])) < 1e-4 * max(1.0, abs(float(g.adjacency[t, j])))
        # An embedding: scale position p's input embedding by 1.5 → the logit moves by 0.5 × the edge.
        p = int(g.adjacency[logit, g.start("embedding") : logit].abs().argmax())
        embed = lr.embed.clone()
        embed[0, p] *= 1.5
        moved = w_u @ (lr.run(embed=embed)["final"][0, -1] - clean["final"][0, -1])
        edge = float(g.adjacency[logit, g.start("embedding") + p])
        assert abs(float(moved) - 0.5 * edge) < 1e-4 * max(1.0, abs(edge))


# ----------------------------------------------------------------------------- the nodes


def test_nodes_are_features_then_errors_then_embeddings_then_logits(setup):
    vlm, tcs, sample, g = setup
    seq = len(g.tokens)
    assert g.n_errors == vlm.arch.n_layers * seq and g.n_embeddings == seq
    assert g.errors[:seq, 0].eq(0).all() and g.errors[seq:, 0].ge(1).all()  # layer-major
    keys = g.features[:, 0] * 10**6 + g.features[:, 1] * 10**3 + g.features[:, 2]
    assert torch.equal(keys, keys.sort().values)  # layer, then position, then feature
    assert (g.activations > 0).all() and g.n_features <= vlm.arch.n_layers * seq * tcs.layer(0).k
    assert list(g.kinds()[[0, g.start("error"), g.start("embedding"), g.start("logit")]]) == [
        "feature",
        "error",
        "embedding",
        "logit",
    ]
    # Logits: most probable first; stop once cumulative probability reaches 0.95, at most 10.
    p = g.logit_probs
    assert (p[:-1] >= p[1:]).all() and g.n_logits <= 10
    assert p[:-1].sum() < 0.95 or g.n_logits == 10
    # Image tokens carry their cell; tokens of an object carry its index.
    image = (g.tokens == vlm.arch.image_token_id).nonzero().flatten()
    assert (g.cells[image] >= 0).all() and (g.cells[g.tokens != vlm.arch.image_token_id] == -1).all()
    owners = set(g.objects[g.objects >= 0].tolist())
    assert (
        owners == set(range(len(sample.scene.objects))) and (g.objects[g.tokens != vlm.arch.image_token_id] == -1).all()
    )


def test_max_features_keeps_that_many_features_chosen_by_influence(setup):
    vlm, tcs, sample, g = setup
    small = attribution_graph(vlm, tcs, sample, max_features=40, batch_size=16, max_logits=3)
    assert small.n_features == 40 and small.n_logits <= 3
    assert small.n_nodes == 40 + g.n_errors + g.n_embeddings + small.n_logits


@pytest.mark.numeric
def test_logit_rows_are_batched_like_every_row_so_any_batch_size_works(setup):
    """batch_size below the number of logit nodes: the logit rows take one backward each, and equal the
    reference graph's (48 rows a backward) on the features both keep."""
    vlm, tcs, sample, g = setup
    one = attribution_graph(vlm, tcs, sample, batch_size=1, max_features=4, max_logits=3, logit_prob=1.0)
    assert one.n_logits == 3  # three logit rows through a forward of one row
    index = {tuple(f): i for i, f in enumerate(g.features.tolist())}
    rest = range(g.n_features, g.n_features + g.n_errors + g.n_embeddings)
    cols = [index[tuple(f)] for f in one.features.tolist()] + list(rest)
    sources = one.n_features + one.n_errors + one.n_embeddings
    mine = one.adjacency[one.start("logit") :, :sources]
    ref = g.adjacency[g.start("logit") : g.start("logit") + 3][:, cols]
    assert_close(mine, ref, what="logit rows, one a backward vs 48")


# ----------------------------------------------------------------------------- influence and pruning


@pytest.mark.numeric
def test_influence_is_the_neumann_series_of_the_normalised_adjacency(setup):
    _, _, _, g = setup
    a = normalized(g.adjacency.double())
    w = torch.zeros(g.n_nodes, dtype=torch.float64)
    w[g.start("logit") :] = g.logit_probs.double()
    solved = w @ torch.linalg.inv(torch.eye(g.n_nodes, dtype=torch.float64) - a) - w
    # float64 both ways: the series (it ends: edges run forward only) against an inverse, two orders of
    # float64 sums of influences ≤ 1, ≈ 1e-16 apart; 1e-9 is far above that and far below any real error.
    assert torch.allclose(influence(a, w), solved, atol=1e-9)
    # node_influence's float32 against float64: influences are shares of at most 1.
    assert_close(node_influence(g), solved, scale=1.0, what="float32 node influence")


def test_pruning_keeps_embeddings_and_logits_and_only_connected_nodes(setup):
    _, _, _, g = setup
    p = prune(g, node_threshold=0.8, edge_threshold=0.98)
    assert p.n_embeddings == g.n_embeddings and torch.equal(p.logit_tokens, g.logit_tokens)
    assert 0 < p.n_features < g.n_features and p.n_edges < g.n_edges
    a = p.adjacency
    out_edges = (a != 0).any(0)
    assert out_edges[: p.start("embedding")].all()  # every feature and error feeds a kept node
    assert (a[: p.n_features] != 0).any(1).all()  # every feature has an input
    # Kept edges are original edges, unchanged.
    orig = {n: i for i, n in enumerate(graph_dataset(g).node_id.values)}
    kept = [orig[n] for n in graph_dataset(p).node_id.values]
    target, source = a.nonzero(as_tuple=True)
    assert len(target) == p.n_edges > 0
    assert torch.equal(a[target, source], g.adjacency[torch.tensor(kept)[target], torch.tensor(kept)[source]])
    # Influence fields: cumulative shares in (0, 1]; kept features rank within the node threshold
    # (up to the ties at the threshold score).
    assert p.influence is not None and ((p.influence > 0) & (p.influence <= 1 + 1e-6)).all()
    assert p.influence[: p.n_features].max() <= 0.8 + 0.05
    assert p.node_threshold == 0.8 and p.edge_threshold == 0.98
    # Looser thresholds keep more.
    assert prune(g, 0.95, 0.99).n_features >= p.n_features
    with pytest.raises(InputError, match="already pruned"):
        prune(p)


@pytest.mark.numeric
def test_removal_effects_are_the_linear_total_effects_of_the_graph(setup):
    _, _, _, g = setup
    n_f = g.n_features
    acts = g.activations.double()
    n = g.adjacency[:n_f, :n_f].double() / acts
    row = g.adjacency[g.start("logit"), :n_f].double() / acts
    total = row @ torch.linalg.inv(torch.eye(n_f, dtype=torch.float64) - n)
    # float32 against a float64 inverse: effects on a logit, rounding of logit-sized numbers (scale ≥ 1).
    assert_close(removal_effects(g), -acts * total, what="removal effects")
    direct = -g.adjacency[g.start("logit"), :n_f]
    last_layer = g.features[:, 0] == g.features[:, 0].max()
    assert_close(removal_effects(g)[last_layer], direct[last_layer], what="last layer: no path left")


# ----------------------------------------------------------------------------- files


def test_the_viewer_json_has_circuit_tracers_fields_and_ids(setup, tmp_path):
    vlm, _, _, g = setup
    p = prune(g)
    data = graph_json(p, "toy-count", "countlens/test", p.token_strings)
    assert data["metadata"] == {
        "slug": "toy-count",
        "scan": "countlens/test",
        "transcoder_list": [],
        "prompt_tokens": p.token_strings,
        "prompt": p.prompt,
        "node_threshold": 0.8,
        "schema_version": 1,
    }
    assert data["qParams"] == {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    nodes = data["nodes"]
    assert len(nodes) == p.n_nodes and len(data["links"]) == p.n_edges
    fields = {"node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob", "is_target_logit", "run_idx"}
    assert all(fields | {"reverse_ctx_idx", "jsNodeId", "clerp", "influence", "activation"} <= set(n) for n in nodes)
    layer, pos, f = p.features[0].tolist()
    first = nodes[0]
    assert first["node_id"] == f"{layer}_{f}_{pos}" and first["feature"] == cantor(layer, f)
    assert first["layer"] == str(layer) and first["jsNodeId"] == f"{layer}_{f}-0"
    assert first["feature_type"] == "cross layer transcoder"
    errors = [n for n in nodes if n["feature_type"] == "mlp reconstruction error"]
    assert all(n["node_id"] == f"0_{n['layer']}_{n['ctx_idx']}" and n["feature"] == -1 for n in errors)
    embeds = [n for n in nodes if n["feature_type"] == "embedding"]
    assert len(embeds) == p.n_embeddings and all(n["layer"] == "E" and n["feature"] == n["ctx_idx"] for n in embeds)
    assert any(n["clerp"].startswith("image cell (") and "object" in n["clerp"] for n in embeds)
    logits = [n for n in nodes if n["feature_type"] == "logit"]
    last = len(p.tokens) - 1
    assert [n["is_target_logit"] for n in logits] == [True] + [False] * (len(logits) - 1)
    assert logits[0]["node_id"] == f"{vlm.arch.n_layers + 1}_{int(p.logit_tokens[0])}_{last}"
    assert logits[0]["jsNodeId"] == f"L_{int(p.logit_tokens[0])}-{last}" and logits[0]["clerp"].startswith('Output "')
    ids = {n["node_id"] for n in nodes}
    assert len(ids) == len(nodes) and all(k["source"] in ids and k["target"] in ids for k in data["links"])
    link = data["links"][0]
    t, s = [n["node_id"] for n in nodes].index(link["target"]), [n["node_id"] for n in nodes].index(link["source"])
    assert link["weight"] == pytest.approx(float(p.adjacency[t, s]))
    path = save_graph(p, tmp_path / "g" / "graph.json")
    assert json.loads(path.read_text())["metadata"]["slug"] == "graph"


def test_the_dataset_holds_the_adjacency_with_node_coordinates(setup):
    _, _, _, g = setup
    ds = graph_dataset(g)
    assert ds.adjacency.dims == ("target", "source") and ds.adjacency.shape == (g.n_nodes, g.n_nodes)
    assert np.array_equal(ds.adjacency.values, g.adjacency.numpy())
    assert list(np.unique(ds.kind.values)) == ["embedding", "error", "feature", "logit"]
    emb = ds.sel(node=ds.kind == "embedding")
    assert np.array_equal(emb.object.values, g.objects.numpy())
    assert (ds.adjacency.source_kind.values == ds.kind.values).all()
    # circuit-tracer's graph scores ride in the attrs: shares in (0, 1]; pruning drops errors and their edges.
    want = graph_scores(g)
    assert (ds.attrs["replacement_score"], ds.attrs["completeness_score"]) == tuple(want.values())
    assert 0 < want["replacement"] <= 1 and 0 < want["completeness"] <= 1
    pruned = graph_dataset(prune(g)).attrs
    assert pruned["replacement_score"] == graph_scores(prune(g))["replacement"]


# ----------------------------------------------------------------------------- refusals


def test_bad_arguments_are_refused_before_any_forward(setup, tmp_path):
    vlm, tcs, sample, g = setup
    partial = TranscoderSet(list(tcs)[:2], [0, 1])
    cases = [
        (lambda: attribution_graph("toy", tcs, sample), "loaded model"),
        (lambda: attribution_graph(vlm, "tcs", sample), "TranscoderSet"),
        (lambda: attribution_graph(vlm, partial, sample), "every layer"),
        (lambda: attribution_graph(vlm, tcs, [sample]), "one sample"),
        (lambda: attribution_graph(vlm, tcs, sample, max_logits=0), "max_logits"),
        (lambda: attribution_graph(vlm, tcs, sample, logit_prob=0), "logit_prob"),
        (lambda: attribution_graph(vlm, tcs, sample, max_features=0), "max_features"),
        (lambda: attribution_graph(vlm, tcs, sample, batch_size=-1), "batch_size"),
        (lambda: prune("g"), "AttributionGraph"),
        (lambda: prune(g, node_threshold=1.5), "node_threshold"),
        (lambda: prune(g, edge_threshold=0), "edge_threshold"),
        (lambda: removal_effects(g, logit=99999), "no logit node"),
        (lambda: graph_json(g, ""), "slug"),
        (lambda: save_graph(g, tmp_path), "folder"),
        (lambda: graph_dataset(None), "AttributionGraph"),
        (lambda: g.select(torch.ones(3, dtype=torch.bool)), "bool mask"),
    ]
    for call, words in cases:
        with pytest.raises(InputError, match=words):
            call()
