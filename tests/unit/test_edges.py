"""Edges: every family runs them or is refused by name; keeping every edge is the clean run and none
the corrupt run; EAP is the derivative of patching one edge (central finite differences through the
edge forward); edge scores sum to the node scores that `node_attribution` computes another way; the
position groups partition the sum; edge-level faithfulness ends at 1 and 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import BUILDERS, TINY_IMAGE_SIZE
from tolerance import assert_close, assert_normalised, logit_scale, scale_of

from countlens.circuits.engine.pair_batch import logit_diff, prepare_pairs
from countlens.circuits.graph import edge_ablation, edges
from countlens.circuits.graph.edge_attribution import edge_attribution
from countlens.circuits.graph.faithfulness import faithfulness, faithfulness_curves
from countlens.circuits.graph.integrated import node_attribution, node_scores_of
from countlens.circuits.graph.nodes import ablated_logits, image_positions, record_nodes
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError

#: Families whose layers add their attention and MLP outputs to the residual stream unchanged (Llama 4: a MoE).
RUN = {
    "toy",
    "qwen2_vl",
    "qwen2_5_vl",
    "idefics3",
    "internvl3_5",
    "internvl",
    "llava",
    "llava_next",
    "llava_next_video",
    "llava_onevision",
    "mistral3",
    "phi4_multimodal",
    "ovis2",
    "qwen3_5",
    "qwen3_5_moe",
    "smolvlm",
    "llama4",
}


def _pairs(vlm, name, n=4):
    size = vlm.geometry.image_height if name == "toy" else TINY_IMAGE_SIZE[name][0]
    return count_pairs(n, 3, 5, kind="polygons", image_size=size, prompt="short", seed=4)


def _ends(vlm, pairs):
    """(logits keeping every edge, keeping none, clean, corrupt) of the pairs."""
    graph = edges.edge_graph(vlm)
    pb = prepare_pairs(vlm, pairs)
    edges.check_additive(vlm, graph, pb.clean)
    values = record_nodes(vlm, pb.corrupt, graph.nodes)
    every = frozenset(range(len(graph.edges)))
    kept, none = edge_ablation.edge_ablated_logits(
        vlm, graph, pb.clean, [frozenset(), every], values, image_positions(vlm, pb.clean)
    )
    with torch.no_grad():
        clean, corrupt = (vlm.forward(b, logits_to_keep=1).logits[:, -1].float() for b in (pb.clean, pb.corrupt))
    return kept, none, clean, corrupt


@pytest.mark.matrix
@pytest.mark.numeric
@pytest.mark.parametrize("name", ["toy", *sorted(BUILDERS)])
def test_every_family_runs_edges_or_is_refused_by_name(name, loaded):
    vlm = loaded(name)
    pairs = _pairs(vlm, name, n=2)
    if name not in RUN:
        with pytest.raises(InputError, match="edges"):
            _ends(vlm, pairs)
        return
    kept, none, clean, corrupt = _ends(vlm, pairs)
    assert_close(kept, clean, what=f"{name}: every edge kept vs the clean run")
    assert_close(none, corrupt, scale=scale_of(clean, corrupt), what=f"{name}: no edge kept vs the corrupt run")
    # Every edge into one layer's receivers ablated: each of its heads reads the corrupt stream through
    # its own q, k, v (or block) copies, its MLP likewise — so the layer is its heads and MLP patched.
    graph = edges.edge_graph(vlm)
    pb = prepare_pairs(vlm, pairs)
    image = image_positions(vlm, pb.clean)
    edge_values = record_nodes(vlm, pb.corrupt, graph.nodes)
    offsets = graph.offsets()
    into = [
        frozenset(
            i for r in graph.receivers if r.layer == layer for i in range(offsets[r], offsets[r] + graph.prefix[r])
        )
        for layer in range(vlm.arch.n_layers)
    ]
    by_edges = edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, into, edge_values, image)
    layers = [frozenset(n for n in graph.nodes if n.layer == layer) for layer in range(vlm.arch.n_layers)]
    by_nodes = ablated_logits(vlm, pb.clean, layers, record_nodes(vlm, pb.corrupt, graph.nodes), image)
    assert_close(by_edges, by_nodes, scale=scale_of(clean, corrupt), what=f"{name}: a layer's edges vs its nodes")


def _ld(logits, pb):
    return float(logit_diff(logits, pb.clean_id, pb.corrupt_id).sum())


@pytest.mark.numeric
def test_eap_is_the_derivative_of_patching_one_edge(loaded):
    """EAP's score of u → r is (c_u(corrupt) − c_u(clean)) · ∂LD/∂x_r: the derivative of LD when r's copy
    of the stream moves by ε of that difference. The edge forward computes that move exactly (its
    ablation value c_u + ε·Δ_u); central differences agree with the scores for edges into every kind of
    receiver."""
    vlm = loaded("toy")
    pairs = _pairs(vlm, "toy")
    eap = edge_attribution(vlm, pairs, method="eap", batch_size=len(pairs))
    graph = edges.edge_graph(vlm)
    pb = prepare_pairs(vlm, pairs)
    clean, corrupt = record_nodes(vlm, pb.clean, graph.nodes), record_nodes(vlm, pb.corrupt, graph.nodes)
    image = image_positions(vlm, pb.clean)
    with torch.no_grad():
        denom = _ld(vlm.forward(pb.corrupt).logits[:, -1].float(), pb) - _ld(
            vlm.forward(pb.clean).logits[:, -1].float(), pb
        )

    def toward(eps):  # ablation values c + ε (corrupt − clean)
        mix = lambda a, b: a + eps * (b - a)  # noqa: E731
        return {
            "embed": mix(clean["embed"], corrupt["embed"]),
            "z": {k: mix(v, corrupt["z"][k]) for k, v in clean["z"].items()},
            "mlp": {k: mix(v, corrupt["mlp"][k]) for k, v in clean["mlp"].items()},
        }

    # The largest-scoring edge into each kind of receiver, so that every path is checked on a number
    # well above the differences' own error.
    picked = []
    for kind in ("q", "k", "v", "mlp", "logits"):
        into = eap.effect.where(eap.part == kind, drop=True)
        picked.append(str(abs(into).idxmax().values))
    labels = graph.labels()
    sets = [frozenset([labels.index(lab)]) for lab in picked]
    eps = 1e-2
    plus = edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, sets, toward(eps), image)
    minus = edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, sets, toward(-eps), image)
    for i, lab in enumerate(picked):
        derivative = (_ld(plus[i], pb) - _ld(minus[i], pb)) / (2 * eps) / denom
        score = float(eap.effect.sel(edge=lab))
        # Central differences err by O(ε²) times the third derivative: 2 % of the edge's own score.
        assert abs(score) > 1e-3 and abs(derivative - score) <= 0.02 * abs(score), (lab, derivative, score)


@pytest.mark.matrix
@pytest.mark.numeric
@pytest.mark.parametrize("name", ["toy", "qwen2_5_vl", "qwen3_5"])
@pytest.mark.parametrize("steps", [1, 3])
def test_edge_scores_sum_to_the_node_scores(name, steps, loaded):
    """A node reaches the metric only through the receivers downstream of it, so the sum of its
    outgoing edges' scores is its node score: `node_attribution` computes that from the gradient at
    the node's own output (z, the MLP's output, the embeddings), not from the receivers'."""
    vlm = loaded(name)
    pairs = _pairs(vlm, name)
    method = "eap" if steps == 1 else "eap-ig"
    ea = edge_attribution(vlm, pairs, method=method, steps=steps, batch_size=2)
    nodes = node_scores_of(node_attribution(vlm, pairs, steps=steps, batch_size=2))
    got = np.array([float(ea.node_effect.sel(node=k)) for k in nodes])
    pb = prepare_pairs(vlm, pairs)
    with torch.no_grad():
        clean, corrupt = (vlm.forward(b, logits_to_keep=1).logits[:, -1].float() for b in (pb.clean, pb.corrupt))
    assert_normalised(
        got,
        np.array(list(nodes.values())),
        denominator=_ld(corrupt, pb) - _ld(clean, pb),
        n=len(pairs),
        scale=logit_scale(vlm, pb),
        what=f"{name}: Σ edges vs node scores ({method})",
    )


