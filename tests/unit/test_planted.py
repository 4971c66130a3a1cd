"""Planted circuits: the recovery scores on hand-worked rankings, the resampling hooks against a
by-hand computation, and the training recipe's determinism on a short run."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
import xarray as xr

from countlens.circuits.graph.recovery import auroc, precision_at
from countlens.errors import ConfigError, InputError
from countlens.model.shipped import TOY_DIR
from countlens.toy.plant import PlantConfig, invariance, swapped_nodes, train_planted, train_stages
from countlens.toy.planted import (
    CIRCUITS,
    SOURCES,
    PlantedCircuit,
    PlantedNode,
    Sharpening,
    check_circuit,
    planted_circuit,
)
from countlens.toy.planter import Planter, other_sample, pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig, build_image_processor, build_tokenizer
from countlens.toy.resample import keep_masks, position_masks, recorded, resampled, swap_source
from countlens.toy.train import Collator
from tests.tolerance import assert_close


def _ranking(values) -> xr.DataArray:
    v = np.asarray(values, dtype=float)
    return xr.DataArray(v, dims=("layer", "head"), coords={"layer": range(v.shape[0]), "head": range(v.shape[1])})


def test_auroc_and_precision_on_hand_worked_rankings():
    r = _ranking([[4.0, -3.0], [2.0, 1.0]])
    assert auroc(r, {(0, 0)}) == 1.0 and precision_at(r, {(0, 0)}) == 1.0
    assert auroc(r, {(1, 1)}) == 0.0 and precision_at(r, {(1, 1)}) == 0.0
    # C = {|−3|, 1} against {4, 2}: only 3 > 2 of the 4 comparisons → 0.25; top 2 = L0H0, L0H1.
    assert auroc(r, {(0, 1), (1, 1)}) == 0.25 and precision_at(r, {(0, 1), (1, 1)}) == 0.5
    assert precision_at(r, {(0, 1), (1, 1)}, k=4) == 0.5
    ties = _ranking([[1.0, 1.0], [1.0, 0.0]])
    assert auroc(ties, {(0, 1)}) == pytest.approx((1 + 0.5 + 0.5) / 3)  # ties count one half
    assert precision_at(ties, {(0, 1)}) == 0.0  # the tie at the top goes to head order: L0H0
    ragged = _ranking([[5.0, np.nan], [1.0, 2.0]])  # a layer with one head fewer
    assert auroc(ragged, {(0, 0)}) == 1.0 and precision_at(ragged, {(1, 1)}, k=2) == 0.5


def test_recovery_refuses_what_cannot_be_scored():
    r = _ranking([[1.0, np.nan], [2.0, 3.0]])
    with pytest.raises(InputError, match=r"\(0, 1\).*not heads"):
        auroc(r, {(0, 1)})
    with pytest.raises(InputError, match="every head"):
        auroc(_ranking([[1.0]]), {(0, 0)})
    with pytest.raises(InputError, match="k=9"):
        precision_at(r, {(0, 0)}, k=9)
    with pytest.raises(InputError, match="dims"):
        auroc(xr.DataArray([1.0, 2.0], dims=("layer",)), {(0, 0)})


def test_circuits_are_named_checked_and_each_names_what_is_planted():
    assert set(CIRCUITS) == {"route", "two-hop", "spread", "mlp"}
    mlp = CIRCUITS["mlp"]
    assert mlp.heads == {(0, 2)} and mlp.mlps == {0} and mlp.mlp_nodes
    with pytest.raises(InputError, match="MLP1.*mlp_nodes=True"):
        check_circuit(PlantedCircuit("x", (PlantedNode(1, None),), "-"), n_layers=6, n_heads=4)
    spread = CIRCUITS["spread"]
    assert len(spread.heads) >= 4 and len({layer for layer, _ in spread.heads}) >= 3
    assert CIRCUITS["two-hop"].heads == {(0, 0), (1, 1)} and CIRCUITS["two-hop"].blind_layers == (1,)
    with pytest.raises(InputError, match="route"):
        planted_circuit("routes")
    with pytest.raises(InputError, match="L6H0"):
        check_circuit(PlantedCircuit("x", (PlantedNode(6, 0),), "-"), n_layers=6, n_heads=4)
    with pytest.raises(InputError, match="blind"):
        check_circuit(PlantedCircuit("x", (PlantedNode(0, 0),), "-", blind_layers=(7,)), 6, 4)
    for sources in ((), ("partner", "shuffled")):
        with pytest.raises(InputError, match="strictness sources.*partner"):
            check_circuit(PlantedCircuit("x", (PlantedNode(0, 0),), "-", strict_sources=sources), 6, 4)
    refused = (
        Sharpening(1, 1e-4, 2, 0, (9,), ("partner",)),
        Sharpening(1, 1e-4, 2, 0, (8, 9), ("other",)),
        Sharpening(1, 1e-4, 2, 0, (), ("partner",), different_weight=0.0),
        Sharpening(1, 1e-4, 2, 0, (), ("partner",), invariance_weight=-1.0),
        Sharpening(1, 1e-4, 2, 0, (), ("partner",), invariance_weight=float("inf")),
    )
    for sharpen in refused:
        with pytest.raises(InputError, match="sharpening's strictness sources"):
            check_circuit(PlantedCircuit("x", (PlantedNode(0, 0),), "-", sharpen=sharpen), 6, 4)
    # two-hop alternates all of C with one node in turn; spread swaps all of C every step
    two = CIRCUITS["two-hop"]
    assert [swapped_nodes(two, s) for s in range(4)] == [two.nodes, two.nodes[:1], two.nodes, two.nodes[1:]]
    assert swapped_nodes(spread, 1) == spread.nodes


def test_a_random_source_is_never_the_sample_itself_and_follows_its_seed():
    orders = [other_sample(6, torch.Generator().manual_seed(0)) for _ in range(2)]
    assert torch.equal(orders[0], orders[1])
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        order = other_sample(6, gen)
        assert sorted(order.tolist()) == list(range(6)) and not (order == torch.arange(6)).any()


@pytest.fixture(scope="module")
def organism_batch():
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration.from_pretrained(TOY_DIR, dtype=torch.float32).eval()
    collate = Collator(ToyConfig(), build_tokenizer(), build_image_processor(ToyConfig()))
    inputs, answers, partner = pair_batch(collate, pairs_at(5, 0, 2))
    return model, collate, inputs, answers, partner


def _o_proj_io(model, layer):
    """Record layer ``layer``'s o_proj input and output, and its k_proj output, during the forwards inside."""
    attn = model.model.language_model.layers[layer].self_attn
    seen = {}
    hooks = [
        attn.o_proj.register_forward_hook(lambda m, a, o: seen.update(z=a[0].detach(), out=o.detach())),
        attn.k_proj.register_forward_hook(lambda m, a, o: seen.update(k=o.detach())),
    ]
    return seen, hooks


