"""The MAS paper's attention diagnostics as its public code computes them (leduy99/-CVPRW26-Modality-
Attention-Share): the 4-way modality share behind its "10.7 % visual" figure, and VRA / ARS.

All three read the attention of the **last generation step**: after greedy decoding, the query row of
the position that produces the last generated token (the code's ``outputs.attentions[-1]``, row −1),
head-mean. `generation_batches` rebuilds that position by teacher-forcing the generated tokens but the
last after the prompt (`countlens.model.vlm.VLM.prepare`'s ``forced``).

- **4-way share** (``vlm-count-eval/modality_balance/attn_dist.ipynb``): per layer, the attention summed
  over four sets of prompt positions — *special* (tokens written ``<|…|>``, the image token excepted),
  *image* (image tokens), *system* (inside the system turn, its role word included) and *text* (inside
  the user turn) — the first rule that matches a position wins; generated tokens and the assistant
  header (countlens's prompts have one; the notebook's, built without the generation prompt, had none)
  belong to none. `modality_shares` reduces them as the notebook does: the raw sums averaged
  over samples, renormalised over the four sets per layer, then averaged over layers. The sets are
  ChatML's (``<|im_start|>`` … ``<|im_end|>`` turns, as Qwen's template writes them); a model whose
  template has no such turns is refused.
- **VRA** (``pixel_grounding_eval/eval.ipynb``, "visual fidelity"): per layer the image tokens'
  attention clipped at its 99th percentile over the image tokens, summed over layers:
  VRA = Σ_l Σ_{p ∈ G} c_l[p] / Σ_l Σ_p c_l[p].
- **ARS** (same notebook, ``final_attention_score``): the maximum over layers per image token, clipped
  at its 99th percentile over the tokens: ARS = Σ_{p ∈ G} c[p] − Σ_{p ∉ G} c[p] (a sum, not a mean).

G is the set of image tokens whose cell holds an object (`countlens.analysis.attention_metrics.object_cells`;
the code reads ground-truth patches from its data set, VizWiz-grounding at 24 × 24). These stand beside
countlens's own VRA and ARS (`attention_metrics`), which are other definitions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.errors import InputError
from countlens.model.answers import end_of_answer_id

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.model.vlm import VLM, Batch

SETS: tuple[str, ...] = ("special", "system", "image", "text")
QUANTILE = 0.99


def chatml_sets(vlm: VLM, batch: Batch, b: int) -> dict[str, list[int]]:
    """The four sets of sample ``b``'s prompt positions (`SETS`), by the notebook's rules."""
    ids = batch.inputs["input_ids"][b].tolist()
    last = int(batch.prompt_last[b])
    tokens = vlm.token_strings(ids)
    image = {int(p) for p in batch.image_pos[b]}
    starts = [i for i in range(last + 1) if tokens[i] == "<|im_start|>"]
    ends = [i for i in range(last + 1) if tokens[i] == "<|im_end|>"]
    if not starts or not ends:
        raise InputError(
            f"{vlm.name}'s prompt has no ChatML turns (<|im_start|> … <|im_end|>): the MAS code's 4-way share "
            "reads the system and user turns of Qwen's template"
        )
    turns = {}
    for s in starts:
        e = next((e for e in ends if e > s), None)
        role = tokens[s + 1].strip() if s + 1 <= last else ""
        if e is not None and role in ("system", "user") and role not in turns:
            turns[role] = range(s + 1, e)
    pad = vlm.pad_id()
    out: dict[str, list[int]] = {k: [] for k in SETS}
    # The notebook's prompt ends with the user turn (no assistant header): what follows it is in no set.
    user_end = turns["user"].stop if "user" in turns else last
    for i in range(min(last, user_end) + 1):
        if ids[i] == pad and i < starts[0]:  # left padding
            continue
        if i in image:
            out["image"].append(i)
        elif tokens[i].startswith("<|") and tokens[i].endswith("|>"):
            out["special"].append(i)
        elif i in turns.get("system", ()):
            out["system"].append(i)
        elif i in turns.get("user", ()):
            out["text"].append(i)
    return out


def set_sums(row: Float[Tensor, "layer key"], sets: dict[str, list[int]]) -> Float[Tensor, "layer set"]:
    """Each layer's attention summed over each set (raw: the four need not add up to 1)."""
    return torch.stack([row[:, sets[k]].sum(-1) if sets[k] else torch.zeros(row.shape[0]) for k in SETS], -1)


def modality_shares(sums: Float[Tensor, "sample layer set"]) -> dict[str, float]:
    """The notebook's reduction: mean raw sums over samples, renormalised over the sets per layer, mean
    over layers; a share per set (the image share is its "visual" figure)."""
    mean = torch.as_tensor(sums, dtype=torch.float64).mean(0)  # layer set
    shares = (mean / mean.sum(-1, keepdim=True)).mean(0)
    return {k: float(v) for k, v in zip(SETS, shares)}


def vra_as_reference(image: Float[Tensor, "layer n"], ground: Bool[Tensor, " n"], quantile: float = QUANTILE) -> float:
    """VRA as the code computes it: per-layer clip at the ``quantile`` over the image tokens, sums over
    layers, the ground-truth tokens' share. NaN when no attention reaches the image."""
    clip = torch.quantile(image.double(), quantile, dim=-1, keepdim=True)
    c = torch.minimum(image.double(), clip)
    total = float(c.sum())
    return float(c[:, ground].sum()) / total if total > 0 else float("nan")


def ars_as_reference(image: Float[Tensor, "layer n"], ground: Bool[Tensor, " n"], quantile: float = QUANTILE) -> float:
    """ARS as the code computes it: the maximum over layers per image token, clipped at its ``quantile``
    over the tokens; the ground-truth tokens' sum minus the others' sum."""
    m = image.double().max(0).values
    c = torch.minimum(m, torch.quantile(m, quantile))
    return float(c[ground].sum() - c[~ground].sum())


def generation_batches(
    vlm: VLM, samples: Sequence, batch_size: int, max_new_tokens: int
) -> Iterator[tuple[Sequence, Batch, list[list[int]]]]:
    """(chunk, the batch whose read position is each sample's last generation step, the generated ids):
    greedy decoding, then the prompt with every generated token but the last teacher-forced after it."""
    eos = vlm.hf.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    end = end_of_answer_id(vlm.processor)
    stops |= {end} if end is not None else set()
    pad = vlm.pad_id()
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        prompt = vlm.prepare_samples(chunk)
        with torch.no_grad():
            out = vlm.hf.generate(**prompt.inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        generated = []
        for row in out[:, prompt.inputs["input_ids"].shape[1] :].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            generated.append(row[:cut])
        forced = [g[:-1] for g in generated]
        batch = vlm.prepare([s.image for s in chunk], [s.question for s in chunk], forced=forced)
        yield chunk, batch, generated


def ground_tokens(cells: Tensor, objects: Bool[Tensor, "rows cols"]) -> Bool[Tensor, " n"]:
    """Which image tokens (their cells; (−1, −1) for none) lie on an object cell."""
    ok = cells[:, 0] >= 0
    out = torch.zeros(len(cells), dtype=torch.bool)
    out[ok] = objects[cells[ok, 0], cells[ok, 1]]
    return out
