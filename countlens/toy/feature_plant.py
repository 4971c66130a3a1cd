"""A planted *feature*: an organism whose MLP computes a feature named in advance, "count ≥ 5".

The head organisms (`countlens.toy.planted`) know which heads move the count; nothing there says what a
transcoder feature should find. Here one hidden unit of one MLP is trained to compute a known feature, so a
dictionary's features and an attribution graph can be scored against it (`bench/planted_feature.py`).

**High-level model** (a causal abstraction, Geiger et al. 2021): count c → h = [c ≥ 5] → answer
(c mod 5) + 5·h. Counts 1–9 give the answer c itself; with h set from another scene the answer moves by
±5 (3 with h = 1 answers 8; 7 with h = 0 answers 2; 5 with h = 0 answers 0).

**The planted unit** (`PlantedFeature`) is hidden unit ``unit`` of decoder layer ``layer``'s MLP — its
act_fn(gate)·up value, the down projection's input — at the last token. It is trained to be ``target`` where
c ≥ 5 and 0 where c < 5, and pushed towards 0 at every other position — towards, not to: its largest
magnitude there averages 1.23 per sample in the shipped organism, about 31 % of the target 4
(``unit_elsewhere_max_abs_mean`` of `fresh_feature`, in its planted.json). The feature is "count ≥ 5 at the
last token". Its value, times the down projection's column ``unit``, is what the MLP writes for h.

**Training** (`train_feature`) starts from the shipped organism, with everything below layer ``layer``'s
MLP frozen (the vision tower, the lower layers and layer ``layer``'s attention: the count already reaches the
last token there), and minimises per step, on the planted organisms' clean/corrupt "shapes" pairs
(`countlens.toy.planter.pairs_at`, training seeds):
- *clean*: the answer's cross-entropy on the plain run;
- *interchange*: the unit's last-token value taken from a donor on the other side of 5 (another scene of
  the batch, drawn at random; its value detached), against (c mod 5) + 5·h_donor — so the answer reads h
  from the unit and from nothing else;
- *separation*: the unit's last-token value held to ``target``·h (squared error over ``target``²), and its
  value elsewhere held to 0 (the same, weighted ``elsewhere_weight``).

**Checks** (`fresh_feature`, on fresh pairs drawn by `countlens.toy.strictness.FRESH_SEED`, never
trained on): clean accuracy; the unit's AUROC and point-biserial correlation with h at the last token;
the interchange accuracy (the answer follows the donor's h); and the accuracy with the unit zeroed at every
position but the last. `FEATURE_CHECKS` are the bars (countlens's choice, set from what was measured:
`docs/concepts/attribution_graphs.md`, "Ground truth for features"). The construction is countlens's own;
no paper's planted feature models are comparable.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from countlens.circuits.engine.hooks import Hook, hooked
from countlens.datasets.tasks import TRAIN_SEED_BASE
from countlens.errors import ConfigError, InputError
from countlens.files import claim_directory, directory_lock
from countlens.intervals import wilson
from countlens.model.arch import resolve
from countlens.model.shipped import TOY_DIR
from countlens.toy.catalogue import FEATURES, PlantedFeature
from countlens.toy.plant import check_run, train_and_save
from countlens.toy.planter import pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.resample import image_features_once
from countlens.toy.strictness import FRESH_SEED
from countlens.toy.train import Collator, lr_at
from countlens.validate import (
    require_callback,
    require_count,
    require_path,
    require_seed,
)

#: The bars a shipped feature organism passes on fresh data (countlens's choice; module docstring).
FEATURE_CHECKS = {
    "n_samples_min": 1024,
    "accuracy_min": 0.90,
    "auroc_min": 0.99,
    "point_biserial_min": 0.90,
    "interchange_min": 0.90,
    "elsewhere_drop_max": 0.02,
}


@dataclass(frozen=True)
class FeatureConfig:
    """Hyper-parameters of one planting run of a `PlantedFeature`."""

    seed: int = 0
    steps: int = 1500
    batch_pairs: int = 16
    lr: float = 1e-3
    warmup: int = 20
    separation_weight: float = 1.0
    elsewhere_weight: float = 0.5
    weight_decay: float = 0.01
    threads: int = 1

    def __post_init__(self) -> None:
        check_run(self, ("separation_weight", "elsewhere_weight", "weight_decay"))


def check_feature(feature: PlantedFeature, cfg: ToyConfig | None = None) -> None:
    """Raise if ``feature`` is no `PlantedFeature`, or its layer, unit or threshold do not fit the organism."""
    if not isinstance(feature, PlantedFeature):
        raise InputError(
            f"feature must be a PlantedFeature (countlens.toy.catalogue.FEATURES), got {type(feature).__name__}"
        )
    cfg = cfg or ToyConfig()
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (feature.layer, feature.unit, feature.threshold))
    if not ok or not (0 <= feature.layer < cfg.text_layers and 0 <= feature.unit < cfg.intermediate):
        raise InputError(
            f"planted feature {feature.name!r}: layer {feature.layer!r} and unit {feature.unit!r} must be integers "
            f"within the organism's {cfg.text_layers} layers and {cfg.intermediate} MLP units; e.g. layer=2, unit=0"
        )
    if not (ok and 5 <= feature.threshold <= 9):
        raise InputError(
            f"planted feature {feature.name!r}: threshold {feature.threshold!r} must be an integer in 5–9, e.g. 5 "
            "(counts run 1–9, and (c mod t) + t·h gives back c only where c < 2t)"
        )
    target = feature.target
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not (0 < target < math.inf):
        raise InputError(
            f"planted feature {feature.name!r}: target {target!r} must be a positive finite number, e.g. 4.0"
        )


def check_recipe(fc) -> None:
    """Raise if ``fc`` is no `FeatureConfig` (its own fields are checked when it is made)."""
    if not isinstance(fc, FeatureConfig):
        raise ConfigError(
            f"fc must be a FeatureConfig (countlens.toy.feature_plant), e.g. FeatureConfig(steps=300); "
            f"got {type(fc).__name__}"
        )


def down_proj(model, layer: int) -> str:
    """The module name of layer ``layer``'s MLP down projection (its input: the hidden units)."""
    return f"{resolve(model.config).mlp(layer)}.down_proj"