@pytest.mark.numeric
def test_resampling_one_head_at_one_position_matches_a_by_hand_mix(organism_batch):
    model, collate, inputs, _, partner = organism_batch
    with torch.no_grad(), recorded(model) as rec:
        plain = model(**inputs, logits_to_keep=1).logits
    source = swap_source(rec, partner)
    masks = position_masks(inputs["input_ids"], *Planter(model, CIRCUITS["route"], collate).ids)
    n_layers, n_heads = 6, 4
    nothing = torch.zeros(n_layers, *inputs["input_ids"].shape, n_heads, dtype=torch.bool)
    with torch.no_grad(), resampled(model, source, nothing):  # nothing taken: each hook writes the run's own
        assert torch.equal(model(**inputs, logits_to_keep=1).logits, plain)
    take = keep_masks([PlantedNode(2, 3, at="last")], masks, n_layers, n_heads)

    def run(take, blind=None):
        with torch.no_grad(), resampled(model, source, take, blind):
            seen, hooks = _o_proj_io(model, 2)  # after resampled's own hooks: sees what they made
            try:
                logits = model(**inputs, logits_to_keep=1).logits
            finally:
                for h in hooks:
                    h.remove()
        return seen, logits

    seen, patched = run(take)
    # By hand: head 3's 32 features (head-major layout of z) at the last position from the partner.
    d = model.config.text_config.hidden_size // n_heads
    mixed = rec["z"][2].clone()
    mixed[:, -1, 3 * d : 4 * d] = rec["z"][2][partner][:, -1, 3 * d : 4 * d]
    assert torch.equal(seen["z"], mixed)  # copied values of one forward: no arithmetic between them
    assert_close(seen["out"], model.model.language_model.layers[2].self_attn.o_proj(mixed), what="o_proj of the mix")
    assert not torch.equal(patched, plain)
    seen, _ = run(nothing, blind={2: masks["image"]})
    image = masks["image"]
    assert torch.equal(seen["k"][image], rec["k"][2][partner][image])  # blind: the partner's image keys
    assert torch.equal(seen["k"][~image], rec["k"][2][~image])  # elsewhere its own


