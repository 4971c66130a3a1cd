"""Training: losses are right and flow where they should; fine-tuning resumes to the same adapter."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from tolerance import assert_close

import countlens
from countlens.circuits.sites import group_mask
from countlens.datasets.tasks import TaskSample, task_samples
from countlens.errors import ConfigError, InputError, RunDirError
from countlens.training.capture import attention_at
from countlens.training.collate import IGNORE, answer_targets, training_batch
from countlens.training.finetune import FinetuneConfig, _batch_indices, finetune, with_adapter
from countlens.training.losses import answer_ce, focus_loss, gaussian_prior, mas_loss, object_prior


@pytest.fixture(scope="module")
def organism():
    return countlens.load("toy")


def test_training_batch_labels_only_the_answer(organism):
    base = task_samples("count", 3, 1)
    # Answers of different lengths: one and two tokens.
    samples = [base[0], TaskSample(base[1].scene, base[1].question, "two circles", "count"), base[2]]
    tb = training_batch(organism, samples)
    ids, labels = tb.inputs["input_ids"], tb.labels
    for b, s in enumerate(samples):
        want = organism.tokenizer(s.answer, add_special_tokens=False)["input_ids"]
        got = labels[b][labels[b] != IGNORE].tolist()
        assert got == want
        pos = (labels[b] != IGNORE).nonzero().flatten()
        assert ids[b, pos].tolist() == want  # the labelled tokens are the answer's own input tokens
        assert tb.targets[b].nonzero().flatten().tolist() == (pos - 1).tolist()
        assert int(tb.prompt.last[b]) == int(pos[0]) - 1
    assert tb.inputs["attention_mask"].shape == ids.shape


def test_answer_targets_for_right_padded_labels():
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6, IGNORE], [IGNORE, 7, IGNORE, IGNORE, IGNORE]])
    assert answer_targets(labels).tolist() == [[False, True, True, False, False], [True, False, False, False, False]]


@pytest.mark.numeric
def test_answer_ce_counts_answer_tokens_only():
    logits = torch.zeros(1, 4, 3)
    logits[0, 1, 2] = 5.0  # position 1 predicts token 2 (the answer at position 2)
    labels = torch.tensor([[IGNORE, IGNORE, 2, IGNORE]])
    expected = -torch.log_softmax(torch.tensor([0.0, 0.0, 5.0]), 0)[2]
    # Cross-entropy over a batch against one log-softmax: two float32 reductions of logits of size 5, so
    # the loss (≈ 0.013) rounds like numbers of size 5, not like itself.
    assert_close(answer_ce(logits, labels), expected, scale=5.0, what="answer CE")
    logits[0, 0] = 100.0  # anything at non-answer positions is ignored
    assert_close(answer_ce(logits, labels), expected, scale=5.0, what="answer CE, other positions ignored")


def test_mas_hinge_is_exactly_zero_above_tau():
    attn = torch.zeros(1, 2, 4, 4)
    attn[..., :2] = 0.25  # each position: 0.5 on tokens 0–1 (image), 0.5 elsewhere
    attn[..., 2:] = 0.25
    image = torch.tensor([[True, True, False, False]])
    targets = torch.tensor([[False, False, False, True]])
    assert mas_loss([attn], targets, image, tau=0.4).item() == 0.0  # the hinge's max(0, ·): exactly 0
    # τ − 0.5 against 0.2: only float32's rounding of τ = 0.7 (≈ 1e-8) separates them.
    assert math.isclose(mas_loss([attn], targets, image, tau=0.7).item(), 0.2, abs_tol=1e-6)
    assert math.isclose(mas_loss([attn], targets, image, tau=0.7, reduce="sample").item(), 0.2, abs_tol=1e-6)


def _code_mas_loss(attn, targets, image, tau, wrong):
    """The paper's code's formula written out with loops (MAS_w_Ovis/ovis/model/mas_loss.py): per
    sample and layer, each head's vision share at each target row, averaged over heads and rows; the
    layers' mean; the hinge; wrong samples only; the batch mean."""
    losses = []
    for b in range(targets.shape[0]):
        rows = targets[b].nonzero().flatten().tolist()
        layer_means = []
        for a in attn:
            shares = [
                float(a[b, h, r][image[b]].sum()) / (float(a[b, h, r].sum()) + 1e-8)
                for h in range(a.shape[1])
                for r in rows
            ]
            layer_means.append(sum(shares) / len(shares))
        mas = sum(layer_means) / len(layer_means)
        losses.append(max(0.0, tau - mas) * (1.0 if wrong is None or wrong[b] else 0.0))
    return sum(losses) / len(losses)


