"""Planting a circuit of edges: the toy's edge forward (countlens's edge engine in the toy's terms, masks and
donor lists) against the model's own forward and against the engine called as its other callers call it
(`record_nodes` of the corrupts, image positions from the batch), its refusals, and the training recipe's
determinism on a short run. Planting's losses and gradients against the hand-written decoder it replaced:
``tests/unit/test_one_edge_forward.py``."""

from __future__ import annotations

import random

import pytest
import torch

from countlens.errors import InputError
from countlens.model.shipped import ORGANISMS
from countlens.toy.catalogue import planted_circuit_of, planted_edges_of
from countlens.toy.edge_forward import EdgeForward, EdgeSpace, prepare
from countlens.toy.edge_plant import train_edges
from countlens.toy.plant import PlantConfig
from countlens.toy.planted import EDGE_CIRCUITS, edge_circuit
from countlens.toy.planter import pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.train import Collator
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def toy_batch(loaded):
    vlm = loaded("toy")
    pairs = pairs_at(5, 0, 3)
    inputs, answers, partner = pair_batch(Collator(ToyConfig()), pairs)
    return vlm, pairs, inputs, answers, partner


def test_the_edge_forward_is_the_models_forward_and_countlens_edge_ablation(toy_batch):
    from countlens.circuits.engine.pair_batch import prepare_pairs
    from countlens.circuits.graph.edge_ablation import edge_ablated_logits
    from countlens.circuits.graph.edges import edge_graph
    from countlens.circuits.graph.nodes import image_positions, record_nodes

    vlm, pairs, inputs, _, partner = toy_batch
    model = vlm.hf
    fwd = EdgeForward(model)
    with torch.no_grad():
        prep = prepare(model, inputs)
        plain = model(**inputs, logits_to_keep=1).logits[:, -1]
        logits, outs = fwd(prep)
        assert_close(logits, plain, what="no edge ablated: the model's own logits")
        donor = [o[partner] for o in outs]
        assert_close(fwd(prep, fwd.valid, donor)[0], plain[partner], what="every edge ablated: the donor's logits")
        # countlens's engine on the same pairs: the cleans, every edge's ablation value the corrupt's.
        pb = prepare_pairs(vlm, pairs)
        graph = edge_graph(vlm)
        labels = graph.labels()
        assert labels == fwd.space.edges  # the same edges, named and ordered alike
        values = record_nodes(vlm, pb.corrupt, graph.nodes)
        rng = random.Random(0)
        sets = [frozenset(rng.sample(range(len(labels)), k)) for k in (3, 80, len(labels) - 5)]
        theirs = edge_ablated_logits(vlm, graph, pb.clean, sets, values, image_positions(vlm, pb.clean))
        n = len(pairs)
        for edges, expected in zip(sets, theirs, strict=True):
            mine = fwd(prep, fwd.space.mask([labels[i] for i in edges]), donor)[0][:n]
            assert_close(mine, expected, what=f"{len(edges)} edges ablated")
            assert not torch.allclose(expected, plain[:n], atol=1e-3)  # the ablation moved something


def test_edge_masks_and_the_forward_refuse_what_is_not_an_edge(toy_batch):
    vlm, _, inputs, _, _ = toy_batch
    space = EdgeSpace(6, 4, 2)
    assert len(space.edges) == 839 and space.mask(["IN.image→L0K1.v"]).sum() == 1
    with pytest.raises(InputError, match="not upstream"):
        space.mask(["L3H0→L1H0.q"])
    with pytest.raises(InputError, match="write it as"):
        space.mask(["L0H9→MLP1.in"])
    assert not (space.all_but(["MLP1→logits"]) & ~space.valid()).any()
    fwd = EdgeForward(vlm.hf)
    with pytest.raises(InputError, match="donor"):
        fwd(None, fwd.valid)
    padded = dict(inputs, attention_mask=inputs["attention_mask"].clone())
    padded["attention_mask"][0, 0] = 0
    with pytest.raises(InputError, match="one length"):
        prepare(vlm.hf, padded)


def test_the_edge_circuit_is_named_and_its_organism_maps_to_its_nodes():
    circuit = edge_circuit("value-route")
    with pytest.raises(InputError, match="value-route"):
        edge_circuit("nope")
    space = EdgeSpace(6, 4, 2)
    space.mask(circuit.edges)  # every planted edge is an edge of the organism
    assert set(circuit.swapped) <= set(circuit.edges)
    assert planted_edges_of("planted-value-route") is EDGE_CIRCUITS["value-route"]
    nodes = planted_circuit_of("planted-value-route")
    assert nodes.heads == {(0, 2)} and nodes.mlps == {1} and nodes.mlp_nodes
    assert planted_edges_of("planted-route") is None and "planted-value-route" in ORGANISMS


def test_edge_planting_is_a_pure_function_of_its_seed_and_weights_its_invariance_term():
    from transformers import Qwen2VLForConditionalGeneration

    def weights(seed, **weights):
        model = Qwen2VLForConditionalGeneration.from_pretrained(ORGANISMS["toy"], dtype=torch.float32)
        rows = []
        pc = PlantConfig(seed=seed, steps=2, batch_pairs=2, **weights)
        train_edges(model, EDGE_CIRCUITS["value-route"], pc, rows.append)
        return rows, torch.cat([p.detach().flatten() for p in model.model.language_model.parameters()])

    (rows, first), (_, again), (_, other) = weights(0), weights(0), weights(1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert {"clean", "strict_partner", "strict_different", "swap"} <= rows[-1].keys()
    assert "invariance" not in rows[-1]
    (invariant, w_invariant) = weights(0, invariance_weight=2.0)
    assert invariant[-1]["invariance"] > 0 and not torch.equal(w_invariant, first)


def test_an_edge_circuits_second_stage_is_its_own_recipe_from_the_first_stages_weights():
    """`train_stages` with `train_edges` = the first stage, then the `Sharpening` by hand: its sources, seed, rate and
    its different-count term weighted (a weight of 1 trains other weights)."""
    from dataclasses import replace

    from transformers import Qwen2VLForConditionalGeneration

    from countlens.toy.plant import train_stages
    from countlens.toy.planted import Sharpening

    def model():
        return Qwen2VLForConditionalGeneration.from_pretrained(ORGANISMS["toy"], dtype=torch.float32)

    def weights(m):
        return torch.cat([p.detach().flatten() for p in m.model.language_model.parameters()])

    pc = PlantConfig(steps=1, batch_pairs=2)
    sharpen = Sharpening(1, 1e-4, 2, 5, (), ("partner", "different", "same"), different_weight=3.0)
    circuit = replace(EDGE_CIRCUITS["value-route"], sharpen=sharpen)
    rows: list = []
    staged = model()
    train_stages(staged, circuit, pc, rows.append, train_edges)
    assert [r.get("stage") for r in rows] == [None, 2] and "strict_same" in rows[1]
    second = replace(circuit, strict_sources=sharpen.strict_sources)
    by_hand = {}
    for w in (3.0, 1.0):
        m = model()
        train_edges(m, circuit, pc)
        train_edges(m, second, PlantConfig(seed=5, steps=1, batch_pairs=2, lr=1e-4, warmup=10, different_weight=w))
        by_hand[w] = weights(m)
    # The same two trainings, the same steps, in one process: bit for bit.
    assert torch.equal(weights(staged), by_hand[3.0]) and not torch.equal(by_hand[3.0], by_hand[1.0])
