"""Interventions that read another site (`Replace`) and attention knockout (`Block`), under `intervene`,
each checked against plain torch on the shared organism; their refusals come before any forward."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tolerance import assert_close

from countlens.circuits import (
    Block,
    Cells,
    HeadZ,
    Mask,
    MlpIn,
    MlpOut,
    Objects,
    Replace,
    Residual,
    Zero,
    effect,
    intervene,
    record,
)
from countlens.circuits.engine.attention import eager_attention
from countlens.circuits.sites import Pattern, group_mask
from countlens.datasets.pairs import count_pairs
from countlens.errors import CountlensError, InputError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def pairs(organism):
    return count_pairs(4, 3, 5, kind="shapes", grid=organism.geometry, prompt="short", seed=11)


@pytest.fixture(scope="module")
def batch(organism, pairs):
    return organism.prepare_samples([p.clean for p in pairs])


def _logits(vlm, batch, hooks=()):
    """Last-position logits with plain torch hooks: (module path, pre?, fn) each."""
    handles = []
    for path, pre, fn in hooks:
        module = vlm.hf.get_submodule(path)
        handles.append(module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn))
    try:
        with torch.no_grad():
            return vlm.hf(**batch.inputs, use_cache=False).logits[:, -1].float()
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------- Replace


@pytest.mark.numeric
def test_replace_writes_a_function_of_an_earlier_site(organism, batch):
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) / 12

    def fn(x):
        return torch.tanh(x @ w)

    mlp = organism.arch.mlp(1)
    # The MLP's output rewritten from its input (a transcoder's place), by hand: a hook on the MLP.
    ref = _logits(organism, batch, [(mlp, False, lambda m, args, out: fn(args[0]))])
    with intervene(organism, Replace(MlpOut(1), fn, reads=MlpIn(1))):
        got = organism.forward(batch).logits[:, -1].float()
    assert_close(got, ref, what="Replace(MlpOut, reads=MlpIn) vs a plain hook")
    # The read is what the forward has there: after a Zero of MlpIn, fn reads zeros (and the MLP too).
    zeros = _logits(organism, batch, [(mlp, False, lambda m, args, out: fn(torch.zeros_like(out)))])
    with intervene(organism, [Zero(MlpIn(1)), Replace(MlpOut(1), fn, reads=MlpIn(1))]):
        assert_close(organism.forward(batch).logits[:, -1].float(), zeros, what="Replace after a Zero of its read")
    # Across layers, with the site's own value among the reads: Residual(3) += Residual(1), last token only.
    seen = {}

    def add_r1(m, args, out):
        return torch.cat([out[:, :-1], out[:, -1:] + seen["r1"][:, -1:]], 1)

    plain = [(organism.arch.layer(1), False, lambda m, a, out: seen.update(r1=out.clone()))]
    ref = _logits(organism, batch, [*plain, (organism.arch.layer(3), False, add_r1)])
    item = Replace(Residual(3), lambda r1, r3: r3 + r1, reads=(Residual(1), Residual(3)), positions="last")
    with intervene(organism, item):
        got = organism.forward(batch).logits[:, -1].float()
    assert_close(got, ref, what="Replace(Residual(3), reads=(Residual(1), itself))")


def _forwards(vlm):
    calls = []
    return calls, vlm.hf.register_forward_pre_hook(lambda m, a: calls.append(1))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Replace(MlpOut(1), torch.tanh, reads=MlpOut(2)), "computes after MlpOut\\(layer=1\\)"),
        (lambda: Replace(MlpIn(1), torch.tanh, reads=MlpOut(1)), "reads MlpOut\\(layer=1\\), which the forward"),
        (lambda: Replace(HeadZ(1, 0), torch.tanh, reads=HeadZ(1, 1)), "at the same step as HeadZ"),
        (lambda: Replace(MlpOut(2), torch.tanh), "takes reads="),
        (lambda: Replace(MlpOut(1), torch.tanh, reads=Pattern(0, 0)), "Replace reads sites"),
        (lambda: Replace(MlpOut(1), lambda x: x * float("nan"), reads=MlpIn(1)), "NaN or ±inf"),
        (lambda: Replace(MlpOut(1), lambda x: x[:, :3], reads=MlpIn(1)), "returned \\(2, 3\\)"),
        (lambda: Replace(MlpOut(9), lambda x: x, reads=MlpIn(9)), "layer 9 out of range"),
        (lambda: Block(1, 7, queries="last", keys="image"), "head 7 out of range"),
        (lambda: Block(9, queries="last", keys="image"), "layer 9 out of range"),
        (lambda: Block(1, queries="last", keys="pictures"), "unknown token group 'pictures'"),
    ],
)
def test_bad_reads_and_blocks_are_refused_before_any_forward(organism, make, match):
    calls, handle = _forwards(organism)
    try:
        with pytest.raises(CountlensError, match=match):
            with intervene(organism, make()):
                pass
    finally:
        handle.remove()
    assert not calls


def test_effect_refuses_replace_and_block_naming_intervene(organism, pairs):
    calls, handle = _forwards(organism)
    try:
        for item in (Replace(MlpOut(1), torch.tanh, reads=MlpIn(1)), Block(1, queries="last", keys="image")):
            with pytest.raises(InputError, match="runs under intervene only"):
                effect(organism, pairs, item)
    finally:
        handle.remove()
    assert not calls


# ----------------------------------------------------------------------------- Block


@pytest.mark.numeric
def test_block_renormalises_the_chosen_head_over_the_keys_left(organism, batch):
    base = organism.forward(batch).logits[:, -1].float()
    none = Mask(torch.zeros(1, batch.inputs["input_ids"].shape[1], dtype=torch.bool))
    with intervene(organism, Block(2, queries="last", keys=none)):  # no (query, key) pair: the forward as it is
        assert torch.equal(organism.forward(batch).logits[:, -1].float(), base)
    before = record(organism, batch, [Pattern(2, 1), Pattern(2, 0)])
    with intervene(organism, Block(2, 1, queries="last", keys="image")):
        sdpa = organism.forward(batch).logits[:, -1].float()
        with eager_attention(organism):
            eager = organism.forward(batch).logits[:, -1].float()
        after = record(organism, batch, [Pattern(2, 1), Pattern(2, 0)])
    # By hand: the last query's probabilities with the image keys removed, renormalised; nothing else moves.
    kept = before[Pattern(2, 1)][:, -1] * ~group_mask(batch, "image")
    assert_close(after[Pattern(2, 1)][:, -1], kept / kept.sum(-1, keepdim=True), what="the blocked head's last row")
    assert torch.equal(after[Pattern(2, 1)][:, :-1], before[Pattern(2, 1)][:, :-1])
    assert torch.equal(after[Pattern(2, 0)], before[Pattern(2, 0)])
    # sdpa (the causal mask written out) and eager (its additive mask) agree, and the knockout matters.
    assert_close(sdpa, eager, what="Block under sdpa vs eager")
    assert (sdpa - base).abs().max() > 0.05


@pytest.mark.numeric
def test_block_of_every_key_but_one_is_one_hot_on_it(organism, batch):
    real = batch.inputs["attention_mask"].bool()
    keys = real.clone()
    keys[:, 5] = False  # every key but position 5, for the last query, at every head
    with intervene(organism, Block(3, queries="last", keys=Mask(keys))):
        got = record(organism, batch, [Pattern(3, h) for h in range(4)])
    one_hot = torch.zeros(real.shape)
    one_hot[:, 5] = 1.0
    for h in range(4):
        assert torch.equal(got[Pattern(3, h)][:, -1], one_hot)


@pytest.mark.numeric
def test_block_holds_on_padded_rows_and_through_generation(organism, pairs):
    images = [p.clean.image for p in pairs[:2]]
    batch = organism.prepare(images, ["How many?", "How many shapes are there in this picture?"])
    assert not batch.inputs["attention_mask"].all()  # left padding: sdpa reads a boolean mask
    block = Block(2, queries="last", keys="image")
    with intervene(organism, block):
        sdpa = organism.forward(batch).logits[:, -1].float()
        with eager_attention(organism):
            eager = organism.forward(batch).logits[:, -1].float()
        generated = organism.hf.generate(**batch.inputs, max_new_tokens=3, do_sample=False)
        # By hand, without a KV cache: each step a whole forward, its last token blocked from the image.
        ids, attn = batch.inputs["input_ids"], batch.inputs["attention_mask"]
        rest = {k: v for k, v in batch.inputs.items() if k not in ("input_ids", "attention_mask")}
        for _ in range(3):
            with torch.no_grad():
                step = organism.hf(input_ids=ids, attention_mask=attn, use_cache=False, **rest).logits[:, -1]
            ids = torch.cat([ids, step.argmax(-1, keepdim=True)], 1)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            if "mm_token_type_ids" in rest:  # the new token is text
                rest["mm_token_type_ids"] = torch.nn.functional.pad(rest["mm_token_type_ids"], (0, 1))
    assert_close(sdpa, eager, what="Block on padded rows, sdpa vs eager")
    assert torch.equal(generated, ids)


def test_block_refuses_what_it_cannot_do(organism, batch):
    calls = []
    handle = organism.hf.get_submodule(organism.arch.layer(0)).register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        # Positions the scenes lack, and a query left no key: refused before any layer runs.
        for item, match in (
            (Block(1, queries="last", keys=Objects([9])), "has no object 9"),
            (Block(1, queries="last", keys=Cells([(9, 0)])), "outside sample 0's"),
            (Block(1, queries="last", keys="all"), "no key to attend to"),
        ):
            with pytest.raises(InputError, match=match), intervene(organism, item):
                organism.forward(batch)
    finally:
        handle.remove()
    assert not calls
    # Layers without softmax self-attention (a stand-in whose arch says so; the model is not touched).
    for kind, match in (("linear", "linear-attention layer"), ("cross", "cross-attention layer")):
        other = copy.copy(organism)
        kinds = tuple(kind if i == 1 else k for i, k in enumerate(organism.arch.kinds))
        other.arch = dataclasses.replace(organism.arch, kinds=kinds)
        with pytest.raises(InputError, match=match):
            with intervene(other, Block(1, queries="last", keys="image")):
                pass
