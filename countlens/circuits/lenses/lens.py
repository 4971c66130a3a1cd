"""Logit lens: read the residual stream after each layer as if it were the last.

At the last prompt position, layer l's residual is passed through the model's own final norm and
unembedding; the rank and probability of the gold answer token show where the answer becomes
decodable (rank 0 = the top token). After the last layer this is exactly the model's output.

Multi-token answers ("12" → "1", "2") are teacher-forced and read at each of their positions:
``rank`` is the worst rank among the answer's tokens (0 when the lens decodes every one of them
greedily), ``prob`` the product of their probabilities (the answer's sequence probability under the
lens) and ``top`` the lens's top token at the first answer position. A single-token answer has one
position, the last prompt position, where all three are read (on a digit-splitting vocabulary
every answer, even "3", has two positions: its digit and the end-of-answer token).
Norm and unembedding run inside the trace, so the same code serves local and remote (NDIF) models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.model.arguments import require_layers, require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


@torch.no_grad()
def logit_lens(vlm: VLM, samples: Sequence, layers: Sequence[int] | None = None, batch_size: int = 32) -> xr.Dataset:
    """``rank`` and ``prob`` of each sample's gold token, and the ``top`` token id, over (layer, sample)."""
    require_vlm(vlm, "logit_lens")
    check_samples(samples, "logit_lens")
    layers = require_layers(vlm, layers, "logit_lens") or list(range(vlm.arch.n_layers))
    for layer in layers:
        vlm.arch.layer(layer)
    spec = vlm.arch.spec
    ranks, probs, tops = [], [], []
    for _, batch in vlm.batches(samples, batch_size, teacher_force=True):
        answers = batch.answer_ids
        rows, cols, gold, first = _answer_positions(answers, batch.inputs["input_ids"].shape[1])
        r_l, p_l, t_l = [], [], []
        with vlm.read(batch):
            norm, head = vlm.module(spec.final_norm), vlm.module(spec.lm_head)
            for layer in sorted(layers):
                h = vlm.module(vlm.arch.layer(layer)).output[rows, cols]  # one row per answer token
                logits = head(norm(h)).float()
                g = logits[torch.arange(len(rows)), gold.to(logits.device)]
                r_l.append((logits > g[:, None]).sum(-1).save())
                p_l.append(logits.softmax(-1)[torch.arange(len(rows)), gold.to(logits.device)].save())
                t_l.append(logits.argmax(-1).save())
        # Per sample: worst rank and product of probabilities over its answer tokens.
        lengths = [len(a) for a in answers]
        ranks.append(torch.stack([torch.stack([x.max() for x in r.cpu().split(lengths)]) for r in r_l]))
        probs.append(torch.stack([torch.stack([x.prod() for x in p.cpu().split(lengths)]) for p in p_l]))
        tops.append(torch.stack([t.cpu()[first] for t in t_l]))
    return xr.Dataset(
        {
            "rank": (("layer", "sample"), torch.cat(ranks, 1).numpy()),
            "prob": (("layer", "sample"), torch.cat(probs, 1).numpy()),
            "top": (("layer", "sample"), torch.cat(tops, 1).numpy()),
        },
        coords={"layer": sorted(layers), "sample": np.arange(len(samples))},
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "method": "logit_lens",
        },
    )


def _answer_positions(answers: list[list[int]], width: int):
    """(batch rows, positions, gold ids, index of each sample's first token) of every answer token in a
    left-padded batch that teacher-forced each answer's first len − 1 tokens."""
    rows, cols, gold, first = [], [], [], []
    for b, a in enumerate(answers):
        first.append(len(gold))
        for t, token in enumerate(a):
            rows.append(b)
            cols.append(width - len(a) + t)
            gold.append(token)
    return torch.tensor(rows), torch.tensor(cols), torch.tensor(gold), torch.tensor(first)
