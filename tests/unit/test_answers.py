"""Multi-token answers on the real Qwen vocabulary ("12" → "1", "2"), checked against plain HF forwards.

Every reference here builds its inputs by hand — the chat template, the processor, the answer's
tokens concatenated with torch.cat, one sample per forward — and reads log-probabilities straight
from the model's logits, so it shares nothing with `VLM.prepare(forced=...)` or the scoring code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import QWEN_VOCAB, TINY_IMAGE_SIZE
from tolerance import assert_close, assert_effect, bound, logit_scale, scale_of

from countlens import circuits
from countlens.analysis.evaluate import generate, score
from countlens.analysis.metrics import summary
from countlens.analysis.parse import parse_shape_count
from countlens.circuits.lenses.headlens import is_number
from countlens.circuits.methods.patching import prepare_pairs
from countlens.datasets.pairs import count_pairs
from countlens.datasets.prompts import PROMPTS, answer_text, make_question
from countlens.datasets.tasks import TaskSample
from countlens.errors import InputError
from countlens.model.answers import divergence, read_rows, shared_prefix, splits_numbers

SIDE = TINY_IMAGE_SIZE["qwen2_5_vl"][0]


@pytest.fixture(scope="module")
def qwen(loaded):
    return loaded("qwen2_5_vl")


def counting(counts, prompt="short", seed=3) -> list[TaskSample]:
    """One sample per count: the clean side of a pair with that many objects."""
    out = []
    for i, n in enumerate(counts):
        p = count_pairs(1, n, 13, kind="shapes", image_size=SIDE, prompt=prompt, seed=seed + i)[0]
        out.append(p.clean)
    return out


def hand_built_logits(vlm, sample, continuation: list[int]) -> tuple[torch.Tensor, int]:
    """(logits of one hand-built forward of the prompt then ``continuation``, the prompt's length)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sample.question}]}]
    text = vlm.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = vlm.processor(text=[text], images=[[sample.image]], return_tensors="pt")
    extra = torch.tensor([continuation], dtype=torch.long)
    inputs = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}
    n = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(extra)], 1)
    for k in ("mm_token_type_ids", "token_type_ids"):  # Qwen / Gemma 3 mark image tokens; text is 0
        if k in inputs:
            inputs[k] = torch.cat([inputs[k], torch.zeros_like(extra)], 1)
    with torch.no_grad():
        return vlm.hf(**inputs).logits[0].float(), n


def plain_logprobs(vlm, sample, continuation: list[int]) -> torch.Tensor:
    """log p(continuation[t] | prompt, continuation[:t]) for every t, from one hand-built forward."""
    logits, n = hand_built_logits(vlm, sample, continuation)
    logp = logits.log_softmax(-1)
    return torch.stack([logp[n - 1 + t, tok] for t, tok in enumerate(continuation)])


def plain_logits_after(vlm, sample, prefix: list[int]) -> torch.Tensor:
    """Next-token logits after the prompt and ``prefix``, from one hand-built forward."""
    return hand_built_logits(vlm, sample, prefix)[0][-1]


def test_the_real_qwen_vocabulary_splits_digits_and_keeps_its_special_ids(qwen, loaded):
    tok = qwen.tokenizer
    assert tok.tokenize("10") == ["1", "0"] and tok.tokenize("There are 12 circles.")[2:5] == ["Ġ", "1", "2"]
    ids = tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    )
    assert ids == [151643, 151644, 151645, 151652, 151653, 151655]
    assert qwen.hf.config.text_config.vocab_size == QWEN_VOCAB == 151_936
    assert qwen.arch.image_token_id == 151655
    assert splits_numbers(tok) and qwen.answer_end == 151645  # <|im_end|>, from the chat template
    assert qwen.answer_ids("12") == [16, 17, 151645]
    assert not splits_numbers(loaded("toy").tokenizer)


