"""Strictness on fresh data: does anything outside a planted circuit C still carry the count?

InterpBench's claim, which the planted organisms copy, is that nothing outside C matters. `verify`
(`countlens.toy.plant`) checks it on the held-out pairs the recipe was tuned against; this module
checks it where nothing was tuned: ≥ 1,024 samples drawn by ``FRESH_SEED`` (neither training's seeds,
≥ `TRAIN_SEED_BASE`, nor verify's `EVAL_SEED`, nor discover's default 0), with every head outside C
resampled (heads over every position, as every method sees them) from three kinds of **donor**:

- ``partner``: the sample's clean/corrupt partner — the same objects, another count;
- ``different``: another scene of the batch whose count differs (neither the sample nor its partner);
- ``same``: another scene of the batch with the same count (a drop here means the rest of the model
  carries the scene, not the count).

For each donor kind the **drop** is accuracy(clean) − accuracy(outside C resampled), a paired
difference over the same samples; its 95 % interval is the normal one, mean ± 1.96 · sd / √n of the
per-sample differences (each −1, 0 or 1). Accuracy's interval is Wilson's (`countlens.intervals.wilson`).
The bar (`FRESH_CHECKS`, countlens's choice, the issue's "≤ 2 points"): every donor kind's drop ≤ 0.02 as a
point estimate, the interval stated beside it. C resampled from a ``different`` donor must leave at
most chance (1/9) plus 10 points of the clean answers, as `verify`'s check does; how often the answer
then follows the donor's count is reported beside it. On circuits whose every node is necessary, each
node alone resampled from a ``different`` donor must cost ≥ 20 points of accuracy.

A batch's donors are drawn by a generator seeded with ``FRESH_SEED``: a pure function of the seed.
"""

from __future__ import annotations

import math

import torch

from countlens.datasets.pairs import DEFAULT_COUNTS
from countlens.errors import InputError
from countlens.intervals import wilson
from countlens.toy.planted import PlantedCircuit
from countlens.toy.planter import Planter, pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.resample import DONORS, donor_order, image_features_once, swap_source
from countlens.toy.train import Collator
from countlens.validate import require_count, require_seed

#: Fresh samples' seed: not training's (≥ 1000), not verify's (1), not discover's default (0).
FRESH_SEED = 2
#: The bars on fresh data (countlens's choice; the issue named the 2-point drop and ≥ 1,024 samples).
FRESH_CHECKS = {
    "n_samples_min": 1024,
    "accuracy_min": 0.90,
    "outside_drop_max": 0.02,
    "circuit_above_chance_max": 0.10,
    "node_drop_min": 0.20,
}
#: The normal 95 % quantile of `paired_drop`, as its figures were computed (Wilson's uses the exact one).
Z95 = 1.959964


def paired_drop(before: torch.Tensor, after: torch.Tensor) -> dict:
    """The drop mean(before − after) of two 0/1 vectors over the same samples, with its 95 % interval."""
    d = before.double() - after.double()
    mean, se = float(d.mean()), float(d.std(unbiased=True)) / math.sqrt(len(d))
    return {"drop": round(mean, 4), "ci95": [round(mean - Z95 * se, 4), round(mean + Z95 * se, 4)]}