def test_planting_is_a_pure_function_of_its_seed(organism_batch):
    from transformers import Qwen2VLForConditionalGeneration

    def weights(seed):
        model = Qwen2VLForConditionalGeneration.from_pretrained(TOY_DIR, dtype=torch.float32)
        train_planted(model, CIRCUITS["two-hop"], PlantConfig(seed=seed, steps=2, batch_pairs=2, threads=1))
        return torch.cat([p.detach().flatten() for p in model.model.language_model.parameters()])

    first = weights(0)
    assert torch.equal(first, weights(0))
    assert not torch.equal(first, weights(1))


def test_each_strictness_source_is_its_own_term_of_the_loss(organism_batch):
    from dataclasses import replace

    from transformers import Qwen2VLForConditionalGeneration

    def run(sources):
        model = Qwen2VLForConditionalGeneration.from_pretrained(TOY_DIR, dtype=torch.float32)
        rows = []
        circuit = replace(CIRCUITS["two-hop"], strict_sources=sources)
        train_planted(model, circuit, PlantConfig(steps=1, batch_pairs=2, threads=1), rows.append)
        return rows[0], torch.cat([p.detach().flatten() for p in model.model.language_model.parameters()])

    (partner, w_partner), (rand, w_rand), (both, w_both) = map(run, [("partner",), ("random",), SOURCES])
    assert "strict_random" not in partner and "strict" not in rand
    # Each source's strictness loss is its own forward of the same batch before any step: the same computation.
    assert both["strict"] == partner["strict"] and both["strict_random"] == rand["strict_random"]
    assert partner["strict"] != rand["strict_random"]  # another sample's activations, not the partner's
    assert not torch.equal(w_partner, w_rand) and not torch.equal(w_both, w_partner)


def test_an_mlp_node_is_resampled_like_a_by_hand_mix(organism_batch):
    """An MLP node's output at the chosen positions comes from the source, elsewhere from the run itself;
    every other MLP of an mlp_nodes circuit is resampled by strictness, none of a heads-only circuit."""
    from countlens.toy.resample import mlp_keep_masks

    model, collate, inputs, answers, partner = organism_batch
    planter = Planter(model, CIRCUITS["mlp"], collate)
    with torch.no_grad():
        rec = planter.record(inputs)[0]
    source = swap_source(rec, partner)
    masks = planter.masks(inputs)
    keep = mlp_keep_masks(CIRCUITS["mlp"].nodes, masks, 6)
    assert keep[0].equal(masks["last"]) and not keep[1:].any()
    swapped = _seen_after_resampling(model, lambda: planter.swapped_logits(inputs, source, (PlantedNode(0, None),)))
    assert torch.equal(swapped[0], source["mlp"][0])  # every position from the partner
    assert not torch.equal(swapped[2], source["mlp"][2])  # the others clean
    last = masks["last"]
    strict = _seen_after_resampling(model, lambda: planter.strict_logits(inputs, source, training=True))
    assert torch.equal(strict[3], source["mlp"][3])  # outside C: the partner's everywhere
    assert not torch.equal(strict[0][last], source["mlp"][0][last])  # kept at the last token
    assert torch.equal(strict[0][~last], source["mlp"][0][~last])  # elsewhere resampled in training
    route = Planter(model, CIRCUITS["route"], collate)
    route_out = _seen_after_resampling(model, lambda: route.strict_logits(inputs, source, training=False))
    assert not torch.equal(route_out[3], source["mlp"][3])  # a heads-only circuit never resamples MLPs