def test_divergence_and_read_rows_on_digit_answers():
    one, ten, twelve, nine, end = [16, 151645], [16, 15, 151645], [16, 17, 151645], [24, 151645], 151645
    assert divergence(ten, twelve) == ([16], 15, 17)  # 10 vs 12: after "1", "0" vs "2"
    assert divergence(one, ten) == ([16], end, 15)  # 1 vs 10: after "1", the end vs "0"
    assert divergence(nine, twelve) == ([], 24, 16)  # 9 vs 12: "9" vs "1"
    assert shared_prefix(ten, twelve) == 1
    with pytest.raises(InputError, match="tokenise identically"):
        divergence(ten, list(ten), ("10", "10"))
    with pytest.raises(InputError, match="prefix of one another"):
        divergence([16], [16, 15], ("1", "10"))
    # Scoring counts 0..12: one row per longest proper prefix; single-token candidates need one row.
    cands = [[15 + n, end] for n in range(10)] + [[16, 15 + d, end] for d in range(3)]
    assert read_rows(cands) == sorted([(15 + n,) for n in range(10) if n != 1] + [(16, 15 + d) for d in range(3)])
    assert read_rows([[5], [6], [7]]) == [()]


@pytest.mark.numeric
def test_candidate_scoring_is_the_teacher_forced_sequence_log_probability(qwen):
    samples = counting([1, 9, 10, 12])
    ds = score(qwen, samples, batch_size=3)
    assert ds.attrs["method"] == "candidate scoring" and ds.attrs["answer_end"] == 151645
    for i in (0, 2, 3):
        s = samples[i]
        want = {n: float(plain_logprobs(qwen, s, qwen.answer_ids(str(n))).sum()) for n in range(13)}
        assert_close(ds.logp_gold[i], want[s.meta["count"]], what="cached vs full-forward log p")
        # An arg-max over two computations' log p: the top two stand ≥ 0.14 apart here (measured), ~600× the
        # bound above, so rounding cannot reorder them.
        assert int(ds.pred_count[i]) == max(want, key=want.get)
        assert ds.pred.values[i] == str(max(want, key=want.get))
    # exp in two libraries (each vectorised per CPU): a few float32 ulps (2⁻²³) apart, not bit-equal.
    np.testing.assert_allclose(ds.p_gold, np.exp(ds.logp_gold), rtol=2**-20)
    assert bool(ds.parsed.all()) and list(ds["count"].values) == [1, 9, 10, 12]
    with pytest.raises(InputError, match="method='candidates'"):
        score(qwen, samples, method="token")


@pytest.mark.numeric
@pytest.mark.slow  # six architectures × 39 hand-built forwards
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "llava", "llava_next", "llava_onevision", "gemma3"])
def test_candidate_scoring_on_every_architecture(name, loaded):
    """The KV-cached candidate rows equal one full forward per candidate, on each architecture's
    vocabulary (real Qwen, digit BPE, or word-level where "12" is one token)."""
    vlm = loaded(name)
    side = TINY_IMAGE_SIZE[name][0]
    samples = [
        count_pairs(1, n, 13, kind="shapes", image_size=side, prompt="short", seed=7 + i)[0].clean
        for i, n in enumerate([1, 10, 12])
    ]
    ds = score(vlm, samples, method="candidates", batch_size=2)
    for i, s in enumerate(samples):
        want = {n: float(plain_logprobs(vlm, s, vlm.answer_ids(str(n))).sum()) for n in range(13)}
        assert_close(ds.logp_gold[i], want[s.meta["count"]], what=f"{name}: cached vs full-forward log p")
        assert int(ds.pred_count[i]) == max(want, key=want.get)


@pytest.mark.numeric
def test_pstd_answers_are_scored_as_the_model_writes_them(qwen):
    samples = counting([3, 11], prompt="std")
    assert samples[1].answer == "circle: 11" or samples[1].answer.endswith(": 11")
    ds = score(qwen, samples)
    head = samples[1].answer.rsplit("11", 1)[0]
    assert {f"{head}{n}" for n in range(12)} <= set(ds.attrs["candidates"].split(","))
    assert f"{head}12" not in ds.attrs["candidates"].split(",")  # counts 0 … the largest asked
    want = float(plain_logprobs(qwen, samples[1], qwen.answer_ids(samples[1].answer)).sum())
    assert_close(ds.logp_gold[1], want, what="Pstd log p")