@contextmanager
def unit_read(model, feature: PlantedFeature, values: torch.Tensor | None = None):
    """Inside, each forward records the unit's value at every position into the list yielded ((B, T) tensors,
    with their gradient); with ``values`` ((B,)), the last position's value is replaced by them first, and
    with ``values`` (B, T) and a ``nan`` where kept, every non-nan entry is."""
    seen: list[torch.Tensor] = []

    def hook(x: torch.Tensor):
        if values is not None:
            x = x.clone()
            if values.ndim == 1:
                x[:, -1, feature.unit] = values
            else:
                keep = torch.isnan(values)
                x[..., feature.unit] = torch.where(keep, x[..., feature.unit], torch.nan_to_num(values))
        seen.append(x[..., feature.unit])
        return x

    with hooked(model, [Hook(down_proj(model, feature.layer), "input", hook)]):
        yield seen


def trained_parameters(model, feature: PlantedFeature) -> list:
    """Freeze everything below layer ``feature.layer``'s MLP; return what trains (that MLP, the layers above,
    the final norm and the unembedding)."""
    for p in model.parameters():
        p.requires_grad_(False)
    lm = model.model.language_model
    modules = [lm.layers[feature.layer].mlp, *lm.layers[feature.layer + 1 :], lm.norm, model.lm_head]
    trained = [p for m in modules for p in m.parameters()]
    for p in trained:
        p.requires_grad_(True)
    return trained


def count_ids(collate: Collator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token id of each count 0–9, count of each token id or -1): answers as counts and back."""
    ids = torch.tensor(collate.tok.convert_tokens_to_ids([str(i) for i in range(10)]))
    counts = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
    counts[ids] = torch.arange(10)
    return ids, counts


def opposite_donor(h: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sample i's donor: a random sample of the batch on the other side of the threshold (i itself where
    the batch holds none)."""
    allowed = h[:, None] != h[None, :]
    weights = allowed.float() + 1e-12 * (~allowed).float()
    order = torch.multinomial(weights, 1, generator=gen).squeeze(1)
    return torch.where(allowed.any(1), order, torch.arange(len(h)))