@pytest.mark.numeric
def test_the_papers_mas_loss_matches_its_code_and_differs_from_countlens_own():
    gen = torch.Generator().manual_seed(3)
    attn = [torch.rand(3, 4, 7, 7, generator=gen).softmax(-1) for _ in range(2)]  # 3 samples, 4 heads, 2 layers
    image = torch.zeros(3, 7, dtype=torch.bool)
    image[:, 1:4] = True
    targets = torch.zeros(3, 7, dtype=torch.bool)
    targets[0, 5:7], targets[1, 6], targets[2, 4:7] = True, True, True  # answers of 2, 1 and 3 tokens
    wrong = torch.tensor([True, False, True])
    for tau in (0.3, 0.45, 0.9):
        for w in (None, wrong):
            got = mas_loss(attn, targets, image, tau, reduce="paper", wrong=w).item()
            # float32 sums of shares (each ≤ 1) against Python's float64 loops: rounding of size-1 numbers.
            assert_close(got, _code_mas_loss(attn, targets, image, tau, w), scale=1.0, what=f"MAS loss, τ = {tau}")
    # Shares straddling τ: the paper's code averages before its hinge (0), countlens's hinges each row (> 0).
    straddle = torch.zeros(1, 1, 3, 3)
    straddle[0, 0, 1] = torch.tensor([0.2, 0.0, 0.8])  # row 1: share 0.2 on the image token
    straddle[0, 0, 2] = torch.tensor([0.8, 0.0, 0.2])  # row 2: share 0.8
    one_image, rows = torch.tensor([[True, False, False]]), torch.tensor([[False, True, True]])
    assert mas_loss([straddle], rows, one_image, 0.4, reduce="paper").item() == 0.0
    assert math.isclose(mas_loss([straddle], rows, one_image, 0.4, reduce="token").item(), 0.1, abs_tol=1e-6)
    with pytest.raises(InputError, match="wrong= masks samples under reduce='paper'"):
        mas_loss(attn, targets, image, 0.4, reduce="token", wrong=wrong)


def test_wrong_answers_read_the_shifted_argmax_and_compare_last_numbers(organism):
    """A right teacher-forced count is right only when read at the positions that predict it (the code's
    unshifted reading would read it one token late)."""
    from countlens.training.losses import wrong_answers

    tok = organism.tokenizer
    vocab = len(tok)
    twelve, seven = tok.convert_tokens_to_ids("12"), tok.convert_tokens_to_ids("7")
    labels = torch.full((2, 4), IGNORE)
    labels[:, 2] = twelve  # both answers: "12" at position 2
    logits = torch.zeros(2, 4, vocab)
    logits[0, 1, twelve] = 9.0  # sample 0: position 1 predicts "12" (right)
    logits[1, 1, seven] = 9.0  # sample 1: predicts "7" (wrong) ...
    logits[1, 2, twelve] = 9.0  # ... though "12" is the arg-max at the answer's own position
    assert wrong_answers(logits, labels, tok).tolist() == [False, True]


def test_focus_loss_is_smallest_at_the_prior():
    prior = gaussian_prior([(1.5, 2.5)], (4, 4), sigma=1.0).flatten()
    pos = torch.arange(16)
    targets = torch.zeros(1, 17, dtype=torch.bool)
    targets[0, 16] = True

    def loss_for(dist):
        attn = torch.zeros(1, 1, 17, 17)
        attn[0, 0, 16, :16] = dist * 0.5  # half the attention on the image, half on the text
        attn[0, 0, 16, 16] = 0.5
        return focus_loss([attn], targets, [pos], [prior]).item()

    at_prior = loss_for(prior)
    entropy = -(prior * prior.log()).sum().item()
    assert math.isclose(at_prior, entropy, rel_tol=1e-4)  # float32 sums of 16 terms −p log p ≤ 1/e: ~1e-7 ≪ 1e-4
    for seed in range(3):
        other = torch.rand(16, generator=torch.Generator().manual_seed(seed))
        assert loss_for(other / other.sum()) > at_prior