@pytest.mark.numeric
def test_position_groups_partition_the_sum_and_chunks_change_nothing(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, "toy")
    whole = edge_attribution(vlm, pairs, method="eap", batch_size=len(pairs))
    chunked = edge_attribution(vlm, pairs, method="eap", batch_size=len(pairs), chunk=5)
    assert_close(chunked.effect, whole.effect, what="chunked vs whole")
    parts = [
        edge_attribution(vlm, pairs, method="eap", positions=g, batch_size=len(pairs))
        for g in ("image", "text", "last")
    ]
    assert_close(sum(p.effect.values for p in parts), whole.effect, what="image + text + last vs all")
    assert float(np.abs(parts[0].effect).max()) > 0 and float(np.abs(parts[2].effect).max()) > 0


@pytest.mark.numeric
def test_edge_faithfulness_keeps_the_clean_run_whole_and_loses_it_empty(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, "toy")
    scores = edge_attribution(vlm, pairs, method="eap", batch_size=len(pairs))
    ds = faithfulness_curves(
        vlm, pairs, {"EAP": scores}, sizes=(0.0, 0.05, 1.0), random_draws=2, batch_size=len(pairs), level="edge"
    )
    assert ds.attrs["level"] == "edge" and ds.attrs["n_nodes"] == len(edges.edge_graph(vlm).edges)
    # By definition, on every CPU's kernels: every edge kept is the clean run, none kept the ablated run.
    assert (ds.faithfulness.sel(size=1.0) == 1).all() and (ds.faithfulness.sel(size=0.0) == 0).all()
    one = faithfulness(vlm, pairs, scores, sizes=(0.0, 0.05, 1.0), batch_size=len(pairs), level="edge")
    assert_close(one.faithfulness, ds.faithfulness.sel(ranking="EAP"), what="faithfulness vs its curve")


