"""Answers as token sequences: how a model writes an answer, and how two answers are told apart.

Real VLM tokenizers write numbers digit by digit (Qwen2/2.5/3-VL: "12" → "1", "2"; LLaMA and Gemma
split digits too), so an answer is a *sequence* of tokens, and "1" is the first token of 1, 10, 11
and 12. Three rules make every measurement well defined on such vocabularies. Where every answer is a
single token (a word-level vocabulary such as the organism's) each reduces to the plain next-token
read, bit for bit; on a digit-splitting vocabulary every answer, even "3", ends with the
end-of-answer token, so its figures count that token too.

- **Termination.** Where a vocabulary writes one count as a proper prefix of another ("1" of "10",
  `splits_numbers`), a sequence's probability cannot rank them: p("1") ≥ p("1", "0") always. Such a
  vocabulary's answers end with the model's end-of-answer token (`end_of_answer_id`: the special
  token its chat template writes after an assistant message, e.g. Qwen's ``<|im_end|>``), as the
  model writes them. Vocabularies where every count 0…20 is one token keep bare answers.
- **Pairs** (patching, AtP): two answers are compared at the first token where their sequences
  differ, with their shared prefix teacher-forced on both sides (`divergence`): 10 vs 12 →
  prefix ("1"), then "0" vs "2"; 1 vs 10 → prefix ("1"), then end vs "0"; 9 vs 12 → no prefix,
  "9" vs "1". This keeps the logit difference a difference of two logits at one position — one
  forward row per patched replica, linear in the logits, so AtP's gradient estimates the same
  quantity — and asks the model the very decision that separates the two counts. (A summed
  sequence log-probability would need a row per answer and per replica, and mixes in tokens both
  answers share.)
- **Single answers** (scoring, ablation, logit lens): the answer's tokens are teacher-forced and
  their log-probabilities summed; an answer is predicted when each of its tokens is the arg-max
  given the ones before (what greedy decoding would write).
"""

from __future__ import annotations

from collections.abc import Sequence

from countlens.errors import InputError

#: Counts whose tokenisations are checked for prefixes by `splits_numbers`.
CHECKED_COUNTS = range(0, 21)


def splits_numbers(tokenizer) -> bool:
    """Whether the vocabulary writes some count 0…20 as a proper prefix of another (digits split)."""
    seqs = [tuple(tokenizer(str(n), add_special_tokens=False)["input_ids"]) for n in CHECKED_COUNTS]
    return any(len(a) < len(b) and b[: len(a)] == a for a in seqs for b in seqs)


def end_of_answer_id(processor) -> int | None:
    """The token that ends an assistant answer: the special token the chat template writes right after
    an assistant message's text, else the tokenizer's eos token; None when there is neither."""
    tok = getattr(processor, "tokenizer", processor)
    mark = "ANSWERMARK"
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": mark}]},
    ]
    try:
        text = processor.apply_chat_template(messages, tokenize=False)
    except Exception:  # no chat template, or one that rejects an assistant turn: fall back to eos
        text = ""
    if mark in text:
        after = tok(text.split(mark, 1)[1], add_special_tokens=False)["input_ids"]
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        special = set(tok.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
        if after and after[0] in special:
            return int(after[0])
    return None if tok.eos_token_id is None else int(tok.eos_token_id)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def divergence(a: Sequence[int], b: Sequence[int], names: tuple[str, str] = ("a", "b")) -> tuple[list[int], int, int]:
    """(shared prefix, a's token, b's token) at the first position where answers ``a`` and ``b`` differ."""
    p = shared_prefix(a, b)
    if p == len(a) or p == len(b):
        what = "tokenise identically" if len(a) == len(b) else "are a prefix of one another"
        raise InputError(
            f"answers {names[0]!r} and {names[1]!r} {what} ({list(a)} vs {list(b)}), so no token tells them "
            "apart; use answers that differ, or a model whose answers end with an end-of-answer token"
        )
    return list(a[:p]), int(a[p]), int(b[p])


def read_rows(candidates: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The teacher-forced prefixes whose forward rows give every next-token distribution that scoring
    ``candidates`` needs: the longest proper prefixes (one row yields the logits after each of its
    own prefixes). Single-token candidates need one row, the bare prompt."""
    needed = {tuple(c[:t]) for c in candidates for t in range(len(c))}
    return sorted(p for p in needed if not any(len(q) > len(p) and q[: len(p)] == p for q in needed))


def answer_window(answers: Sequence[Sequence[int]]) -> int:
    """How many final positions a teacher-forced batch of ``answers`` must keep logits for."""
    return max(len(a) for a in answers)


def sequence_scores(logits, answers: Sequence[Sequence[int]]):
    """(predicted, log p) of each answer from the logits of rows that teacher-forced its first
    len − 1 tokens: ``logits`` Float[Tensor, "... batch keep vocab"] over each row's last ``keep``
    positions. log p sums the answer tokens' log-probabilities; predicted is True when each token is
    the arg-max given the ones before. Both Bool/Float[Tensor, "... batch"]."""
    import torch

    keep = logits.shape[-2]
    logp = logits.log_softmax(-1)
    top = logits.argmax(-1)
    ok, lp = [], []
    for b, a in enumerate(answers):
        pos = torch.arange(keep - len(a), keep, device=logits.device)
        ids = torch.as_tensor(list(a), device=logits.device)
        lp.append(logp[..., b, pos, ids].sum(-1))
        ok.append((top[..., b, pos] == ids).all(-1))
    return torch.stack(ok, -1), torch.stack(lp, -1)