def test_attention_losses_flow_into_target_qk_only(organism):
    samples = task_samples("count", 2, 3)
    tb = training_batch(organism, samples)
    arch, model = organism.arch, organism.hf
    target = 2
    for name in ("focus", "mas"):
        model.zero_grad(set_to_none=True)
        with attention_at(organism, [target]) as attn:
            model(**tb.inputs)
        if name == "focus":
            loss = focus_loss([attn[target]], tb.targets, tb.prompt.image_pos, object_prior(tb.prompt, samples))
        else:
            image = torch.zeros_like(tb.targets)
            image[:, : tb.prompt.inputs["input_ids"].shape[1]] = group_mask(tb.prompt, "image")
            loss = mas_loss([attn[target]], tb.targets, image, tau=0.99)
        loss.backward()
        grad = lambda path: model.get_submodule(path).weight.grad  # noqa: E731
        attn_path = arch.attention(target)
        assert grad(f"{attn_path}.q_proj").abs().sum() > 0 and grad(f"{attn_path}.k_proj").abs().sum() > 0, name
        # The probabilities do not depend on this layer's values or output projection, nor on later layers.
        for path in (f"{attn_path}.v_proj", f"{attn_path}.o_proj", arch.attention(target + 1) + ".q_proj"):
            g = grad(path)
            assert g is None or g.abs().sum() == 0, (name, path)
        assert grad(arch.attention(target - 1) + ".v_proj").abs().sum() > 0  # earlier layers feed q and k
    model.zero_grad(set_to_none=True)


def test_learning_rate_schedules():
    """A linear warm-up, then linear or cosine decay (the MAS paper's script) to 0."""
    from countlens.training.finetune import _lr_lambda

    linear = _lr_lambda(FinetuneConfig(steps=10, warmup=0.1))  # one warm-up step, then 9 of decay
    cosine = _lr_lambda(FinetuneConfig(steps=10, warmup=0.1, schedule="cosine"))
    assert [linear(0), linear(1), linear(5.5), linear(10)] == [1.0, 1.0, 0.5, 0.0]
    assert [cosine(0), cosine(1), cosine(10)] == [1.0, 1.0, 0.0]
    assert math.isclose(cosine(5.5), 0.5) and math.isclose(cosine(3.25), 0.5 * (1 + math.cos(math.pi / 4)))
    assert _lr_lambda(FinetuneConfig(steps=10, warmup=0.2))(0) == 0.5  # two warm-up steps
    with pytest.raises(ConfigError, match="schedule"):
        FinetuneConfig(schedule="step")


