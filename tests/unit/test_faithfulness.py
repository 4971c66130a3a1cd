"""Faithfulness curves: an independent plain-torch-hook computation of f(C), the empty and full
circuits as the corrupt and clean runs, MIB's sizes and areas worked by hand, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_close, logit_scale, scale_of

from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.graph.faithfulness import (
    areas,
    circuit_sizes,
    faithfulness,
    faithfulness_curves,
    node_scores,
    smallest_faithful,
)
from countlens.circuits.graph.nodes import ablated_logits, graph_nodes, image_positions, record_nodes
from countlens.circuits.methods.patching import prepare_pairs
from countlens.circuits.sites import Expert, HeadZ, MlpOut, group_mask
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError


def _pairs(vlm, n=3, image_size=None):
    if image_size is None:
        return count_pairs(n, kind="shapes", grid=vlm.geometry, prompt="short", counts=range(2, 7), seed=4)
    return count_pairs(n, 3, 5, kind="polygons", image_size=image_size, prompt="short", seed=4)


def _mlp_module(model, arch, layer):
    layer_module = model.get_submodule(arch.layer(layer))
    return getattr(layer_module, "mlp", None) or layer_module.feed_forward


def _hook_metric(vlm, pairs, ablate):
    """Plain torch hooks, no nnsight: Σ LD over ``pairs`` of the clean run with every node of
    ``ablate`` (labels) overwritten by the corrupt run's output of that node, and the logits' scale."""
    pb = prepare_pairs(vlm, pairs)
    model, arch = vlm.hf, vlm.arch
    z_c, mlp_c, embed_c, handles = {}, {}, {}, []

    def first(args, kwargs):
        return args[0] if args else kwargs["hidden_states"]

    handles.append(
        model.get_submodule(arch.layer(0)).register_forward_pre_hook(
            lambda m, args, kwargs: embed_c.__setitem__(0, first(args, kwargs).detach().clone()), with_kwargs=True
        )
    )
    for layer in range(arch.n_layers):
        handles.append(
            model.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(
                lambda m, args, layer=layer: z_c.__setitem__(layer, args[0].detach().clone())
            )
        )
        handles.append(
            _mlp_module(model, arch, layer).register_forward_hook(
                lambda m, args, out, layer=layer: mlp_c.__setitem__(
                    layer, (out[0] if isinstance(out, tuple) else out).detach().clone()
                )
            )
        )
    with torch.no_grad():
        model(**pb.corrupt.inputs)
    for h in handles:
        h.remove()
    image = group_mask(pb.clean, "image")
    handles = []
    where = torch.zeros_like(image)
    if "IN.image" in ablate:
        where |= image
    if "IN.text" in ablate:
        where |= ~image

    def embed(m, args, kwargs):
        hid = first(args, kwargs).clone()
        hid[where] = embed_c[0][where]
        return ((hid, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hid})

    handles.append(model.get_submodule(arch.layer(0)).register_forward_pre_hook(embed, with_kwargs=True))
    for layer in range(arch.n_layers):
        heads = [h for h in range(arch.heads(layer)) if f"L{layer}H{h}" in ablate]

        def z_hook(m, args, layer=layer, heads=heads):
            z = args[0].clone()
            d = arch.head_dim(layer)
            for h in heads:
                z[..., h * d : (h + 1) * d] = z_c[layer][..., h * d : (h + 1) * d]
            return (z, *args[1:])

        handles.append(model.get_submodule(arch.o_proj(layer)).register_forward_pre_hook(z_hook))
        if f"MLP{layer}" in ablate:
            handles.append(
                _mlp_module(model, arch, layer).register_forward_hook(
                    lambda m, args, out, layer=layer: (
                        (mlp_c[layer], *out[1:]) if isinstance(out, tuple) else mlp_c[layer]
                    )
                )
            )
    with torch.no_grad():
        logits = model(**pb.clean.inputs).logits[:, -1].float()
    for h in handles:
        h.remove()
    rows = torch.arange(len(logits))
    return float((logits[rows, pb.clean_id] - logits[rows, pb.corrupt_id]).sum()), scale_of(logits)


@pytest.mark.numeric
def test_faithfulness_agrees_with_plain_hooks_on_the_organism(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm)
    nodes = graph_nodes(vlm)  # inputs, heads, MLPs: 32 nodes on the organism
    ranking = {n.label: float((7 * i) % len(nodes)) for i, n in enumerate(nodes)}  # an arbitrary order,
    # but the image input kept first: with it ablated every node downstream would recompute the corrupt
    # run whatever was kept, and no ablation of a head or an MLP could show.
    ranking["IN.image"] = float(len(nodes))
    ds = faithfulness(vlm, pairs, ranking, sizes=(0.0, 0.25, 0.5, 1.0))
    order = sorted(nodes, key=lambda n: (-abs(ranking[n.label]), nodes.index(n)))
    full, scale = _hook_metric(vlm, pairs, set())
    empty, _ = _hook_metric(vlm, pairs, {n.label for n in nodes})
    for size, k in zip((0.25, 0.5), (8, 16)):
        kept = {n.label for n in order[:k]}
        m, s = _hook_metric(vlm, pairs, {n.label for n in nodes} - kept)
        got = ds.sel(size=size)
        assert int(got.kept) == k
        n_pairs = len(pairs)
        assert_close(float(got.metric), m, scale=max(scale, s) * n_pairs, what=f"m(C) at {size}")
        expected = (m - empty) / (full - empty)
        assert_close(float(got.faithfulness), expected, scale=max(scale, s) * n_pairs / abs(full - empty))
    assert ds.faithfulness.sel(size=0.0) == 0 and ds.faithfulness.sel(size=1.0) == 1
    assert_close(ds.attrs["metric_full"], full, scale=scale * len(pairs))
    assert_close(ds.attrs["metric_empty"], empty, scale=scale * len(pairs))


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["toy", "qwen2_5_vl", "qwen3_5", "qwen3_vl_moe", "mllama", "llama4", "mistral3"])
def test_no_node_ablated_is_the_clean_run_and_every_node_the_corrupt_run(name, loaded):
    """Counterfactual patching of every node (inputs, every head's z, every MLP or MoE block) rebuilds
    the corrupt run: the residual stream is their sum. A hybrid (Qwen3.5's linear layers), a MoE
    (Qwen3-VL-MoE; Llama 4's experts run on every token), a cross-attention model (Llama-3.2-Vision:
    the image node is its image states) and a tower that packs the batch's images into one sequence
    (Mistral 3's Pixtral: the stacked sets share one run of it)."""
    vlm = loaded(name)
    pairs = _pairs(vlm) if name == "toy" else _pairs(vlm, n=2, image_size=TINY_IMAGE_SIZE[name][0])
    pb = prepare_pairs(vlm, pairs)
    nodes = graph_nodes(vlm)
    values = record_nodes(vlm, pb.corrupt, nodes)
    got = ablated_logits(vlm, pb.clean, [frozenset(), frozenset(nodes)], values, image_positions(vlm, pb.clean))
    with torch.no_grad():
        clean = vlm.hf(**pb.clean.inputs).logits[:, -1].float()
        corrupt = vlm.hf(**pb.corrupt.inputs).logits[:, -1].float()
    assert_close(got[0], clean, what=f"{name}: nothing ablated vs the clean run")
    assert_close(got[1], corrupt, what=f"{name}: everything ablated vs the corrupt run")
    assert not torch.allclose(clean, corrupt)  # the pairs do differ


@pytest.mark.numeric
def test_curves_of_several_rankings_share_one_node_set_and_random_draws_are_seeded(loaded):
    """Also the end points discover's report shows, under every CPU's kernels (make test-kernels): 1 with
    every node kept and 0 with none, exactly, for every ranking and the random mean — by definition, not
    as a ratio of two sums that another machine may round apart."""
    vlm = loaded("toy")
    pairs = _pairs(vlm, n=2)
    heads = {n.label: float(n.layer * 10 + n.head) for n in graph_nodes(vlm, ("head",))}
    a = faithfulness_curves(vlm, pairs, {"by_depth": heads}, sizes=(0.0, 0.5, 1.0), random_draws=3, seed=1)
    b = faithfulness_curves(vlm, pairs, {"by_depth": heads}, sizes=(0.0, 0.5, 1.0), random_draws=3, seed=1)
    assert list(a.ranking.values) == ["by_depth", "random0", "random1", "random2", "random"]
    np.testing.assert_array_equal(a.faithfulness.values, b.faithfulness.values)  # one computation, run twice
    assert (a.faithfulness.sel(size=1.0) == 1).all() and (a.faithfulness.sel(size=0.0) == 0).all()
    assert a.attrs["nodes"] == "head" and a.attrs["n_nodes"] == 24
    mean = a.faithfulness.sel(ranking=["random0", "random1", "random2"]).mean("ranking")
    np.testing.assert_allclose(a.faithfulness.sel(ranking="random").values, mean.values)
    assert float(a.cpr_std.sel(ranking="random")) >= 0 and np.isnan(float(a.cpr_std.sel(ranking="by_depth")))
    # The same ranking restricted to heads, evaluated alone, gives the same curve.
    # Another stack of ablated sets in each forward (no random circuits beside it): rows of another batch
    # shape round apart, so the two meet within float32 rounding of the logit differences, over m(N) − m(∅).
    single = faithfulness(vlm, pairs, heads, sizes=(0.0, 0.5, 1.0))
    spread = abs(a.attrs["metric_full"] - a.attrs["metric_empty"])
    scale = len(pairs) * logit_scale(vlm, prepare_pairs(vlm, pairs)) / spread
    assert_close(single.faithfulness, a.faithfulness.sel(ranking="by_depth"), scale=scale, what="one ranking alone")


def test_a_head_ranking_from_patching_is_a_ranking(loaded):
    vlm = loaded("toy")
    import xarray as xr

    effect = xr.DataArray(np.arange(24.0).reshape(6, 4), coords={"layer": range(6), "head": range(4)})
    scores = node_scores(vlm, effect)
    assert len(scores) == 24 and {type(n) for n in scores} == {HeadZ}
    assert scores[next(n for n in scores if n.label == "L5H3")] == 23.0


def test_mib_sizes_round_down_and_areas_by_hand():
    assert circuit_sizes(32) == [0, 0, 0, 0, 0, 1, 3, 6, 16, 32]
    assert circuit_sizes(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    # f rising linearly 0 → 1 over [0, 1]: CPR ½, CMD ½; f ≡ 1: CPR 1, CMD 0; a dip below 0 counts in CMD.
    assert areas([0, 1], [0, 1]) == (0.5, 0.5)
    assert areas([0, 0.5, 1], [1, 1, 1]) == (1.0, 0.0)
    cpr, cmd = areas([0, 0.5, 1], [0, -1, 1])
    assert cpr == pytest.approx(0.5 * (-0.5) + 0.5 * 0) and cmd == pytest.approx(0.5 * 1.5 + 0.5 * 1.0)


def test_smallest_faithful_circuit():
    import xarray as xr

    ds = xr.Dataset(
        {
            "faithfulness": (("ranking", "size"), [[0.0, 0.5, 0.9, 1.0], [0.0, 0.1, 0.2, 1.0], [0, 0, 0, 0.5]]),
            "kept_fraction": ("size", [0.0, 0.25, 0.5, 1.0]),
        },
        coords={"ranking": ["a", "b", "c"], "size": [0.0, 0.25, 0.5, 1.0]},
    )
    got = smallest_faithful(ds, 0.8)
    assert got.sel(ranking="a") == 0.5 and got.sel(ranking="b") == 1.0 and np.isnan(got.sel(ranking="c"))


def test_bad_rankings_are_refused_by_name(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, n=1)
    heads = {n.label: 1.0 for n in graph_nodes(vlm, ("head",))}
    with pytest.raises(InputError, match="L9H0"):
        faithfulness(vlm, pairs, {**heads, "L9H0": 1.0})
    with pytest.raises(InputError, match="scores no"):
        faithfulness(vlm, pairs, heads, nodes=("head", "mlp"))
    with pytest.raises(InputError, match="ablation"):
        faithfulness(vlm, pairs, heads, ablation="zero")
    with pytest.raises(InputError, match="size"):
        faithfulness(vlm, pairs, heads, sizes=(0.5, 2))
    with pytest.raises(InputError, match="another node set"):
        faithfulness_curves(vlm, pairs, {"a": heads, "b": {n.label: 1.0 for n in graph_nodes(vlm)}})


@pytest.mark.parametrize("name", ["qwen3_vl_moe", "llama4"])
def test_a_moe_layers_experts_are_nodes_in_place_of_its_mlp(name, loaded):
    vlm = loaded(name)
    arch = vlm.arch
    nodes = graph_nodes(vlm, ("head", "mlp", "expert"))
    experts = [n for n in nodes if isinstance(n, Expert)]
    assert len(experts) == arch.n_experts * len(arch.expert_layers)
    assert {n.layer for n in experts} == set(arch.expert_layers)
    assert not any(isinstance(n, MlpOut) and n.layer in arch.expert_layers for n in nodes)
    assert experts[0].label == f"L{arch.expert_layers[0]}E0"


@pytest.mark.numeric
def test_ablating_every_expert_of_a_layer_is_ablating_its_block(loaded):
    """Qwen3-VL-MoE's block is the sum of its experts' contributions: patching every expert's
    contribution (each computed from the corrupt run's routing and input) is patching the block's
    output; one expert patched moves the logits and matches the sweeps' own expert edit."""
    vlm = loaded("qwen3_vl_moe")
    pairs = _pairs(vlm, n=2, image_size=TINY_IMAGE_SIZE["qwen3_vl_moe"][0])
    pb = prepare_pairs(vlm, pairs)
    image = image_positions(vlm, pb.clean)
    layer = vlm.arch.expert_layers[0]
    experts = [n for n in graph_nodes(vlm, ("expert",)) if n.layer == layer]
    block = [n for n in graph_nodes(vlm, ("mlp",)) if n.layer == layer]
    every, one = ablated_logits(
        vlm, pb.clean, [frozenset(experts), frozenset(experts[:1])], record_nodes(vlm, pb.corrupt, experts), image
    )
    (whole,) = ablated_logits(vlm, pb.clean, [frozenset(block)], record_nodes(vlm, pb.corrupt, block), image)
    assert_close(every, whole, what="every expert vs the block")
    cache = cache_run(vlm, pb.corrupt, [layer], resid=False, z=False, experts=True)
    mask = torch.ones(pb.clean.inputs["input_ids"].shape, dtype=torch.bool)
    (edited,) = run_edits(vlm, pb.clean, cache, [[Edit(Expert(layer, 0), mask)]])
    assert_close(one, edited.float().cpu(), what="one expert vs the expert edit")
    with torch.no_grad():
        clean = vlm.forward(pb.clean, logits_to_keep=1).logits[:, -1].float()
    assert float((one - clean).abs().max()) > 0


def test_expert_rankings_make_curves_and_mean_ablation_is_refused(loaded):
    import xarray as xr

    vlm = loaded("qwen3_vl_moe")
    pairs = _pairs(vlm, n=2, image_size=TINY_IMAGE_SIZE["qwen3_vl_moe"][0])
    arch = vlm.arch
    scores = xr.DataArray(
        np.arange(len(arch.expert_layers) * arch.n_experts, dtype=float).reshape(len(arch.expert_layers), -1),
        dims=("layer", "expert"),
        coords={"layer": list(arch.expert_layers), "expert": range(arch.n_experts)},
    )
    assert [n.label for n in node_scores(vlm, scores)] == [n.label for n in graph_nodes(vlm, ("expert",))]
    ds = faithfulness_curves(vlm, pairs, {"experts": scores}, sizes=(0.0, 0.5, 1.0), random_draws=0, batch_size=2)
    np.testing.assert_allclose(ds.faithfulness.sel(size=[0.0, 1.0]).values, [[0.0, 1.0]], atol=1e-6)
    with pytest.raises(InputError, match="mean ablation of experts"):
        faithfulness_curves(vlm, pairs, {"experts": scores}, ablation="mean", random_draws=0, batch_size=2)
    with pytest.raises(InputError, match="no mixture-of-experts"):
        graph_nodes(loaded("toy"), ("expert",))