@pytest.mark.numeric
def test_single_token_scoring_is_unchanged_and_candidates_agree_with_it(loaded):
    toy = loaded("toy")
    from countlens.datasets.tasks import task_samples

    samples = task_samples("count", 12, 5, image_size=toy.geometry.image_height)
    token = score(toy, samples)
    assert token.attrs["method"] == "single-token scoring"  # auto: every answer is one token
    cands = score(toy, samples, method="candidates")
    # One row per sample, the bare prompt: the same log-softmax as token scoring.
    assert_close(np.log(cands.p_gold), np.log(token.p_gold), what="candidate vs token log p")
    # Right over the whole vocabulary implies right among the candidates, which hold the gold answer.
    assert (token.correct.values <= cands.correct.values).all()
    assert ((cands.pred_count.values == cands["count"].values) == cands.correct.values).all()


def test_candidate_errors_name_the_answer(loaded):
    toy = loaded("toy")
    from countlens.datasets.tasks import task_samples

    samples = task_samples("color", 3, 0, image_size=toy.geometry.image_height)
    with pytest.raises(InputError, match="not among candidates"):
        score(toy, samples, candidates=["zero", "one"])
    gold = samples[0].answer
    with pytest.raises(InputError, match="tokenise identically"):
        score(toy, samples[:1], candidates=[gold, gold.upper()])  # the organism's vocabulary lowercases
    words = [TaskSample(samples[0].scene, "how many?", "seven", "count", {"count": 7})]
    with pytest.raises(InputError, match="does not write its count 7 in digits"):
        score(toy, words, method="candidates")


@pytest.mark.numeric
@pytest.mark.parametrize("clean,corrupt", [(1, 12), (9, 12), (10, 12), (12, 10), (1, 10)])
def test_pairs_with_multi_token_answers(qwen, clean, corrupt):
    pairs = count_pairs(2, clean, corrupt, kind="shapes", image_size=SIDE, prompt="short", seed=11)
    vap = circuits.patch_layers(qwen, pairs, groups=("image", "last"), layers=[-1, 0, 1])
    scale = logit_scale(qwen, prepare_pairs(qwen, pairs))
    # The pair differs only in its image: patching every image-token embedding is the whole effect.
    assert_effect(
        vap.effect.sel(layer=-1, group="image"),
        1.0,
        clean=vap.clean_logit_diff,
        corrupt=vap.corrupt_logit_diff,
        scale=scale,
    )
    assert_close(
        vap.logit_diff.sel(layer=-1, group="image"),
        vap.corrupt_logit_diff,
        scale=scale,
        what="patched-image LD vs corrupt LD",
    )
    # The metric, by hand: logits after the shared prefix, clean token minus corrupt token.
    a, b = qwen.answer_ids(str(clean)), qwen.answer_ids(str(corrupt))
    prefix, ta, tb = divergence(a, b)
    for k, p in enumerate(pairs):
        for side, want in ((p.clean, vap.clean_logit_diff), (p.corrupt, vap.corrupt_logit_diff)):
            logits = plain_logits_after(qwen, side, prefix)
            assert_close(want[k], logits[ta] - logits[tb], scale=scale_of(logits), what="LD vs hand-built LD")
    heads = circuits.patch_heads(qwen, pairs)
    atp = circuits.attribution_patch(qwen, pairs)
    assert np.isfinite(heads.effect.values).all() and np.isfinite(atp.effect.values).all()
    # The experiment entry point reads the same multi-token metric: patch_layers builds these very sets, in
    # this order, and both run them through one effect_grid at one batch size: one computation, bit for bit.
    sets = {
        f"{la}/{g}": [circuits.Patch(circuits.Residual(la), positions=g)]
        for la in (-1, 0, 1)
        for g in ("image", "last")
    }
    grid = circuits.effect(qwen, pairs, sets)
    np.testing.assert_array_equal(grid.effect.values, vap.effect.values.ravel())


