"""Training batches: prompt + answer tokens, with labels on the answer tokens only.

`VLM.prepare` builds the prompt (chat template, images, left padding). A training batch appends
each sample's answer tokens after its prompt and pads the answers on the right; labels are −100
everywhere except on answer tokens, so the cross-entropy only counts the answer (or, with
``ce_on="digits"``, only the answer's digit tokens, as Counting Circuits' L_SFT). ``targets`` marks
the query positions that *predict* an answer token (the last prompt position, then each answer
token but the last): the positions whose attention the focus and MAS losses shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.errors import ConfigError, InputError
from countlens.settings import CE_ON

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

IGNORE = -100


@dataclass
class TrainBatch:
    inputs: dict[str, Tensor]
    labels: Tensor  # Long[Tensor, "batch seq"], IGNORE off the answer
    targets: Tensor  # Bool[Tensor, "batch seq"], positions that predict an answer token
    prompt: Batch  # the prompt-only batch (image positions, cells, geometry)
    samples: Sequence


def training_batch(vlm: VLM, samples: Sequence, ce_on: str = "answer") -> TrainBatch:
    """Prompt + answer batch for ``samples`` (anything with image, question, answer). ``ce_on``:
    "answer" labels every answer token; "digits" only those holding a digit (`digit_labels`)."""
    if ce_on not in CE_ON:
        raise ConfigError(f"ce_on={ce_on!r}: use one of {CE_ON}")
    prompt = vlm.prepare_samples(samples, answers=True)
    answers = prompt.answer_ids
    width = max(len(a) for a in answers)
    ids = prompt.inputs["input_ids"]
    n, length = ids.shape
    pad = vlm.tokenizer.pad_token_id if vlm.tokenizer.pad_token_id is not None else 0
    tail = torch.full((n, width), pad, dtype=ids.dtype, device=ids.device)
    tail_mask = torch.zeros(n, width, dtype=prompt.inputs["attention_mask"].dtype, device=ids.device)
    labels = torch.full((n, length + width), IGNORE, dtype=torch.long)
    for b, a in enumerate(answers):
        tail[b, : len(a)] = torch.tensor(a, dtype=ids.dtype, device=ids.device)
        tail_mask[b, : len(a)] = 1
        labels[b, length : length + len(a)] = torch.tensor(a)
    inputs = dict(prompt.inputs)
    for name, t in prompt.inputs.items():
        # Per-token tensors (ids, attention mask, token-type ids) grow by the answer columns.
        # Answer tokens are type 0, or 1 in the input that marks an answer (PaliGemma's token_type_ids,
        # where 0 is the bidirectional prefix: a 0 there would let the prompt see the answer).
        if isinstance(t, Tensor) and t.shape[:2] == (n, length) and t.dim() == 2:
            marks_answer = name in ("attention_mask", vlm.arch.spec.answer_token_type)
            extra = (
                tail
                if name == "input_ids"
                else tail_mask.to(t.dtype)
                if marks_answer
                else torch.zeros_like(tail, dtype=t.dtype)
            )
            inputs[name] = torch.cat([t, extra], dim=1)
    # The attention losses shape every position that predicts an answer token, whatever the CE reads.
    targets = answer_targets(labels)
    return TrainBatch(
        inputs, digit_labels(vlm, labels, samples) if ce_on == "digits" else labels, targets, prompt, samples
    )


def digit_labels(vlm: VLM, labels: Tensor, samples: Sequence = ()) -> Tensor:
    """``labels`` kept only on answer tokens that hold a digit: the Counting Circuits L_SFT, the
    cross-entropy of the count's digit tokens (Pstd's "circle: 12" → "1", "2" on Qwen)."""
    keep = labels != IGNORE
    digits = torch.tensor(digit_mask(vlm, labels[keep].tolist()), dtype=torch.bool)
    out = labels.clone()
    out[keep] = torch.where(digits, labels[keep], torch.full_like(labels[keep], IGNORE))
    empty = [b for b in range(len(out)) if keep[b].any() and not (out[b] != IGNORE).any()]
    if empty:
        answer = samples[empty[0]].answer if len(samples) > empty[0] else "?"
        raise InputError(
            f"ce_on='digits': the answer of sample {empty[0]} ({answer!r}) has no digit token; "
            "give digit answers (a Pstd or number prompt) or train with ce_on='answer'"
        )
    return out


def digit_mask(vlm: VLM, ids: Sequence[int]) -> list[bool]:
    """For each token id, whether its token holds a digit ("1", "Ġ12", "▁7")."""
    return [any(ch.isdigit() for ch in t) for t in vlm.token_strings(ids)]


def answer_targets(labels: Tensor) -> Tensor:
    """Bool[Tensor, "batch seq"]: position p is a target when label p + 1 is an answer token."""
    targets = torch.zeros_like(labels, dtype=torch.bool)
    targets[:, :-1] = labels[:, 1:] != IGNORE
    return targets