def test_full_finetune_trains_the_language_model_resumes_and_restores_the_callers_model(organism, tmp_path):
    """method='full' (the MAS paper's script): every language-model weight trains, the vision tower and
    projector do not; a run killed after its first checkpoint resumes to the uninterrupted weights; the
    caller's model is given back unchanged; `with_adapter` loads the weights over a fresh model."""
    from countlens.training.finetune import FULL_WEIGHTS, full_trainable

    samples = task_samples("count", 8, 1000)
    config = FinetuneConfig(
        steps=2,
        batch_size=2,
        save_every=1,
        target_layers=(1,),
        focus=0.0,
        mas=0.1,
        lr=1e-3,
        method="full",
        mas_reduce="paper",
    )
    before = {n: p.detach().clone() for n, p in organism.hf.named_parameters()}
    done = finetune(organism, samples, tmp_path / "whole", config)
    assert all(torch.equal(p, before[n]) for n, p in organism.hf.named_parameters())  # given back unchanged
    weights = load_file(done / FULL_WEIGHTS)
    trained = full_trainable(organism)
    spec = organism.arch.spec
    assert set(weights) == trained and not any(n.startswith((spec.vision_tower, spec.projector)) for n in weights)
    assert any(not torch.equal(weights[n], before[n]) for n in weights)  # it learnt something

    def die_after_the_first_step(row):
        if row["step"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(organism, samples, tmp_path / "killed", config, progress=die_after_the_first_step)
    resumed = load_file(finetune(organism, samples, tmp_path / "killed", config) / FULL_WEIGHTS)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    tuned = with_adapter("toy", done)
    got = dict(tuned.hf.named_parameters())
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert all(torch.equal(got[n], before[n]) for n in before if n not in trained)


def test_batches_are_a_pure_function_of_step():
    a = [_batch_indices(10, s, 4, 0).tolist() for s in range(6)]
    assert a == [_batch_indices(10, s, 4, 0).tolist() for s in range(6)]
    assert sorted(sum(a[:5], [])[:10]) == list(range(10))  # the first epoch covers every sample once


def test_finetune_resumes_after_a_kill_to_the_same_adapter(organism, tmp_path):
    samples = task_samples("count", 12, 1000)
    config = FinetuneConfig(steps=4, batch_size=4, save_every=2, target_layers=(1,), focus=1.0, mas=0.1, lr=1e-3)
    full = finetune(organism, samples, tmp_path / "full", config)

    def die_at_step_3(row):
        if row["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(organism, samples, tmp_path / "killed", config, progress=die_at_step_3)
    assert (tmp_path / "killed" / "checkpoint").exists() and not (tmp_path / "killed" / "adapter").exists()
    resumed = finetune(organism, samples, tmp_path / "killed", config)
    a, b = load_file(full / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same process, same steps: bit for bit
    # A finished directory with the same settings is returned as it is; another ce_on is refused.
    import json
    import re

    assert finetune(organism, samples, tmp_path / "full", config) == full
    with pytest.raises(RunDirError, match="other settings"):
        finetune(organism, samples, tmp_path / "full", replace(config, ce_on="digits"))
    # As many samples but other ones: not the fine-tune that directory holds.
    with pytest.raises(RunDirError, match="other settings"):
        finetune(organism, task_samples("count", 12, 2000), tmp_path / "full", config)
    # A finetune.json that lacks fields of today's spec (an older countlens's) is refused, naming them.
    spec_file = tmp_path / "full" / "finetune.json"
    spec = json.loads(spec_file.read_text())
    for lacking in (["ce_on", "digest"], ["digest"]):
        spec_file.write_text(json.dumps({k: v for k, v in spec.items() if k not in lacking}))
        with pytest.raises(RunDirError, match=re.escape(f"finetune.json lacks {lacking}") + ".*new directory"):
            finetune(organism, samples, tmp_path / "full", config)
        assert json.loads(spec_file.read_text()).keys() == spec.keys() - set(lacking)  # left as it was
    # The caller's model is untouched, and the adapter loads merged into a fresh model.
    assert not any("lora" in n for n, _ in organism.hf.named_parameters())
    tuned = with_adapter("toy", full)
    batch = organism.prepare([s.image for s in samples[:2]], [s.question for s in samples[:2]])
    assert not torch.allclose(tuned.forward(batch).logits, organism.forward(batch).logits)


def test_finetune_input_errors(organism, tmp_path):
    with pytest.raises(ConfigError, match="target_layers"):
        finetune(organism, task_samples("count", 2, 1000), tmp_path / "x", FinetuneConfig(steps=1))
    with pytest.raises(ConfigError, match="ce_on"):
        finetune(
            organism, task_samples("count", 2, 1000), tmp_path / "x", FinetuneConfig(steps=1, focus=0, ce_on="all")
        )
    words = [TaskSample(s.scene, s.question, "two circles", "count") for s in task_samples("count", 2, 1000)]
    with pytest.raises(InputError, match="'two circles' has no digit token"):  # before any step
        finetune(organism, words, tmp_path / "y", FinetuneConfig(steps=1, focus=0, ce_on="digits"))
    assert not (tmp_path / "y").exists()
    with pytest.raises(RunDirError, match="no circuit"):
        from countlens.training.finetune import target_layers_from

        target_layers_from(tmp_path)


def test_digit_labels_keep_only_the_counts_digits_on_the_real_qwen_vocabulary():
    from types import SimpleNamespace

    from real_vocab import QWEN2_VL_SPECIALS, qwen_tokenizer

    from countlens.training.collate import digit_labels

    tok = qwen_tokenizer(QWEN2_VL_SPECIALS)
    vlm = SimpleNamespace(token_strings=lambda ids: tok.convert_ids_to_tokens(ids))
    answers = ["circle: 12", "dot: 7"]
    ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
    labels = torch.full((2, 8), IGNORE)
    for b, a in enumerate(ids):
        labels[b, 2 : 2 + len(a)] = torch.tensor(a)
    kept = digit_labels(vlm, labels)
    assert [tok.convert_ids_to_tokens(row[row != IGNORE].tolist()) for row in kept] == [["1", "2"], ["7"]]
    assert ((kept != IGNORE) <= (labels != IGNORE)).all()  # never labels a token the answer lacks
    words = torch.full((1, 4), IGNORE)
    words[0, 1:3] = torch.tensor(tok("seven dots", add_special_tokens=False)["input_ids"])
    with pytest.raises(InputError, match="no digit token"):
        digit_labels(vlm, words, [TaskSample(None, "q", "seven dots", "count")])
