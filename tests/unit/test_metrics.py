"""A metric is an argument: effect and the patching grids under log-probability, probability mass and KL,
each against its definition computed with plain torch hooks; named grids keep their dims; broken metrics
and noisy normalisers are refused before any forward of the edited runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from tolerance import assert_close

from countlens.circuits import HeadZ, Metric, Patch, effect, metrics, patch_heads, prepare_pairs
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


def _runs(vlm, pb, head=None):
    """Read-position logits of the clean run (``head``: (layer, head) patched from the corrupt run at every
    position, by plain torch hooks on o_proj's input) and of the corrupt run."""
    arch = vlm.arch

    def forward(batch, hook=None):
        handle = None if hook is None else vlm.hf.get_submodule(arch.o_proj(head[0])).register_forward_pre_hook(hook)
        try:
            with torch.no_grad():
                return vlm.hf(**batch.inputs, use_cache=False).logits[:, -1].float()
        finally:
            if handle is not None:
                handle.remove()

    if head is None:
        return forward(pb.clean), forward(pb.corrupt)
    dh = arch.head_dim(head[0])
    cols = slice(head[1] * dh, (head[1] + 1) * dh)
    kept = {}
    forward(pb.corrupt, lambda m, args: kept.update(z=args[0][..., cols].clone()))

    def write(m, args):
        z = args[0].clone()
        z[..., cols] = kept["z"]
        return (z, *args[1:])

    return forward(pb.clean, write)


def _mass(vlm, pb, logits, answers):
    """The probability of the tokens that begin an answer of ``answers`` after each pair's shared prefix."""
    rows = []
    for k, prefix in enumerate(pb.forced):
        ids = {tuple(vlm.answer_ids(a)) for a in answers}
        nxt = sorted({seq[len(prefix)] for seq in ids if list(seq[: len(prefix)]) == prefix and len(seq) > len(prefix)})
        rows.append(torch.softmax(logits[k], -1)[nxt].sum())
    return torch.stack(rows)


def _effect(edited, clean, corrupt):
    return float((edited.sum() - clean.sum()) / (corrupt.sum() - clean.sum()))


@pytest.mark.numeric
def test_a_head_grid_under_a_probability_metric_equals_plain_torch(organism, pairs, high):
    cells = {(layer, head): [Patch(HeadZ(layer, head))] for layer in (0, 1) for head in (0, 1)}
    grid = effect(organism, pairs, {("layer", "head"): cells}, metric=high)
    assert grid.effect.dims == ("layer", "head") and grid.prob_mass.dims == ("layer", "head", "pair")
    assert '"name": "prob_mass"' in grid.attrs["metric"] and "answers" in grid.attrs["metric"]
    pb = prepare_pairs(organism, pairs)
    clean, corrupt = (_mass(organism, pb, x, high.answers) for x in _runs(organism, pb))
    assert_close(grid.clean_prob_mass, clean, what="the clean run's mass per pair")
    assert_close(grid.corrupt_prob_mass, corrupt, what="the corrupt run's mass per pair")
    for (layer, head), _ in cells.items():
        edited = _mass(organism, pb, _runs(organism, pb, (layer, head)), high.answers)
        assert_close(grid.prob_mass.sel(layer=layer, head=head), edited, what="the mass per pair, patched")
        want = _effect(edited, clean, corrupt)
        assert_close(grid.effect.sel(layer=layer, head=head), want, scale=1 / abs(float(corrupt.sum() - clean.sum())))
    # The head sweep computes the same grid.
    swept = patch_heads(organism, pairs, layers=[0, 1], metric=high).effect.sel(head=[0, 1])
    assert_close(swept, grid.effect.transpose("layer", "head"), what="patch_heads vs effect's grid")


@pytest.mark.numeric
def test_log_prob_and_kl_effects_equal_their_definitions(organism, pairs):
    pb = prepare_pairs(organism, pairs)
    clean, corrupt = _runs(organism, pb)
    edited = _runs(organism, pb, (1, 0))
    rows = torch.arange(len(pairs))

    def log_prob(x):
        return torch.log_softmax(x, -1)[rows, pb.clean_id]

    def kl(x):
        p, q = torch.log_softmax(clean, -1), torch.log_softmax(x, -1)
        return (p.exp() * (p - q)).sum(-1)

    for name, fn in (("log_prob", log_prob), ("kl", kl)):
        ds = effect(organism, pairs, Patch(HeadZ(1, 0)), metric=name)
        assert_close(ds[name], fn(edited), what=f"{name} per pair")
        assert_close(ds[f"corrupt_{name}"], fn(corrupt), what=f"corrupt {name}")
        assert_close(ds.effect, _effect(fn(edited), fn(clean), fn(corrupt)), scale=10, what=f"{name} effect")
    assert float(np.abs(effect(organism, pairs, Patch(HeadZ(1, 0)), metric="kl").clean_kl).max()) == 0.0


def test_the_default_metric_is_the_logit_difference_and_a_callable_is_named(organism, pairs):
    default = effect(organism, pairs, Patch(HeadZ(0, 1)))
    named = effect(organism, pairs, Patch(HeadZ(0, 1)), metric="logit_diff")
    assert float(default.effect) == float(named.effect)  # one computation, twice
    assert default.attrs["metric"] == '{"name": "logit_diff"}'

    def logit_gap(logits, pb):
        return logits[torch.arange(len(logits)), pb.clean_id] - logits[torch.arange(len(logits)), pb.corrupt_id]

    mine = effect(organism, pairs, Patch(HeadZ(0, 1)), metric=logit_gap)
    assert "logit_gap" in mine and mine.attrs["metric"] == '{"name": "logit_gap"}'
    assert_close(mine.effect, default.effect, scale=10, what="a hand-written logit difference")


def test_named_grids_keep_their_dims_and_a_cell_left_out_is_nan(organism, pairs):
    cells = {(0, "a"): [Patch(HeadZ(0, 0))], (1, "b"): [Patch(HeadZ(1, 0))]}
    ds = effect(organism, pairs, {("layer", "tag"): cells})
    assert dict(ds.effect.sizes) == {"layer": 2, "tag": 2}
    assert np.isnan(float(ds.effect.sel(layer=0, tag="b"))) and np.isfinite(float(ds.effect.sel(layer=1, tag="b")))
    one = effect(organism, pairs, {"head": {h: [Patch(HeadZ(0, h))] for h in (0, 1)}})
    assert one.effect.dims == ("head",) and list(one["head"].values) == [0, 1]
    sets = np.empty((2,), dtype=object)
    sets[:] = [[Patch(HeadZ(0, 0))], [Patch(HeadZ(0, 1))]]
    arr = effect(organism, pairs, xr.DataArray(sets, dims=["head"], coords={"head": [0, 1]}))
    assert np.array_equal(arr.effect.values, one.effect.values)  # the same two sets in the same stacked forward


@pytest.mark.parametrize(
    "metric, match",
    [
        (lambda logits, pb: logits[:, 0:2], r"returned \(1, 2\)"),
        (lambda logits, pb: logits[:, 0] * float("nan"), "gave nan for pair 0"),
        ("logitdiff", "no metric 'logitdiff'"),
        (Metric.__new__(Metric), None),
        (metrics.prob_mass(["3 3"]), "begins both an answer of the set and .3."),
        (3, "is not a metric"),
        (lambda logits: logits[:, 0], "could not be called as fn\\(logits, pair_batch\\)"),
        (lambda logits, pb: logits.argmax(-1), r"returned \(1,\) of torch.int64"),
    ],
)
def test_broken_metrics_are_refused_before_any_forward(organism, pairs, metric, match):
    if match is None:
        for name in ("effect", "correct", "pair"):  # correct: its clean_correct is the result's own
            with pytest.raises(InputError, match="must be a Python identifier"):
                Metric(name, lambda logits, pb: logits[:, 0])
        with pytest.raises(InputError, match="non-empty list of answer strings"):
            metrics.prob_mass(3)
        return

    def no_forward(module, args, kwargs):
        raise AssertionError("a forward ran before the metric was refused")

    hook = organism.hf.register_forward_pre_hook(no_forward, with_kwargs=True)
    try:
        with pytest.raises(InputError, match=match):
            effect(organism, pairs, Patch(HeadZ(0, 0)), metric=metric)
    finally:
        hook.remove()


@pytest.mark.noise_rule
def test_a_normaliser_within_the_pairs_noise_is_refused_with_its_figure(organism, pairs):
    from countlens.circuits import tolerate_noise

    # A metric whose corrupt-minus-clean differences are ±1 around a mean of 0.025: noise, not a denominator.
    def jitter(logits, pb):
        if torch.equal(logits, pb.clean_logits.to(logits.device)):
            return torch.zeros(len(logits))
        return torch.tensor([1.0, -1.0, 1.0, -0.9])[: len(logits)]

    noisy = Metric("jitter", jitter, reads_clean=True)
    with pytest.raises(InputError, match=r"is 0.1, within 2 standard errors \(2.\d+ each\) of zero over 4 pairs"):
        effect(organism, pairs, Patch(HeadZ(0, 0)), metric=noisy)
    with tolerate_noise():
        ds = effect(organism, pairs, Patch(HeadZ(0, 0)), metric=noisy)
    assert ds.attrs["normaliser_noisy"] == 1 and ds.attrs["normaliser_se"] > 2 * abs(ds.attrs["normaliser"])
    assert effect(organism, pairs, Patch(HeadZ(0, 0))).attrs["normaliser_noisy"] == 0  # the organism's pairs: signal


@pytest.mark.parametrize(
    "grid, match",
    [
        ({"effect": {"a": [Patch(HeadZ(0, 0))]}}, r"dims \['effect'\] are names of the result's own"),
        ({"logit_diff": {0: [Patch(HeadZ(0, 0))]}}, r"dims \['logit_diff'\]"),
        ({5: {0: [Patch(HeadZ(0, 0))]}}, "must be distinct names"),
        (xr.DataArray(np.empty((0,), dtype=object), dims=["head"]), "at least one"),
    ],
)
def test_a_grid_whose_dims_would_hide_a_variable_is_refused(organism, pairs, grid, match):
    with pytest.raises(InputError, match=match):
        effect(organism, pairs, grid)


def test_prob_mass_reads_digit_split_answers_after_the_pairs_prefix_on_the_real_qwen_vocabulary(loaded):
    """Qwen writes 10 and 12 as "1" "0" / "1" "2" (then <|im_end|>): after the forced "1", the set {10, 11, 12}
    is the tokens "0", "1", "2"; with no prefix (3 vs 12), "1" would begin 12 and 1, so {12} is refused."""
    from countlens.circuits.engine.metrics import metric_for

    qwen = loaded("qwen2_5_vl")
    pairs = count_pairs(2, 10, 12, kind="dots", grid=qwen.geometry, prompt="short", seed=0)
    pb = prepare_pairs(qwen, pairs)
    one = qwen.tokenizer.convert_tokens_to_ids("1")
    assert pb.forced == [[one], [one]]
    digits = sorted(qwen.tokenizer.convert_tokens_to_ids(list("012")))
    bound = metric_for(qwen, pairs, metrics.prob_mass(["10", "11", "12"]), "test")
    assert bound.fn.chosen(pb.forced, []) == [digits, digits]
    logits = torch.randn(2, qwen.hf.get_output_embeddings().weight.shape[0])
    assert_close(bound(logits, pb), torch.softmax(logits, -1)[:, digits].sum(-1), what="the mass of 0, 1, 2")
    apart = count_pairs(2, 3, 12, kind="dots", grid=qwen.geometry, prompt="short", seed=0)
    with pytest.raises(InputError, match="begins both an answer of the set and '1'"):
        metric_for(qwen, apart, metrics.prob_mass(["12"]), "test")