def test_edge_inputs_are_refused_by_name(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, "toy", n=2)
    with pytest.raises(InputError, match="method"):
        edge_attribution(vlm, pairs, method="atp")
    with pytest.raises(InputError, match="nodes"):
        faithfulness(vlm, pairs, {}, nodes=("head",), level="edge")
    with pytest.raises(InputError, match="edges of this model"):
        faithfulness(vlm, pairs, {"L0H0→nowhere": 1.0}, level="edge")
    with pytest.raises(InputError, match="level"):
        faithfulness(vlm, pairs, {}, level="path")


@pytest.mark.parametrize("name", ["toy", "qwen2_5_vl"])
def test_the_plan_counts_the_graphs_edges(name, loaded):
    from countlens.pipeline.stages.edges import edge_count

    vlm = loaded(name)
    arch = vlm.arch
    assert edge_count(arch.n_layers, arch.n_heads, arch.n_kv_heads) == len(edges.edge_graph(vlm).edges)


def test_the_stage_records_why_a_model_has_no_edges(loaded):
    """On a model whose layers are not additive the stage stores the refusal, and the report says it."""
    from types import SimpleNamespace

    from countlens.pipeline.stages.edges import _compute
    from countlens.pipeline.stages.faithfulness import _edges

    vlm = loaded("gemma3")
    run = SimpleNamespace(vlm=vlm, pairs=_pairs(vlm, "gemma3", n=2), batch_size=2)
    ds = _compute(run)
    assert "does not add its attention and MLP outputs" in ds.attrs["refused"]
    shown = _edges(SimpleNamespace(results={"edge_faithfulness": ds}))
    assert shown == {"refused": ds.attrs["refused"]}
    assert _edges(SimpleNamespace(results={})) is None


