"""Train and verify a planted-circuit organism: `countlens toy plant --circuit route --out DIR`.

The recipe (`countlens.toy.planted` explains the circuits and the two losses): start from the shipped
organism's weights and train on clean/corrupt count pairs of the "shapes" kind (`count_pair`, the
short prompt, counts 1–9, training seeds ≥ `TRAIN_SEED_BASE` so that evaluation and `discover`'s pairs
are never seen), each sample's source being its pair's partner. Per step: one recording forward
without gradients, then the strictness and the interchange forwards, AdamW on their summed
cross-entropies (and, where ``invariance_weight`` asks, the weighted `invariance` of the strictness
runs), linear warmup and cosine decay. Every batch is a pure function of (seed, step) and
torch is seeded, so a rerun with the same seed and thread count reproduces the weights.

`verify` measures what makes the circuit planted, on held-out pairs (seed `EVAL_SEED`), nodes being
heads over every position:
- ``accuracy``: the clean runs' answers;
- ``outside_resampled``: every head outside C resampled (the partner's z; and a random other sample's,
  ``outside_resampled_random``);
- ``circuit_resampled``: C resampled from a random other sample — at chance if C carries the count
  (from the partner it falls to ~0, as the partner's count always differs);
- ``node_resampled``: each node of C alone resampled from a random other sample.
`PLANTED_CHECKS` are the bars a shipped organism passes; `countlens.toy.plant` writes them with the
figures to ``planted.json`` beside the weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from countlens.datasets.pairs import DEFAULT_COUNTS
from countlens.datasets.tasks import TRAIN_SEED_BASE
from countlens.errors import ConfigError
from countlens.files import claim_directory, directory_lock
from countlens.model.shipped import TOY_DIR
from countlens.toy.planted import (
    EdgeCircuit,
    PlantedCircuit,
    Sharpening,
    check_circuit,
    check_fields,
    check_sharpening,
)
from countlens.toy.planter import Planter, other_sample, pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig, build_image_processor, build_tokenizer
from countlens.toy.resample import (
    donor_order,
    image_features_once,
    recorded,
    swap_source,
)
from countlens.toy.strictness import fresh_checks, fresh_strictness
from countlens.toy.train import Collator, lr_at  # lr_at: the organism's warmup and cosine schedule
from countlens.validate import (
    require_callback,
    require_count,
    require_nonnegative,
    require_path,
    require_positive,
    require_seed,
)

#: Held-out pairs' seed: neither training (≥ TRAIN_SEED_BASE) nor discover's default (0).
EVAL_SEED = 1
#: A shipped planted organism's bars (countlens's choice where the issue named none: "chance" is
#: 1/9 for counts 1–9, and a random-source resample of C must land within 10 points of it).
PLANTED_CHECKS = {
    "accuracy_min": 0.90,
    "outside_drop_max": 0.02,
    "circuit_above_chance_max": 0.10,
    "node_drop_min": 0.20,
}


def check_run(cfg, weights: tuple[str, ...]) -> None:
    """What every planting recipe checks (`PlantConfig`, `countlens.toy.feature_plant.FeatureConfig`): its
    seed, steps, batch pairs, threads, warmup and learning rate, and its ``weights`` (each ≥ 0)."""
    require_seed(cfg.seed, "seed", ConfigError)
    for name in ("steps", "batch_pairs", "threads"):
        require_count(getattr(cfg, name), name, ConfigError)
    require_seed(cfg.warmup, "warmup", ConfigError)
    require_positive(cfg.lr, "lr", ConfigError)
    for name in weights:
        require_nonnegative(getattr(cfg, name), name, ConfigError)


@dataclass(frozen=True)
class PlantConfig:
    """Hyper-parameters of one planting run (the circuit is named separately)."""

    seed: int = 0
    steps: int = 400
    batch_pairs: int = 16
    lr: float = 1e-3
    warmup: int = 20
    clean_weight: float = 1.0
    different_weight: float = 1.0  # the weight of the strictness term from a different-count donor
    # The weight of the invariance term: per strictness source, KL(clean run's answer distribution, held
    # fixed ‖ the resampled run's); 0 leaves it out.
    invariance_weight: float = 0.0
    weight_decay: float = 0.01
    threads: int = 1  # the shipped organisms' (a rerun reproduces them with the same thread count)

    def __post_init__(self) -> None:
        check_run(self, ("weight_decay", "clean_weight", "different_weight", "invariance_weight"))

    def to_dict(self) -> dict:
        return asdict(self)


def swapped_nodes(circuit: PlantedCircuit, step: int) -> tuple:
    """The interchange loss's nodes at ``step``: all of C, or, on circuits whose every node is
    necessary, all of C on even steps and one node in turn on odd ones."""
    nodes = circuit.nodes
    if not circuit.each_necessary or len(nodes) == 1 or step % 2 == 0:
        return nodes
    return (nodes[(step // 2) % len(nodes)],)


def train_planted(model, circuit: PlantedCircuit, pc: PlantConfig, log=None, high_counts: tuple[int, ...] = ()) -> dict:
    """Train ``model`` (modified in place) so that ``circuit`` is planted; returns the last log row.
    ``high_counts``: every other pair drawn from these counts (`pairs_at`; a `Sharpening` stage's)."""
    torch.manual_seed(pc.seed)
    torch.set_num_threads(pc.threads)
    collate = Collator(ToyConfig())  # its own tokenizer and image processor
    planter = Planter(model.train(), circuit, collate)
    trained, opt = decoder_optimizer(model, pc)
    start, row = time.time(), {}
    gen = torch.Generator().manual_seed(pc.seed)  # the random strictness sources, a pure function of the seed
    for step in range(pc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, pc)
        inputs, answers, partner = pair_batch(
            collate, pairs_at(TRAIN_SEED_BASE + pc.seed, step * pc.batch_pairs, pc.batch_pairs, high_counts)
        )
        ce = torch.nn.functional.cross_entropy
        with image_features_once(model):
            with recorded(model) as rec:  # the clean run: its loss, and the sources of the others
                clean_logits = planter.logits(inputs)
                clean = ce(clean_logits, answers)
            source = swap_source(rec, partner)
            sources = {"partner": source}
            if "random" in circuit.strict_sources:
                sources["random"] = swap_source(rec, other_sample(len(answers), gen))
            for kind in ("different", "same"):  # in this order: the draws are a pure function of the seed
                if kind in circuit.strict_sources:
                    sources[kind] = swap_source(rec, donor_order(answers, partner, kind, gen)[0])
            # A circuit may check some sources' strictness as the checks do (C kept at every position, no
            # blind layer): training's own devices resample more than the checks, and the mix the checks
            # see (C clean everywhere, the rest from another scene) is otherwise never trained on.
            resampled = {
                name: planter.strict_logits(inputs, sources[name], training=name not in circuit.checked)
                for name in circuit.strict_sources
            }
            swap = ce(planter.swapped_logits(inputs, source, swapped_nodes(circuit, step)), answers[partner])
        losses = {("strict" if k == "partner" else f"strict_{k}"): ce(v, answers) for k, v in resampled.items()}
        if pc.invariance_weight:
            losses["invariance"] = invariance(clean_logits, resampled.values())
        row = optimizer_step(opt, trained, pc, step, clean, losses, swap, start, log) or row
    return row


def train_stages(model, circuit, pc: PlantConfig, log=None, train=None) -> dict:
    """``train`` (`train_planted`, or `countlens.toy.edge_plant.train_edges` for an edge circuit) with
    ``pc``, then the circuit's `Sharpening` stage if it has one (its log rows marked ``"stage": 2``);
    returns the last log row."""
    train = train_planted if train is None else train
    check_sharpening(circuit.name, circuit.sharpen)
    row = train(model, circuit, pc, log)
    s = circuit.sharpen
    if s is None:
        return row
    staged = (lambda r: log({**r, "stage": 2})) if log else None
    return train(
        model, replace(circuit, strict_sources=s.strict_sources), sharpening_config(s, pc), staged, s.high_counts
    )


def sharpening_config(s: Sharpening, pc: PlantConfig) -> PlantConfig:
    """The `PlantConfig` of a `Sharpening` stage after a first stage run with ``pc``."""
    return PlantConfig(
        seed=s.seed,
        steps=s.steps,
        lr=s.lr,
        batch_pairs=s.batch_pairs,
        warmup=s.warmup,
        different_weight=s.different_weight,
        invariance_weight=s.invariance_weight,
        threads=pc.threads,
    )


def decoder_optimizer(model, pc: PlantConfig) -> tuple[list, torch.optim.Optimizer]:
    """(the trained parameters, their AdamW): the vision tower frozen (a circuit is planted in the
    decoder), weight decay on matrices only."""
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.ndim >= 2], "weight_decay": pc.weight_decay},
        {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
    ]
    return trained, torch.optim.AdamW(groups, lr=pc.lr, betas=(0.9, 0.98))