@torch.no_grad()
def fresh_strictness(
    model, circuit: PlantedCircuit, n_samples: int = 1024, seed: int = FRESH_SEED, batch_pairs: int = 64
) -> dict:
    """The fresh-data figures of ``circuit`` planted in ``model`` (a HF Qwen2-VL organism, float32):
    accuracy with its interval, and per donor kind the outside-C accuracy, drop and interval, and C
    resampled from a ``different`` donor."""
    require_count(n_samples, "n_samples", InputError)
    require_count(batch_pairs, "batch_pairs", InputError)
    require_seed(seed, "seed", InputError)
    if n_samples % 2:
        raise InputError(f"n_samples={n_samples}: give an even number (each pair gives a clean and a corrupt sample)")
    planter = Planter(model.eval(), circuit, Collator(ToyConfig()))
    gen = torch.Generator().manual_seed(seed)
    hits: dict[str, list] = {}
    moved: list = []
    missing = 0
    n_pairs = n_samples // 2
    for start in range(0, n_pairs, batch_pairs):
        inputs, answers, partner = pair_batch(planter.collate, pairs_at(seed, start, min(batch_pairs, n_pairs - start)))
        with image_features_once(model):
            rec, clean = planter.record(inputs)
            hits.setdefault("clean", []).append(clean.argmax(-1) == answers)
            for kind in DONORS:
                order, found = donor_order(answers, partner, kind, gen)
                missing += int((~found).sum())
                source = swap_source(rec, order)
                answer = planter.strict_logits(inputs, source, training=False).argmax(-1)
                hits.setdefault(kind, []).append(answer == answers)
                if kind == "different":
                    moved.append(torch.stack([clean.argmax(-1), answer, answers, answers[order]]))
                    swapped = planter.swapped_logits(inputs, source, circuit.nodes).argmax(-1)
                    hits.setdefault("circuit_different", []).append(swapped == answers)
                    hits.setdefault("follows_donor", []).append(swapped == answers[order])
                    for node in circuit.nodes if circuit.each_necessary and len(circuit.nodes) > 1 else ():
                        alone = planter.swapped_logits(inputs, source, (node,)).argmax(-1) == answers
                        hits.setdefault(f"node/{node.label}", []).append(alone)
    h = {k: torch.cat(v) for k, v in hits.items()}
    n = len(h["clean"])
    acc = int(h["clean"].sum())
    out = {
        "seed": seed,
        "n_samples": n,
        "accuracy": round(acc / n, 4),
        "accuracy_ci95": [round(x, 4) for x in wilson(acc, n)],
        "outside": {
            kind: {"accuracy": round(float(h[kind].float().mean()), 4), **paired_drop(h["clean"], h[kind])}
            for kind in DONORS
        },
        "circuit_resampled_different": round(float(h["circuit_different"].float().mean()), 4),
        "circuit_follows_donor": round(float(h["follows_donor"].float().mean()), 4),
        "chance": round(1 / len(DEFAULT_COUNTS), 4),
        "donors_missing": missing,
        "lost_different": lost_answers(*torch.cat(moved, 1)),
    }
    nodes = {k.removeprefix("node/"): v for k, v in h.items() if k.startswith("node/")}
    if nodes:
        out["node_resampled_different"] = {k: round(float(v.float().mean()), 4) for k, v in nodes.items()}
    return out


def lost_answers(clean: torch.Tensor, resampled: torch.Tensor, gold: torch.Tensor, donor: torch.Tensor) -> dict:
    """Where the answers lost to a different-count donor went (counts, not rates: a diagnostic beside the
    bar, not one of its figures): ``lost`` right when clean and wrong when resampled; of those, how many
    are ``off_by_one`` and how many moved ``toward_donor`` (the error's sign is the donor count's, about half
    of them by chance alone; a share well above half says the rest of the model carries the donor's count).
    Answers are the organism's count tokens, whose ids run in count order."""
    lost = (clean == gold) & (resampled != gold)
    error, pull = resampled[lost] - gold[lost], donor[lost] - gold[lost]
    return {
        "lost": int(lost.sum()),
        "off_by_one": int((error.abs() == 1).sum()),
        "toward_donor": int((error.sign() == pull.sign()).sum()),
    }


def fresh_checks(figures: dict) -> dict[str, bool]:
    """Each of `FRESH_CHECKS` passed or not on ``figures`` (from `fresh_strictness`)."""
    bars = FRESH_CHECKS
    checks = {
        "n_samples": figures["n_samples"] >= bars["n_samples_min"],
        "accuracy": figures["accuracy"] >= bars["accuracy_min"],
        "circuit": figures["circuit_resampled_different"] - figures["chance"] <= bars["circuit_above_chance_max"],
    }
    for kind, row in figures["outside"].items():
        checks[f"outside_{kind}"] = row["drop"] <= bars["outside_drop_max"]
    if "node_resampled_different" in figures:  # every node necessary: each alone moves the answer
        drops = [figures["accuracy"] - v for v in figures["node_resampled_different"].values()]
        checks["each_node"] = min(drops) >= bars["node_drop_min"]
    return checks