def _reference_ablated(vlm, graph, batch, ablate: frozenset, values, image):
    """An independent edge-ablated forward, one circuit, written receiver by receiver: each receiver's
    removed sum is formed from the recorded z differences masked per head and mapped through each
    upstream layer's own o_proj, the MLP's and the inputs' differences added as they are."""
    import torch.nn.functional as F

    from countlens.circuits.sites import K, MlpOut, Q, V, first_arg, first_output

    arch, hf = vlm.arch, vlm.hf
    live: dict = {}
    for i, (u, r) in enumerate(graph.edges):
        if i in ablate:
            live.setdefault(r, set()).add(u)
    seen: dict = {"z": {}, "mlp": {}}
    img = image[..., None].to(values["embed"].dtype)

    def removed(r, x):
        out = torch.zeros_like(x)
        for u in live.get(r, ()):
            if u.label == "IN.image":
                out += seen["embed"] * img
            elif u.label == "IN.text":
                out += seen["embed"] * (1 - img)
            elif isinstance(u, MlpOut):
                out += seen["mlp"][u.layer].view_as(x)
            else:
                w = hf.get_submodule(arch.o_proj(u.layer)).weight
                d = arch.head_dim(u.layer)
                dz = seen["z"][u.layer][..., u.head * d : (u.head + 1) * d]
                out += F.linear(dz, w[:, u.head * d : (u.head + 1) * d])
        return out

    busy = []
    normed: dict = {}

    def keep_embed(module, args, kwargs):
        seen["embed"] = first_arg(args, kwargs) - values["embed"]

    def keep_z(layer):
        return lambda module, args, kwargs: seen["z"].__setitem__(layer, first_arg(args, kwargs) - values["z"][layer])

    def keep_mlp(layer):
        return lambda module, args, out: seen["mlp"].__setitem__(layer, first_output(out) - values["mlp"][layer])

    def norm_for(rs):
        def hook(module, args, out):
            if busy:
                return None
            for r in rs:
                busy.append(1)
                normed[r] = module(args[0] - removed(r, args[0]))
                busy.pop()
            return normed[rs[0]] if len(rs) == 1 else None

        return hook

    def project(layer, part):
        def hook(module, args, out):
            out = out.clone()
            for r in (r for r in graph.receivers if r.layer == layer and type(r) is part):
                cols = edges.receiver_columns(graph, r, module)
                b = None if module.bias is None else module.bias[cols]
                out[..., cols] = F.linear(normed[r], module.weight[cols], b)
            return out

        return hook

    hooks = [(hf.get_submodule(arch.layer(0)), "pre", keep_embed)]
    for layer, paths in enumerate(graph.layers):
        attn = [r for r in graph.receivers if r.layer == layer and r.block == 0]
        mlp = [r for r in graph.receivers if r.layer == layer and r.block == 1]
        hooks += [
            (hf.get_submodule(paths.attn_norm), "forward", norm_for(attn)),
            (hf.get_submodule(paths.o_proj), "pre", keep_z(layer)),
            (hf.get_submodule(paths.mlp_norm), "forward", norm_for(mlp)),
            (hf.get_submodule(paths.mlp), "forward", keep_mlp(layer)),
        ]
        if paths.qkv is not None:
            hooks += [(hf.get_submodule(p), "forward", project(layer, part)) for part, p in zip((Q, K, V), paths.qkv)]
    hooks.append((hf.get_submodule(graph.final_norm), "forward", norm_for([graph.receivers[-1]])))
    handles = [  # plain torch hooks: the reference shares none of the engine's code
        m.register_forward_pre_hook(fn, with_kwargs=True) if kind == "pre" else m.register_forward_hook(fn)
        for m, kind, fn in hooks
    ]
    try:
        with torch.no_grad():
            return vlm.hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    finally:
        for h in handles:
            h.remove()


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["toy", "qwen2_5_vl"])
def test_random_circuits_equal_a_receiver_by_receiver_reference(name, loaded):
    """Random edge sets (a tenth, a half, all but a few), stacked in one forward, against the
    independent per-receiver forward above, circuit by circuit. The last set ablates more edges than it
    keeps, so its rows read the complement (the ablation values' stream less the kept edges) beside
    rows that sum their ablated edges."""
    vlm = loaded(name)
    pairs = _pairs(vlm, name, n=2)
    graph = edges.edge_graph(vlm)
    pb = prepare_pairs(vlm, pairs)
    values = record_nodes(vlm, pb.corrupt, graph.nodes)
    image = image_positions(vlm, pb.clean)
    rng = np.random.default_rng(0)
    n = len(graph.edges)
    sets = [frozenset(rng.choice(n, int(f * n), replace=False).tolist()) for f in (0.1, 0.5, 0.97)]
    got = edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, sets, values, image)
    with torch.no_grad():
        clean, corrupt = (vlm.forward(b, logits_to_keep=1).logits[:, -1].float() for b in (pb.clean, pb.corrupt))
    for s, logits in zip(sets, got):
        want = _reference_ablated(vlm, graph, pb.clean, s, values, image)
        assert_close(logits, want, scale=scale_of(clean, corrupt), what=f"{name}: {len(s)} of {n} edges ablated")
    assert not torch.allclose(got[0], got[1])  # the circuits differ, and so do their logits