@pytest.mark.numeric
def test_ablation_and_logit_lens_teacher_force_the_gold_answer(qwen):
    samples = counting([2, 10, 11, 12])
    want = np.array([float(plain_logprobs(qwen, s, qwen.answer_ids(s.answer)).sum()) for s in samples])
    none = circuits.ablate(qwen, samples, heads=[], batch_size=3)
    assert_close(none.base_logp, want, what="ablate's base log p")
    assert_close(none.logp, want, what="log p with nothing ablated")
    hit = circuits.ablate(qwen, samples, heads=[(0, 0), (1, 2)], batch_size=3)
    assert np.abs(hit.logp - want).max() > 10 * bound(scale_of(want))  # two heads' ablation: far beyond rounding
    scan = circuits.ablation_scan(qwen, {"count": samples}, batch_size=4)
    assert scan.logp_drop.shape == (1, qwen.arch.n_layers, qwen.arch.n_heads)
    assert np.isfinite(scan.logp_drop.values).all()
    # After the last layer the lens is the model: the product of the answer tokens' probabilities.
    lens = circuits.logit_lens(qwen, samples, batch_size=3)
    assert_close(np.log(lens.prob.isel(layer=-1)), want, what="last-layer lens log p")
    assert (lens["rank"].values >= 0).all()


def test_headlens_decodes_heads_on_the_real_vocabulary(qwen):
    samples = counting(range(1, 13))
    hl = circuits.HeadLens.fit(qwen, samples)
    dec = hl.decode(qwen, samples[:4], top_k=5)
    assert dec.token.shape == (qwen.arch.n_layers, qwen.arch.n_heads, 4, 5)
    assert ((dec.cter >= 0) & (dec.cter <= 1)).all() and int(dec.token_id.max()) < QWEN_VOCAB
    assert is_number("1") and is_number("Ġ7")


def test_generation_reports_unparsed_answers_and_refuses_a_short_budget(qwen):
    samples = counting([3, 12])
    with pytest.raises(InputError, match=r"'12' takes 3 tokens.*max_new_tokens=2"):
        generate(qwen, samples, max_new_tokens=2)
    ds = generate(qwen, samples, max_new_tokens=3)
    assert ds.attrs["method"] == "greedy generation"
    assert not ds.correct.values[~ds.parsed.values].any()  # never scored right when nothing parsed
    unparsed = float(summary(ds)["unparsed"].iloc[0])
    assert unparsed == pytest.approx(float((~ds.parsed.values).mean()))


def test_the_papers_pstd_prompt_verbatim_and_its_parser():
    rng = np.random.default_rng(0)
    q, _ = make_question("std", "circle", 7, rng)
    assert q == (
        "How many circles are there in the image? Respond concisely with shape counts using the following "
        "format: circle: {number}"
    )
    assert answer_text("std", "circles", 7) == "circle: 7" and answer_text("number", "circle", 7) == "7"
    assert PROMPTS["number"].template.endswith("Respond concisely with the number only.")
    q, meta = make_question("conflict", "square", 5, rng)
    assert q.startswith("How many squares") and "Hint" in q and meta["distractor"] in (3, 4, 6, 7)
    assert parse_shape_count("circle: 12", "circle") == 12
    assert parse_shape_count("Circles: seven", "circles") == 7
    assert parse_shape_count("There are 3 squares. square: 4", "square") == 4  # the format wins
    assert parse_shape_count("I see 5.", "circle") == 5  # no format: the first count
    assert parse_shape_count("triangle: many", "triangle") is None


def test_teacher_forced_tokens_are_appended_and_belong_to_the_answer_span(qwen):
    from countlens.circuits.sites import group_mask

    samples = counting([3, 12])
    forced = [[], [16, 17]]  # nothing after the first prompt; "1", "2" after the second
    batch = qwen.prepare([s.image for s in samples], [s.question for s in samples], forced=forced)
    plain = qwen.prepare([s.image for s in samples], [s.question for s in samples])
    ids, real = batch.inputs["input_ids"], batch.inputs["attention_mask"].bool()
    assert ids[1, -2:].tolist() == [16, 17] and torch.equal(ids[1][real[1]][:-2], plain.inputs["input_ids"][1])
    assert batch.last.tolist() == [ids.shape[1] - 1] * 2 and batch.prompt_last.tolist() == [
        ids.shape[1] - 1,
        ids.shape[1] - 3,
    ]
    last, image, text = (group_mask(batch, g) for g in ("last", "image", "text"))
    assert last.sum(1).tolist() == [1, 3] and last[1, -3:].all()
    assert not (last & text).any() and not (last & image).any() and torch.equal(last | image | text, real)