def invariance(clean: torch.Tensor, resampled) -> torch.Tensor:
    """Σ over the resampled runs of KL(clean ‖ resampled) between answer distributions (batch means), the
    clean one held fixed: zero only where resampling outside C leaves the answer's distribution as it was.
    The strictness terms' cross-entropy asks only for the right answer, and leaves the borderline samples
    (a clean answer won by a small margin) free to flip under any resampling."""
    target = torch.log_softmax(clean.detach(), -1)
    return sum(
        torch.nn.functional.kl_div(torch.log_softmax(r, -1), target, log_target=True, reduction="batchmean")
        for r in resampled
    )


def loss_weight(pc: PlantConfig, name: str) -> float:
    """The weight of the loss term ``name`` beside the clean and interchange terms (each weighted 1)."""
    if name == "invariance":
        return pc.invariance_weight
    return pc.different_weight if name.endswith("different") else 1.0


def optimizer_step(opt, trained, pc: PlantConfig, step: int, clean, stricts: dict, swap, start: float, log):
    """One step on clean + Σ strictness (+ invariance) + interchange (gradients clipped to norm 1); every 25
    steps and at the last, the log row (returned, and given to ``log``), else None."""
    weighted = [v * loss_weight(pc, k) for k, v in stricts.items()]
    (pc.clean_weight * clean + sum(weighted) + swap).backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % 25 and step != pc.steps - 1:
        return None
    row = {
        "step": step,
        "clean": round(clean.item(), 4),
        **{k: round(v.item(), 4) for k, v in stricts.items()},
        "swap": round(swap.item(), 4),
        "elapsed_s": round(time.time() - start, 1),
    }
    if log:
        log(row)
    return row