def test_the_plan_counts_an_ablated_forwards_flops(loaded):
    """Every product an edge-ablated forward adds is a matmul that torch counts; the plan counts the
    worst case, every node live and every receiver reading it: here each node's edge into the logits
    and one edge into every receiver ablated (fewer than kept, so no receiver reads the complement)."""
    from torch.utils.flop_counter import FlopCounterMode

    from countlens.model.memory import widths
    from countlens.pipeline.stages.edges import edge_forward_flops

    vlm = loaded("toy")
    pairs = _pairs(vlm, "toy", n=2)
    graph = edges.edge_graph(vlm)
    pb = prepare_pairs(vlm, pairs)
    values = record_nodes(vlm, pb.corrupt, graph.nodes)
    image = image_positions(vlm, pb.clean)
    offsets, logits = graph.offsets(), graph.receivers[-1]
    worst = frozenset(range(offsets[logits], offsets[logits] + graph.prefix[logits])) | {
        offsets[r] for r in graph.receivers
    }
    with FlopCounterMode(display=False) as plain, torch.no_grad():
        vlm.hf(**pb.clean.inputs, use_cache=False, logits_to_keep=1)
    with FlopCounterMode(display=False) as ablated:
        edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, [worst], values, image)
    rows, seq = pb.clean.inputs["input_ids"].shape
    added = ablated.get_total_flops() - plain.get_total_flops()
    assert added == edge_forward_flops(widths(vlm), int(seq), int(rows))


def test_one_pass_gives_both_attributions_and_a_graph_is_handed_down(loaded):
    """EAP from EAP-IG's pass is EAP alone; a checked graph is not checked again; another model's graph
    or a graph at the node level is refused."""
    from unittest import mock

    from countlens.circuits.graph.edge_attribution import edge_attributions

    vlm = loaded("toy")
    pairs = _pairs(vlm, "toy")
    graph = edges.checked_graph(vlm, prepare_pairs(vlm, pairs[:2]).clean)
    twice = AssertionError("checked twice")
    with (
        mock.patch.object(edges, "check_additive", side_effect=twice),
        mock.patch("countlens.circuits.graph.edge_attribution.check_additive", side_effect=twice),
    ):
        both = edge_attributions(vlm, pairs, ("eap-ig", "eap"), steps=3, batch_size=2, graph=graph)
        faithfulness_curves(
            vlm, pairs, {"EAP": both["eap"]}, sizes=(0.0, 1.0), random_draws=0, batch_size=2, level="edge", graph=graph
        )
        for unchecked in (  # the patches do intercept: a graph not yet checked is checked by either
            lambda: edge_attribution(vlm, pairs[:2], "eap", batch_size=2, graph=edges.edge_graph(vlm)),
            lambda: faithfulness_curves(
                vlm, pairs[:2], {}, sizes=(1.0,), random_draws=1, level="edge", graph=edges.edge_graph(vlm)
            ),
        ):
            with pytest.raises(AssertionError, match="checked twice"):
                unchecked()
    alone = {m: edge_attribution(vlm, pairs, method=m, steps=3, batch_size=2) for m in ("eap", "eap-ig")}
    for m in ("eap", "eap-ig"):
        np.testing.assert_allclose(both[m].effect.values, alone[m].effect.values, rtol=1e-12, atol=1e-15)
        assert both[m].attrs["method"] == m
    assert both["eap"].attrs["steps"] == 1 and both["eap-ig"].attrs["steps"] == 3
    other = loaded("qwen2_5_vl")
    with pytest.raises(InputError, match="another model"):
        edge_attribution(other, _pairs(other, "qwen2_5_vl", n=2), graph=graph)
    with pytest.raises(InputError, match="level='edge'"):
        faithfulness_curves(vlm, pairs, {}, random_draws=1, graph=graph)
    with pytest.raises(InputError, match="methods"):
        edge_attributions(vlm, pairs, "eap")


def test_the_stage_takes_fewer_pairs_a_chunk_where_a_circuit_would_not_fit(loaded, monkeypatch):
    """Where one circuit's copy of the batch does not fit, the curves run in smaller chunks of pairs:
    the same sums, so the same curves."""
    from types import SimpleNamespace

    from countlens.pipeline.stages import edges as stage

    vlm = loaded("toy")
    run = SimpleNamespace(vlm=vlm, pairs=_pairs(vlm, "toy", n=3), batch_size=3, config=SimpleNamespace(seed=0))
    whole = stage._compute(run)
    monkeypatch.setattr(stage, "edge_max_rows", lambda *a: 2)
    split = stage._compute(run)
    assert whole.attrs["curve_batch"] == 3 and split.attrs["curve_batch"] == 2
    assert_close(split.faithfulness, whole.faithfulness, what="curves in chunks of 2 pairs vs 3")
