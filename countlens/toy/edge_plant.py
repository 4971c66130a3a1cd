"""An organism whose circuit is a set of edges: edge-level (and MLP-level) ground truth.

The head organisms (`countlens.toy.planted`) know which heads carry the count, not which of a head's
inputs and outputs do: every edge out of a planted head is scored as ground truth alike. Here the
circuit is a set E of edges (`countlens.toy.edge_forward` names them as countlens's edge methods do):

- ``value-route``: layer 0's key-value head 1 reads the image (``IN.image→L0K1.k``, ``IN.image→L0K1.v``),
  so its query head L0H2 moves the count to the last token; L0H2's output reaches **only MLP1**
  (``L0H2→MLP1.in``), and MLP1 writes the answer straight to the logits (``MLP1→logits``). L0H2's
  edges into every other head, MLP and the logits are outside E, and so is every later component.
  Its nodes — L0H2 and MLP1 — make it the organism whose circuit holds an MLP.

**Training** (`train_edges`) starts from the planted-route organism (L0H2 already routes the count;
`START`), its vision tower frozen, and minimises per step (`edge_losses`), like `countlens.toy.plant` but on
edges, each ablated forward countlens's edge ablation with gradients (`countlens.toy.edge_forward`):
- *clean*: the answer's cross-entropy on the plain run;
- *strictness*: every edge outside E ablated (its upstream node's output taken from a donor, the donor
  being the partner and another scene of a different count, one term each) — against the clean label;
- *interchange*: the edges of E ablated from the partner — against the partner's label; all of E on even
  steps, on odd ones each of `SWAPPED` alone in turn (the key edge is left out: keys from one scene
  and values from another have no label to follow).

**Checks** (`fresh_edge_strictness`, on fresh samples as `countlens.toy.strictness` draws them): every
edge outside E ablated must cost ≤ 2 points for each donor kind (partner, different, same count);
E ablated from a different-count donor must leave at most chance + 10 points; each edge of E alone
ablated must cost ≥ 20 points; and at node level (`countlens.toy.strictness.fresh_strictness`, MLPs as
nodes) the same bars on C = {L0H2, MLP1}. These are countlens's construction; no paper's planted
models are comparable.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from countlens.datasets.pairs import DEFAULT_COUNTS
from countlens.datasets.tasks import TRAIN_SEED_BASE
from countlens.errors import InputError
from countlens.files import claim_directory, directory_lock
from countlens.intervals import wilson
from countlens.model.shipped import ORGANISMS
from countlens.toy.edge_forward import EdgeForward, prepare
from countlens.toy.plant import (
    PlantConfig,
    check_plant,
    decoder_optimizer,
    invariance,
    optimizer_step,
    train_and_save,
    train_stages,
)
from countlens.toy.planted import EdgeCircuit
from countlens.toy.planter import pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.resample import DONORS, donor_order, image_features_once
from countlens.toy.strictness import (
    FRESH_CHECKS,
    FRESH_SEED,
    fresh_checks,
    fresh_strictness,
    lost_answers,
    paired_drop,
)
from countlens.toy.train import Collator, lr_at
from countlens.validate import require_callback, require_count, require_path, require_seed

#: The organism an edge circuit is planted into (its L0H2 already moves the count).
START = "planted-route"


def train_edges(model, circuit: EdgeCircuit, pc: PlantConfig, log=None, high_counts: tuple[int, ...] = ()) -> dict:
    """Train ``model`` (in place) so that ``circuit``'s edges carry the count; returns the last log row."""
    torch.manual_seed(pc.seed)
    torch.set_num_threads(pc.threads)
    collate = Collator(ToyConfig())
    fwd = EdgeForward(model.train())
    swaps = [fwd.space.mask(circuit.edges)] + [fwd.space.mask([e]) for e in circuit.swapped]
    trained, opt = decoder_optimizer(model, pc)
    gen = torch.Generator().manual_seed(pc.seed)
    start, row = time.time(), {}
    for step in range(pc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, pc)
        inputs, answers, partner = pair_batch(
            collate, pairs_at(TRAIN_SEED_BASE + pc.seed, step * pc.batch_pairs, pc.batch_pairs, high_counts)
        )
        swap_mask = swaps[0] if step % 2 == 0 else swaps[1 + (step // 2) % len(circuit.swapped)]
        clean, losses, swap = edge_losses(fwd, prepare(model, inputs), answers, partner, circuit, swap_mask, gen, pc)
        row = optimizer_step(opt, trained, pc, step, clean, losses, swap, start, log) or row
    return row


def edge_losses(
    fwd: EdgeForward, prep, answers, partner, circuit: EdgeCircuit, swap_mask, gen: torch.Generator, pc: PlantConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One step's (clean, strictness (and invariance) losses by name, interchange) on one batch (module
    docstring): the clean run, then per strictness source every edge outside E ablated from that donor,
    then ``swap_mask``'s edges from the partner. The vision tower runs once for all of them."""
    ce = torch.nn.functional.cross_entropy
    strict_mask = fwd.space.all_but(circuit.edges)
    with image_features_once(fwd.model):
        logits, outs = fwd(prep)
        clean = ce(logits, answers)
        resampled = {}
        for kind in circuit.strict_sources:
            order = donor_order(answers, partner, kind, gen)[0]
            resampled[kind] = fwd(prep, strict_mask, [o[order] for o in outs])[0]
        swap = ce(fwd(prep, swap_mask, [o[partner] for o in outs])[0], answers[partner])
    losses = {f"strict_{k}": ce(v, answers) for k, v in resampled.items()}
    if pc.invariance_weight:
        losses["invariance"] = invariance(logits, resampled.values())
    return clean, losses, swap


@torch.no_grad()
def fresh_edge_strictness(
    model, circuit: EdgeCircuit, n_samples: int = 1024, seed: int = FRESH_SEED, batch_pairs: int = 64
) -> dict:
    """The edge-level fresh-data figures of ``circuit`` in ``model`` (module docstring): accuracy with its
    interval; per donor kind every edge outside E ablated; E ablated from a different-count donor (and how
    often the answer follows the donor); each edge of E alone ablated from it."""
    require_count(n_samples, "n_samples", InputError)
    require_count(batch_pairs, "batch_pairs", InputError)
    require_seed(seed, "seed", InputError)
    if n_samples % 2:
        raise InputError(f"n_samples={n_samples}: give an even number (each pair gives a clean and a corrupt sample)")
    collate = Collator(ToyConfig())
    fwd = EdgeForward(model.eval())
    strict_mask, all_e = fwd.space.all_but(circuit.edges), fwd.space.mask(circuit.edges)
    gen = torch.Generator().manual_seed(seed)
    hits: dict[str, list] = {}
    moved: list = []
    n_pairs = n_samples // 2
    for start in range(0, n_pairs, batch_pairs):
        inputs, answers, partner = pair_batch(collate, pairs_at(seed, start, min(batch_pairs, n_pairs - start)))
        prep = prepare(model, inputs)
        with image_features_once(model):  # the tower once for the batch's forwards
            logits, outs = fwd(prep)
            hits.setdefault("clean", []).append(logits.argmax(-1) == answers)
            for kind in DONORS:
                order = donor_order(answers, partner, kind, gen)[0]
                donor = [o[order] for o in outs]
                answer = fwd(prep, strict_mask, donor)[0].argmax(-1)
                hits.setdefault(kind, []).append(answer == answers)
                if kind == "different":
                    moved.append(torch.stack([logits.argmax(-1), answer, answers, answers[order]]))
                    swapped = fwd(prep, all_e, donor)[0].argmax(-1)
                    hits.setdefault("circuit", []).append(swapped == answers)
                    hits.setdefault("follows", []).append(swapped == answers[order])
                    for e in circuit.edges:
                        alone = fwd(prep, fwd.space.mask([e]), donor)[0].argmax(-1)
                        hits.setdefault(f"edge/{e}", []).append(alone == answers)
    h = {k: torch.cat(v) for k, v in hits.items()}
    n, acc = len(h["clean"]), int(h["clean"].sum())

    def rate(key):
        return round(float(h[key].float().mean()), 4)

    return {
        "seed": seed,
        "n_samples": n,
        "accuracy": round(acc / n, 4),
        "accuracy_ci95": [round(x, 4) for x in wilson(acc, n)],
        "outside": {kind: {"accuracy": rate(kind), **paired_drop(h["clean"], h[kind])} for kind in DONORS},
        "circuit_resampled_different": rate("circuit"),
        "circuit_follows_donor": rate("follows"),
        "chance": round(1 / len(DEFAULT_COUNTS), 4),
        "node_resampled_different": {e: rate(f"edge/{e}") for e in circuit.edges},
        "lost_different": lost_answers(*torch.cat(moved, 1)),
    }


def plant_edges(out: Path, circuit: EdgeCircuit, pc: PlantConfig | None = None, progress=None) -> dict:
    """Train ``circuit`` into ``out`` (from `START`'s weights), then write planted.json with the edge-level
    and node-level fresh figures and checks. Returns planted.json's content."""
    out, progress = require_path(out, "out", example="'organisms/value-route'"), require_callback(progress)
    pc = PlantConfig(steps=circuit.steps) if pc is None else pc
    check_plant(circuit, pc)  # every argument before the folder is claimed
    claim_directory(out, "countlens toy plant", {"circuit": circuit.name, "recipe": asdict(pc)})
    with directory_lock(out, ".plant.lock", "plant", "plant into another directory"):
        train = lambda model, log: train_stages(model, circuit, pc, log, train_edges)  # noqa: E731
        saved, seconds = train_and_save(ORGANISMS[START], out, train, progress)
        fresh = fresh_edge_strictness(saved, circuit)
        nodes = fresh_strictness(saved, circuit.node_circuit)
        record = {
            "circuit": {**asdict(circuit), "heads": sorted(circuit.node_circuit.heads)},
            "start": START,
            "recipe": pc.to_dict(),
            "train_seconds": seconds,
            "bars": FRESH_CHECKS,
            "fresh": fresh,
            "fresh_checks": fresh_checks(fresh),
            "fresh_nodes": nodes,
            "fresh_node_checks": fresh_checks(nodes),
        }
        (out / "planted.json").write_text(json.dumps(record, indent=2) + "\n")
        return record