def _seen_after_resampling(model, run) -> list:
    """Each MLP's output as the rest of the forward sees it: recorded by hooks placed after the resampling's."""
    import countlens.toy.planter as planter_module

    inner, seen = planter_module.resampled, {}

    @contextmanager
    def spying(*args, **kw):
        with inner(*args, **kw), recorded(model) as rec:
            yield
        seen.update(rec)

    planter_module.resampled = spying
    try:
        with torch.no_grad():
            run()
    finally:
        planter_module.resampled = inner
    return seen["mlp"]


def test_high_counts_draw_every_other_pair_and_leave_the_rest_as_they_were():
    plain, high = pairs_at(1000, 4, 6), pairs_at(1000, 4, 6, (7, 8, 9))
    for i, (p, h) in enumerate(zip(plain, high, strict=True)):
        counts = {h.clean.meta["count"], h.corrupt.meta["count"]}
        if (4 + i) % 2:
            assert counts <= {7, 8, 9}
        else:
            assert counts == {p.clean.meta["count"], p.corrupt.meta["count"]} and h.clean.scene == p.clean.scene


def test_a_sharpening_stage_runs_after_the_first_from_its_weights():
    from dataclasses import replace

    from transformers import Qwen2VLForConditionalGeneration

    def model():
        return Qwen2VLForConditionalGeneration.from_pretrained(TOY_DIR, dtype=torch.float32)

    def weights(m):
        return torch.cat([p.detach().flatten() for p in m.model.language_model.parameters()])

    pc = PlantConfig(steps=1, batch_pairs=2, threads=1)
    sharpen = Sharpening(1, 1e-4, 2, 5, (8, 9), ("partner", "same"))
    circuit = replace(CIRCUITS["route"], sharpen=sharpen)
    first, both = model(), model()
    train_planted(first, CIRCUITS["route"], pc)
    rows = []
    train_stages(both, circuit, pc, rows.append)
    assert [r.get("stage") for r in rows] == [None, 2] and "strict_same" in rows[1] and "strict_same" not in rows[0]
    # The second stage by hand: the first stage's weights, then its own recipe.
    train_planted(
        first,
        replace(circuit, strict_sources=sharpen.strict_sources),
        replace(pc, seed=5, lr=1e-4, warmup=10),
        None,
        (8, 9),
    )
    assert torch.equal(weights(first), weights(both))  # the same trainings in one process: bit for bit


def test_the_invariance_term_is_the_kl_from_the_clean_answers_by_hand():
    gen = torch.Generator().manual_seed(0)
    clean, a, b = (torch.randn(5, 12, generator=gen, dtype=torch.float64) for _ in range(3))
    p = clean.softmax(-1)

    def kl(q_logits):  # Σ_i p_i (log p_i − log q_i), averaged over the batch
        return float((p * (p.log() - q_logits.softmax(-1).log())).sum(-1).mean())

    assert float(invariance(clean, [clean])) == pytest.approx(0.0, abs=1e-12)
    assert float(invariance(clean, [a, b])) == pytest.approx(kl(a) + kl(b), rel=1e-9)
    assert float(invariance(clean, [a])) > 0
    q = a.clone().requires_grad_(True)
    c = clean.clone().requires_grad_(True)
    invariance(c, [q]).backward()
    assert c.grad is None and q.grad.abs().sum() > 0  # the clean run is the target, held fixed
    with pytest.raises(ConfigError, match="invariance_weight"):
        PlantConfig(invariance_weight=-0.5)


def test_a_weighted_invariance_term_is_logged_and_trains_other_weights(organism_batch):
    from transformers import Qwen2VLForConditionalGeneration

    def run(weight):
        model = Qwen2VLForConditionalGeneration.from_pretrained(TOY_DIR, dtype=torch.float32)
        rows = []
        train_planted(
            model, CIRCUITS["route"], PlantConfig(steps=1, batch_pairs=2, invariance_weight=weight), rows.append
        )
        return rows[0], torch.cat([p.detach().flatten() for p in model.model.language_model.parameters()])

    (plain, w_plain), (weighted, w_weighted) = run(0.0), run(2.0)
    assert "invariance" not in plain and weighted["invariance"] > 0
    assert plain["strict"] == weighted["strict"] and plain["clean"] == weighted["clean"]  # the same forward
    assert not torch.equal(w_plain, w_weighted)
