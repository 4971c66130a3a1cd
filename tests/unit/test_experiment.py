"""Your own experiment: sites, positions and interventions, under `effect` and `intervene`, each
checked against a plain-torch computation that shares no code with countlens's hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerance import assert_close, scale_of

import countlens as cl
from countlens.circuits import (
    Add,
    Apply,
    Cells,
    HeadZ,
    Mask,
    Mean,
    MlpIn,
    MlpOut,
    Objects,
    Patch,
    Q,
    Resample,
    Residual,
    Scale,
    V,
    Zero,
    effect,
    head_temperature,
    intervene,
    mean_difference,
    patch_heads,
    patch_layers,
    record,
)
from countlens.circuits.engine.edits import cache_run
from countlens.circuits.engine.pair_batch import logit_diff, prepare_pairs
from countlens.datasets.pairs import count_pairs
from countlens.errors import CountlensError, InputError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def pairs(organism):
    return count_pairs(4, 3, 5, kind="shapes", grid=organism.geometry, prompt="short", seed=11)


def _plain_logits(vlm, batch, module_path, edit, pre=False):
    """The last-position logits of ``batch`` with ``edit(tensor)`` applied by one plain torch hook."""
    module = vlm.hf.get_submodule(module_path)
    if pre:
        handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0].clone()), *args[1:]))
    else:
        handle = module.register_forward_hook(lambda m, args, out: edit(out.clone()))
    try:
        with torch.no_grad():
            return vlm.hf(**batch.inputs, use_cache=False).logits[:, -1].float()
    finally:
        handle.remove()


@pytest.mark.numeric
def test_effect_equals_the_patching_grids(organism, pairs):
    layers = patch_layers(organism, pairs, layers=[2], groups=("last", "image"))
    heads = patch_heads(organism, pairs, layers=[0])
    # The same patches in the same order: the grids are effect grids, so the numbers are the same to the bit.
    resid = effect(organism, pairs, {g: [Patch(Residual(2), positions=g)] for g in ("last", "image")})
    head = effect(organism, pairs, {f"L0H{h}": [Patch(HeadZ(0, h))] for h in range(4)})
    np.testing.assert_array_equal(resid.effect.values, layers.effect.sel(layer=2).values)
    np.testing.assert_array_equal(head.effect.values, heads.effect.sel(layer=0).values)
    np.testing.assert_array_equal(head.logit_diff.values, heads.logit_diff.sel(layer=0).values)
    assert head.attrs["method"] == "effect" and "Patch" in head.attrs["interventions"]
    # One patch alone runs in another stacking: equal to its grid cell up to rounding.
    one = effect(organism, pairs, Patch(HeadZ(0, 1)))
    assert_close(one.logit_diff.values, heads.logit_diff.sel(layer=0, head=1).values, what="one patch vs its cell")


@pytest.mark.numeric
def test_patch_under_intervene_equals_effect_and_a_plain_hook(organism, pairs):
    pb = prepare_pairs(organism, pairs)
    donor = record(organism, pb.corrupt, [V(0, 1)])[V(0, 1)]
    got = effect(organism, pairs, [Patch(V(0, 1), positions="image")])
    # The donor rows are the corrupt samples, written into the clean ones: into= names them.
    with intervene(organism, Patch(V(0, 1), positions="image", values=donor, into=[p.clean for p in pairs])):
        edited = organism.forward(pb.clean).logits[:, -1].float()
    image = cl.circuits.sites.group_mask(pb.clean, "image")
    cols = slice(32, 64)  # key-value head 1 of 2, 32 wide

    def plain(out):
        out[..., cols][image] = donor[image].to(out.dtype)
        return out

    ref = _plain_logits(organism, pb.clean, organism.arch.layer(0) + ".self_attn.v_proj", plain)
    scale = scale_of(ref)
    assert_close(edited, ref, what="Patch(V) under intervene vs a plain hook")
    assert_close(got.logit_diff.values, logit_diff(ref, pb.clean_id, pb.corrupt_id), scale=scale)


@pytest.mark.numeric
def test_record_reads_what_the_cache_reads(organism, pairs):
    pb = prepare_pairs(organism, pairs)
    got = record(organism, pb.clean, [Residual(-1), Residual(2), HeadZ(1, 3)])
    cache = cache_run(organism, pb.clean, [-1, 1, 2])
    assert_close(got[Residual(-1)], cache["resid"][-1])
    assert_close(got[Residual(2)], cache["resid"][2])
    assert_close(got[HeadZ(1, 3)], cache["z"][1][..., 96:128])


@pytest.mark.numeric
def test_record_reads_attention_patterns(organism, pairs):
    from countlens.circuits.engine.attention import last_token_attention
    from countlens.circuits.sites import Pattern

    batch = prepare_pairs(organism, pairs).clean
    got = record(organism, batch, [Pattern(1, 2)])[Pattern(1, 2)]  # batch × query × key
    assert got.shape[1] == got.shape[2] and torch.allclose(
        got.sum(-1)[batch.inputs["attention_mask"].bool()], torch.ones(1)
    )
    assert_close(
        got[:, -1], last_token_attention(organism, batch, [1])[0, :, 2], what="Pattern vs last_token_attention"
    )
    with pytest.raises(InputError, match="read only"):
        Scale(Pattern(1, 2), 2.0)


@pytest.mark.numeric
def test_steering_under_scoring_and_generation_matches_plain_hooks(organism, pairs):
    clean, corrupt = [p.clean for p in pairs], [p.corrupt for p in pairs]
    v = mean_difference(organism, corrupt, clean, Residual(3), "last")
    # mean_difference is the difference of plain means over the last token's residual.
    batch_a, batch_b = organism.prepare_samples(corrupt), organism.prepare_samples(clean)
    with torch.no_grad():
        ha = organism.hf(**batch_a.inputs, output_hidden_states=True).hidden_states[4][:, -1].mean(0)
        hb = organism.hf(**batch_b.inputs, output_hidden_states=True).hidden_states[4][:, -1].mean(0)
    assert_close(v, ha - hb, what="mean_difference")

    def steer(out):
        out[:, -1] += 0.5 * v
        return out

    path = organism.arch.layer(3)
    batch = organism.prepare_samples(clean)
    ref = _plain_logits(organism, batch, path, steer)
    with intervene(organism, Add(Residual(3), v, alpha=0.5, positions="last")):
        got = organism.forward(batch).logits[:, -1].float()
        generated = organism.hf.generate(**batch.inputs, max_new_tokens=3, do_sample=False)
    assert_close(got, ref, what="Add under intervene")
    # Generation: every new token is `last`, so it is steered too — as a hook on the last column does.
    handle = organism.hf.get_submodule(path).register_forward_hook(lambda m, a, out: steer(out.clone()))
    try:
        expected = organism.hf.generate(**batch.inputs, max_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    # Token ids: each step's arg-max of the two steered forwards, which agree to rounding (above); only a tie
    # within rounding could split them, and each step's top two stand ≥ 0.25 apart here (measured).
    assert torch.equal(generated, expected)


@pytest.mark.numeric
def test_scale_on_q_is_head_temperature(organism, pairs):
    batch = organism.prepare_samples([p.clean for p in pairs])
    with head_temperature(organism, {(1, 2): 1.7}):
        ref = organism.forward(batch).logits[:, -1].float()
    with intervene(organism, Scale(Q(1, 2), 1.7)):
        got = organism.forward(batch).logits[:, -1].float()
    assert_close(got, ref, what="Scale(Q) vs head_temperature")


@pytest.mark.numeric
def test_zero_mean_apply_and_mlp_sites(organism, pairs):
    batch = organism.prepare_samples([p.clean for p in pairs])
    z_path = organism.arch.o_proj(0)

    def zero_head(z):
        z[..., 0:32] = 0
        return z

    ref = _plain_logits(organism, batch, z_path, zero_head, pre=True)
    with intervene(organism, Zero(HeadZ(0, 0))):
        got = organism.forward(batch).logits[:, -1].float()
    assert_close(got, ref, what="Zero(HeadZ)")
    # Apply(x ↦ 0) is Zero; a Mean of a zero vector is Zero too.
    with intervene(organism, Apply(HeadZ(0, 0), torch.zeros_like)):
        assert_close(organism.forward(batch).logits[:, -1].float(), ref)
    with intervene(organism, Mean(HeadZ(0, 0), torch.zeros(32))):
        assert_close(organism.forward(batch).logits[:, -1].float(), ref)
    # An MLP's input patched everywhere from a run gives that run's MLP output.
    rec = record(organism, batch, [MlpIn(1), MlpOut(1)])
    with intervene(organism, Scale(MlpOut(1), 0.0)):
        zeroed = organism.forward(batch).logits[:, -1].float()
    with intervene(organism, Zero(MlpOut(1))):
        assert_close(organism.forward(batch).logits[:, -1].float(), zeroed)
    assert rec[MlpIn(1)].shape == rec[MlpOut(1)].shape


def test_object_positions_are_the_scene_s_tokens(organism, pairs):
    batch = organism.prepare_samples([p.corrupt for p in pairs])
    scene = pairs[0].corrupt.scene
    grid = batch.geometry[0].token_grid
    # Independent: each object's pixel share of each token cell, from the scene's own masks.
    masks = scene.masks()
    rows, cols = grid
    h, w = scene.height // rows, scene.width // cols
    share = masks.reshape(len(masks), rows, h, cols, w).mean((2, 4))
    for coverage in (0.25, 0.0):
        from countlens.circuits.sites.positions import Frame

        got = Objects([4], coverage=coverage).mask(organism, Frame.of(batch))[0]
        covered = share[4] >= coverage if coverage else share[4] > 0
        covered |= share[4] == share[4].max()
        expected = torch.zeros_like(got)
        for pos, (r, c) in zip(batch.image_pos[0], batch.image_cell[0].tolist()):
            expected[pos] = bool(covered[r, c])
        assert torch.equal(got, expected) and got.any()
    cell = tuple(batch.image_cell[0][0].tolist())
    cells = Cells([cell]).mask(organism, Frame.of(batch))
    assert cells[0, batch.image_pos[0][0]] and int(cells[0].sum()) == 1


def test_object_patching_carries_the_extra_objects(organism, pairs):
    # The corrupt scene's two extra objects (3 and 4), patched at the embeddings, carry the count.
    extra = effect(organism, pairs, Patch(Residual(-1), positions=Objects([3, 4], of="donor")))
    shared = effect(organism, pairs, Patch(Residual(-1), positions=Objects([0])))
    assert float(extra.effect) > 0.5 > abs(float(shared.effect))


def test_resample_takes_donor_rows(organism, pairs):
    donors = [p.corrupt for p in pairs]
    item = Resample(Residual(2), donors, seed=3, positions="last").resolved(organism)
    order = np.random.default_rng(3).permutation(len(donors))
    rec = record(organism, organism.prepare_samples(donors), [Residual(2)])[Residual(2)]
    assert torch.equal(item.values, rec[torch.from_numpy(order)])  # the same record of the same batch, permuted


def _forwards(vlm):
    calls = []
    return calls, vlm.hf.register_forward_pre_hook(lambda m, a: calls.append(1))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda vlm: Add(Residual(1), torch.ones(7)), "is \\(7,\\); Residual\\(layer=1\\) is 128 wide"),
        (lambda vlm: Add(Residual(1), torch.full((128,), float("inf"))), "NaN or ±inf"),
        (lambda vlm: Scale(Q(9, 0), 2.0), "layer 9 out of range"),
        (lambda vlm: Scale(Q(0, 7), 2.0), "head 7 out of range"),
        (lambda vlm: Zero(V(0, 2)), "key-value head 2 out of range"),
        (lambda vlm: Patch(Residual(0), positions="images"), "unknown token group 'images'"),
        (lambda vlm: Scale(Residual(0), float("nan")), "finite number"),
        (lambda vlm: Patch(Residual(1), positions=Objects([7], of="donor")), "has no object 7"),
        (lambda vlm: Patch(Residual(1), positions=Cells([(9, 0)])), "outside sample 0's 6×6"),
        (lambda vlm: Patch(Residual(1), positions=Mask(torch.ones(4, 3, dtype=torch.bool))), "does not fit"),
    ],
)
def test_bad_interventions_are_refused_before_any_forward(organism, pairs, make, match):
    calls, handle = _forwards(organism)
    try:
        with pytest.raises(CountlensError, match=match):
            effect(organism, pairs, make(organism))
    finally:
        handle.remove()
    assert not calls


def test_intervene_refuses_what_it_cannot_do(organism):
    with pytest.raises(InputError, match="needs values="):
        with intervene(organism, Patch(Residual(1))):
            pass
    with pytest.raises(InputError, match="give an intervention"):
        with intervene(organism, []):
            pass
    with pytest.raises(InputError, match="takes a site"):
        Patch("L0H0")
    with pytest.raises(InputError, match="Objects takes object indices"):
        Objects([-1])


def test_head_level_lora_leaves_other_heads_unchanged(tmp_path):
    from countlens.datasets import task_samples
    from countlens.training import FinetuneConfig, finetune, with_adapter

    vlm = cl.load("toy")  # private: fine-tuning wraps the model in LoRA layers
    before = {n: p.detach().clone() for n, p in vlm.hf.named_parameters()}
    config = FinetuneConfig(steps=2, batch_size=4, target_heads=((0, 1),), focus=0.0, lr=1e-2)
    tuned = with_adapter("toy", finetune(vlm, task_samples("count", 8, seed=3), tmp_path, config))
    after = dict(tuned.hf.named_parameters())
    changed = {n: (before[n] != after[n].detach()) for n in before if not torch.equal(before[n], after[n].detach())}
    attn = "model.language_model.layers.0.self_attn."
    assert set(changed) == {attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    head, kv = slice(32, 64), slice(0, 32)  # head 1 of 4 (32 wide); its key-value head 0 of 2
    for proj, rows in (("q_proj", head), ("k_proj", kv), ("v_proj", kv)):
        diff = changed[attn + proj + ".weight"]
        assert diff[rows].any() and not diff.clone().index_fill_(0, torch.arange(rows.start, rows.stop), False).any()
    diff = changed[attn + "o_proj.weight"]
    assert diff[:, head].any() and not diff.clone().index_fill_(1, torch.arange(32, 64), False).any()


def test_head_level_config_and_top_heads_are_checked():
    import pandas as pd

    from countlens.errors import ConfigError
    from countlens.training import FinetuneConfig, top_heads_from

    with pytest.raises(ConfigError, match="use method='lora'"):
        FinetuneConfig(target_heads=((0, 1),), method="full")
    with pytest.raises(ConfigError, match="\\(layer, head\\) pairs"):
        FinetuneConfig(target_heads=("L0X1",))  # labels are taken ("L0H1"); a misspelt one is not
    table = pd.DataFrame(
        {"layer": [0, 1, 2], "head": [1, 0, 3], "importance": [0.2, 0.9, 0.5], "class": ["a", "b", "a"]}
    )
    assert top_heads_from(table, k=2) == ((1, 0), (2, 3))
    assert top_heads_from(table, k=5, classes=["a"]) == ((2, 3), (0, 1))
    with pytest.raises(ConfigError, match="no head of class"):
        top_heads_from(table, classes=["c"])


@pytest.mark.numeric
def test_a_logit_lens_in_raw_nnsight_is_the_model_s_own_head(organism, pairs):
    import nnsight

    batch = organism.prepare_samples([p.clean for p in pairs])
    with organism.trace(batch):
        lens = nnsight.save([organism.unembed(organism.module(organism.arch.layer(i)).output[:, -1]) for i in (2, 5)])
    with torch.no_grad():
        out = organism.hf(**batch.inputs, output_hidden_states=True)
        norm = organism.hf.get_submodule(organism.arch.spec.final_norm)
        plain = organism.hf.get_submodule(organism.arch.spec.lm_head)(norm(out.hidden_states[3][:, -1]))
    assert_close(lens[0], plain, what="unembed of layer 2's residual")
    assert_close(lens[1], out.logits[:, -1], what="unembed of the last layer is the model's logits")


def test_intervene_holds_under_an_nnsight_trace_with_object_positions(organism, pairs):
    batch = organism.prepare_samples([p.clean for p in pairs])
    edits = [Zero(HeadZ(0, 0)), Zero(Residual(1), positions=Objects([0]))]
    with intervene(organism, edits):
        plain = organism.forward(batch).logits[:, -1].float()
        with organism.trace(batch):
            traced = organism.nn.output.logits[:, -1].save()
    assert torch.equal(traced.float(), plain)  # one forward under the same hooks, traced or not: bit for bit
    assert not torch.allclose(plain, organism.forward(batch).logits[:, -1].float())  # the edits took effect