def feature_losses(model, feature: PlantedFeature, inputs, answers, ids, counts, gen) -> dict:
    """One step's losses by name (module docstring): clean, interchange, separation, elsewhere."""
    ce = torch.nn.functional.cross_entropy
    c = counts[answers]
    h = feature.h(c)
    with unit_read(model, feature) as seen:
        logits = model(**inputs, logits_to_keep=1).logits[:, -1]
    unit = seen[0]
    donor = opposite_donor(h, gen)
    with unit_read(model, feature, unit[:, -1].detach()[donor]):
        swapped = model(**inputs, logits_to_keep=1).logits[:, -1]
    t = feature.target
    return {
        "clean": ce(logits, answers),
        "swap": ce(swapped, ids[feature.answer(c, h[donor])]),
        "separation": ((unit[:, -1] - t * h) ** 2).mean() / t**2,
        "elsewhere": (unit[:, :-1] ** 2).mean() / t**2,
    }


def train_feature(model, feature: PlantedFeature, fc: FeatureConfig, log=None) -> dict:
    """Train ``model`` (in place) so that ``feature`` is planted; returns the last log row."""
    check_feature(feature)
    check_recipe(fc)
    torch.manual_seed(fc.seed)
    torch.set_num_threads(fc.threads)
    collate = Collator(ToyConfig())
    ids, counts = count_ids(collate)
    model.train()
    trained = trained_parameters(model, feature)
    groups = [
        {"params": [p for p in trained if p.ndim >= 2], "weight_decay": fc.weight_decay},
        {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=fc.lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(fc.seed)
    weights = {"clean": 1.0, "swap": 1.0, "separation": fc.separation_weight, "elsewhere": fc.elsewhere_weight}
    start, row = time.time(), {}
    for step in range(fc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, fc)
        inputs, answers, _ = pair_batch(
            collate, pairs_at(TRAIN_SEED_BASE + fc.seed, step * fc.batch_pairs, fc.batch_pairs)
        )
        with image_features_once(model):
            losses = feature_losses(model, feature, inputs, answers, ids, counts, gen)
        sum(weights[k] * v for k, v in losses.items()).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == fc.steps - 1:
            row = {"step": step, **{k: round(v.item(), 4) for k, v in losses.items()}}
            row["elapsed_s"] = round(time.time() - start, 1)
            if log:
                log(row)
    model.eval()
    return row


def auroc_of(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The probability that a positive's score exceeds a negative's (ties count one half)."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if not len(pos) or not len(neg):
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's correlation of two vectors (point-biserial where one is 0/1); nan where one is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum()) / denom if denom else float("nan")


@torch.no_grad()
def fresh_feature(
    model, feature: PlantedFeature, n_samples: int = 1024, seed: int = FRESH_SEED, batch_pairs: int = 64
) -> dict:
    """The fresh-data figures of ``feature`` planted in ``model`` (a HF Qwen2-VL organism, float32; module
    docstring): accuracy, the unit against h, interchange, the unit zeroed elsewhere."""
    check_feature(feature)
    require_count(n_samples, "n_samples", InputError)
    require_count(batch_pairs, "batch_pairs", InputError)
    require_seed(seed, "seed", InputError)
    if n_samples % 2:
        raise InputError(f"n_samples={n_samples}: give an even number (each pair gives a clean and a corrupt sample)")
    model.eval()
    collate = Collator(ToyConfig())
    ids, counts = count_ids(collate)
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {}
    n_pairs = n_samples // 2
    for start in range(0, n_pairs, batch_pairs):
        inputs, answers, _ = pair_batch(collate, pairs_at(seed, start, min(batch_pairs, n_pairs - start)))
        c = counts[answers]
        h = feature.h(c)
        with image_features_once(model):
            with unit_read(model, feature) as seen:
                clean = model(**inputs, logits_to_keep=1).logits[:, -1].argmax(-1)
            unit = seen[0]
            donor = opposite_donor(h, gen)
            with unit_read(model, feature, unit[:, -1][donor]):
                swapped = model(**inputs, logits_to_keep=1).logits[:, -1].argmax(-1)
            zeros = torch.zeros_like(unit)
            zeros[:, -1] = torch.nan  # the last position kept
            with unit_read(model, feature, zeros):
                elsewhere = model(**inputs, logits_to_keep=1).logits[:, -1].argmax(-1)
        for key, value in {
            "clean": clean == answers,
            "follows": swapped == ids[feature.answer(c, h[donor])],
            "elsewhere": elsewhere == answers,
            "unit": unit[:, -1],
            "unit_elsewhere": unit[:, :-1].abs().amax(1),
            "h": h,
        }.items():
            rows.setdefault(key, []).append(value)
    r = {k: torch.cat(v) for k, v in rows.items()}
    n, acc = len(r["clean"]), int(r["clean"].sum())
    pos, neg = r["unit"][r["h"] > 0.5], r["unit"][r["h"] <= 0.5]
    return {
        "seed": seed,
        "n_samples": n,
        "accuracy": round(acc / n, 4),
        "accuracy_ci95": [round(x, 4) for x in wilson(acc, n)],
        "unit_auroc": round(auroc_of(r["unit"], r["h"]), 4),
        "unit_point_biserial": round(correlation(r["unit"], r["h"]), 4),
        "unit_mean_h1": round(float(pos.mean()), 4),
        "unit_mean_h0": round(float(neg.mean()), 4),
        "unit_elsewhere_max_abs_mean": round(float(r["unit_elsewhere"].mean()), 4),
        "interchange_follows_donor": round(float(r["follows"].float().mean()), 4),
        "elsewhere_zeroed_accuracy": round(float(r["elsewhere"].float().mean()), 4),
        "elsewhere_drop": round((acc - int(r["elsewhere"].sum())) / n, 4),
    }


def feature_checks(figures: dict) -> dict[str, bool]:
    """Each of `FEATURE_CHECKS` passed or not on ``figures`` (from `fresh_feature`)."""
    bars = FEATURE_CHECKS
    return {
        "n_samples": figures["n_samples"] >= bars["n_samples_min"],
        "accuracy": figures["accuracy"] >= bars["accuracy_min"],
        "auroc": figures["unit_auroc"] >= bars["auroc_min"],
        "point_biserial": figures["unit_point_biserial"] >= bars["point_biserial_min"],
        "interchange": figures["interchange_follows_donor"] >= bars["interchange_min"],
        "elsewhere": figures["elsewhere_drop"] <= bars["elsewhere_drop_max"],
    }


def plant_feature(out, feature: PlantedFeature | None = None, fc: FeatureConfig | None = None, progress=None) -> dict:
    """Train ``feature`` into the shipped organism's weights, save the organism into ``out`` with
    ``planted.json`` (the feature, the recipe, the fresh figures and checks). Returns planted.json's content."""
    out, progress = require_path(out, "out", example="'organisms/count-ge-5'"), require_callback(progress)
    feature = FEATURES["count-ge-5"] if feature is None else feature
    fc = FeatureConfig() if fc is None else fc
    check_feature(feature)
    check_recipe(fc)
    claim_directory(out, "countlens toy plant-feature", {"feature": asdict(feature), "recipe": asdict(fc)})
    with directory_lock(out, ".plant.lock", "plant", "plant into another directory"):
        train = lambda model, log: train_feature(model, feature, fc, log)  # noqa: E731
        saved, seconds = train_and_save(TOY_DIR, out, train, progress)
        fresh = fresh_feature(saved, feature)
        record = {
            "feature": asdict(feature),
            "start": "toy",
            "recipe": asdict(fc),
            "train_seconds": seconds,
            "bars": FEATURE_CHECKS,
            "fresh": fresh,
            "fresh_checks": feature_checks(fresh),
        }
        (out / "planted.json").write_text(json.dumps(record, indent=2) + "\n")
        return record