@torch.no_grad()
def verify(model, circuit: PlantedCircuit, n_pairs: int = 128, batch_pairs: int = 32) -> dict:
    """The planted figures (module docstring) on ``n_pairs`` held-out pairs."""
    collate = Collator(ToyConfig())  # its own tokenizer and image processor
    planter = Planter(model.eval(), circuit, collate)
    gen = torch.Generator().manual_seed(EVAL_SEED)
    hits: dict[str, list] = {}

    def score(name: str, logits: torch.Tensor, target: torch.Tensor) -> None:
        hits.setdefault(name, []).append((logits.argmax(-1) == target).float())

    for start in range(0, n_pairs, batch_pairs):
        inputs, answers, partner = pair_batch(collate, pairs_at(EVAL_SEED, start, min(batch_pairs, n_pairs - start)))
        shuffled = other_sample(len(answers), gen)
        with image_features_once(model):
            rec = planter.record(inputs)[0]
            by_partner, by_random = swap_source(rec, partner), swap_source(rec, shuffled)
            _verify_batch(planter, circuit, inputs, answers, by_partner, by_random, score)
    out = {k: round(float(torch.cat(v).mean()), 4) for k, v in hits.items()}
    out["chance"] = round(1 / len(DEFAULT_COUNTS), 4)
    out["n_samples"] = 2 * n_pairs
    return out


def _verify_batch(planter, circuit, inputs, answers, by_partner, by_random, score) -> None:
    """Score one batch's clean, outside-resampled, circuit-resampled and node-resampled answers."""
    score("accuracy", planter.logits(inputs), answers)
    score("outside_resampled", planter.strict_logits(inputs, by_partner, training=False), answers)
    score("outside_resampled_random", planter.strict_logits(inputs, by_random, training=False), answers)
    score("circuit_resampled", planter.swapped_logits(inputs, by_random, circuit.nodes), answers)
    score("circuit_resampled_partner", planter.swapped_logits(inputs, by_partner, circuit.nodes), answers)
    for n in circuit.nodes:
        score(f"node_resampled/{n.label}", planter.swapped_logits(inputs, by_random, (n,)), answers)


def planted_checks(circuit: PlantedCircuit, figures: dict) -> dict[str, bool]:
    """Each of `PLANTED_CHECKS` passed or not on ``figures`` (from `verify`)."""
    acc = figures["accuracy"]
    checks = {
        "accuracy": acc >= PLANTED_CHECKS["accuracy_min"],
        "outside": acc - min(figures["outside_resampled"], figures["outside_resampled_random"])
        <= PLANTED_CHECKS["outside_drop_max"],
        "circuit": figures["circuit_resampled"] - figures["chance"] <= PLANTED_CHECKS["circuit_above_chance_max"],
    }
    if circuit.each_necessary:
        drops = [acc - v for k, v in figures.items() if k.startswith("node_resampled/")]
        checks["each_node"] = min(drops) >= PLANTED_CHECKS["node_drop_min"]
    return checks


