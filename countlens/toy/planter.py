"""The resampling forwards of a planted circuit on one model: training (`countlens.toy.plant`), its
held-out checks and the fresh-data checks (`countlens.toy.strictness`) all run these.

A batch is the cleans then the corrupts of consecutive "shapes" count pairs (the short prompt, counts
1–9), so every prompt has one length; ``partner[i]`` is sample i's pair partner.
"""

from __future__ import annotations

import torch

from countlens.datasets.pairs import DEFAULT_COUNTS, count_pair
from countlens.toy.planted import PlantedCircuit, PlantedNode, check_circuit
from countlens.toy.resample import keep_masks, mlp_keep_masks, position_masks, recorded, resampled
from countlens.toy.train import Collator


def pairs_at(seed: int, start: int, n: int, high_counts: tuple[int, ...] = ()) -> list:
    """``n`` consecutive "shapes" count pairs (short prompt, counts 1–9) from index ``start``; with
    ``high_counts``, every odd-indexed pair is drawn from those counts instead."""
    return [
        count_pair(seed, i, "shapes", prompt="short", counts=high_counts if high_counts and i % 2 else DEFAULT_COUNTS)
        for i in range(start, start + n)
    ]


def pair_batch(collate: Collator, pairs: list) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(inputs, answers, partner): cleans then corrupts; ``partner[i]`` is sample i's pair partner."""
    samples = [p.clean for p in pairs] + [p.corrupt for p in pairs]
    inputs, answers = collate(samples)
    if int(inputs["attention_mask"].sum(1).min()) != inputs["attention_mask"].shape[1]:
        raise ValueError("planted training needs prompts of one length (the short prompt, one-word shapes)")
    n = len(pairs)
    partner = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return inputs, answers, partner


class Planter:
    """The resampling forwards of one circuit on one model (shared by training and `verify`)."""

    def __init__(self, model, circuit: PlantedCircuit, collate: Collator):
        text = model.config.text_config
        self.n_layers, self.n_heads = text.num_hidden_layers, text.num_attention_heads
        check_circuit(circuit, self.n_layers, self.n_heads)
        self.model, self.circuit, self.collate = model, circuit, collate
        tok = collate.tok
        self.ids = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|vision_end|>")

    def logits(self, inputs: dict) -> torch.Tensor:
        return self.model(**inputs, logits_to_keep=1).logits[:, -1]

    def record(self, inputs: dict) -> tuple[dict, torch.Tensor]:
        """(the plain run's recording (`recorded`) of ``inputs``, its last-position logits)."""
        with torch.no_grad(), recorded(self.model) as rec:
            logits = self.model(**inputs, logits_to_keep=1).logits[:, -1]
        return rec, logits

    def masks(self, inputs: dict) -> dict[str, torch.Tensor]:
        return position_masks(inputs["input_ids"], *self.ids)

    def nodes_mask(self, nodes, masks) -> tuple[torch.Tensor, torch.Tensor]:
        """((layers, B, T, heads), (layers, B, T)) of ``nodes``' heads and MLPs over every position."""
        every = [PlantedNode(n.layer, n.head) for n in nodes]
        return keep_masks(every, masks, self.n_layers, self.n_heads), mlp_keep_masks(every, masks, self.n_layers)

    def strict_logits(self, inputs: dict, source: dict, training: bool) -> torch.Tensor:
        """Every node outside C from ``source`` (in training: also C outside its ``at`` positions, and the
        blind layers' image keys and values); MLPs only on circuits whose MLPs are nodes."""
        masks = self.masks(inputs)
        if training:
            keep = keep_masks(self.circuit.nodes, masks, self.n_layers, self.n_heads)
            keep_mlp = mlp_keep_masks(self.circuit.nodes, masks, self.n_layers)
            blind = {layer: masks["image"] for layer in self.circuit.blind_layers}
        else:
            (keep, keep_mlp), blind = self.nodes_mask(self.circuit.nodes, masks), None
        take_mlp = ~keep_mlp if self.circuit.mlp_nodes else None
        with resampled(self.model, source, ~keep, blind, take_mlp):
            return self.logits(inputs)

    def swapped_logits(self, inputs: dict, source: dict, nodes) -> torch.Tensor:
        """``nodes`` (heads and MLPs over every position) from ``source``, everything else clean."""
        heads, mlps = self.nodes_mask(nodes, self.masks(inputs))
        with resampled(self.model, source, heads, take_mlp=mlps if mlps.any() else None):
            return self.logits(inputs)


def other_sample(b: int, gen: torch.Generator) -> torch.Tensor:
    """A source order for ``b`` samples in which no sample is its own source: a random cyclic shift."""
    return (torch.arange(b) + torch.randint(1, b, (1,), generator=gen)) % b