def plant(out: Path, circuit: PlantedCircuit, pc: PlantConfig | None = None, progress=None) -> dict:
    """Train the organism named by ``circuit`` into ``out`` (float32 weights, tokenizer, processor, the
    training log and ``planted.json`` with the circuit, the recipe, `verify`'s figures on the saved
    weights and the checks); ``pc`` defaults to the recipe with the circuit's own steps. Returns
    planted.json's content."""
    out, progress = require_path(out, "out", example="'organisms/route'"), require_callback(progress)
    pc = PlantConfig(steps=circuit.steps) if pc is None else pc
    check_plant(circuit, pc)  # every argument before the folder is claimed
    # Only an empty folder, or this command's own earlier output of the same circuit and recipe, is written:
    # never another checkpoint (its shard index would point at deleted shards) or a finished run of others.
    claim_directory(out, "countlens toy plant", {"circuit": circuit.name, "recipe": asdict(pc)})
    with directory_lock(out, ".plant.lock", "plant", "plant into another directory"):
        return _plant(out, circuit, pc, progress)


def check_plant(circuit: PlantedCircuit | EdgeCircuit, pc: PlantConfig) -> None:
    """Refuse what `plant` (or `countlens.toy.edge_plant.plant_edges`) would refuse only once training
    began: a ``pc`` that is no `PlantConfig`, a circuit whose nodes do not fit the shipped organism, a
    second stage whose recipe is out of range."""
    if not isinstance(pc, PlantConfig):
        raise ConfigError(f"pc must be a PlantConfig (countlens.toy.plant), got {type(pc).__name__}")
    if not isinstance(circuit, (PlantedCircuit, EdgeCircuit)):
        raise ConfigError(
            "circuit must be a PlantedCircuit or an EdgeCircuit (countlens.toy.planted.CIRCUITS, EDGE_CIRCUITS), "
            f"got {type(circuit).__name__}"
        )
    check_fields(circuit)  # an edge circuit's own fields (its node circuit's are checked with its nodes)
    cfg = ToyConfig()
    nodes = circuit.node_circuit if isinstance(circuit, EdgeCircuit) else circuit
    check_circuit(nodes, cfg.text_layers, cfg.heads)  # the organism planting starts from
    check_sharpening(circuit.name, circuit.sharpen)  # an edge circuit's own (its node circuit has none)
    if circuit.sharpen is not None:
        sharpening_config(circuit.sharpen, pc)  # its PlantConfig checks the stage's ranges


def save_organism(model, out: Path, rows: list[dict]):
    """Save a trained organism into ``out`` (weights, the organism's tokenizer and processor, the training
    log) and return it loaded back from there, so that its checks measure what was written."""
    from transformers import Qwen2VLForConditionalGeneration

    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    build_image_processor(ToyConfig()).save_pretrained(out)
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Qwen2VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32)


def train_and_save(start: Path, out: Path, train, progress) -> tuple:
    """(the organism loaded from ``start``, trained by ``train(model, log)``, saved into ``out`` and loaded
    back (`save_organism`); the training's seconds). ``progress`` sees each log row."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(start, dtype=torch.float32)
    rows: list[dict] = []

    def log(row):
        rows.append(row)
        if progress:
            progress(row)

    began = time.time()
    train(model, log)
    seconds = round(time.time() - began, 1)
    return save_organism(model, out, rows), seconds


def _plant(out: Path, circuit: PlantedCircuit, pc: PlantConfig, progress) -> dict:
    """`plant`'s training and verification, by the process that holds ``out``'s lock."""
    saved, seconds = train_and_save(TOY_DIR, out, lambda model, log: train_stages(model, circuit, pc, log), progress)
    figures = verify(saved, circuit)
    fresh = fresh_strictness(saved, circuit)
    record = {
        "circuit": {**asdict(circuit), "heads": sorted(circuit.heads)},
        "recipe": pc.to_dict(),
        "train_seconds": seconds,
        "figures": figures,
        "checks": planted_checks(circuit, figures),
        "bars": PLANTED_CHECKS,
        "fresh": fresh,
        "fresh_checks": fresh_checks(fresh),
    }
    (out / "planted.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
