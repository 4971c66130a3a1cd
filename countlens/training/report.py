"""Before/after report of the circuit-guided fine-tune, in the papers' ablation layout.

Rows: baseline / +SFT / +SFT+focus / +SFT+focus+temperature / +SFT+focus+MAS. Columns: counting on
held-out task scenes (in distribution), COUNTINGTRICKS by group (position 1–4, dilation 5A–8A,
adjacency 9–15), and the organism's non-counting tasks (colour, shape: transfer or damage). Each
variant trains its own adapter under ``out/<variant>/`` (resumable, with a progress bar); the
temperature row reuses the +SFT+focus adapter with the circuit's most important heads sharpened
(β = α·γ). Finished rows are kept in ``out/accuracies.json``: a resumed run neither retrains nor
re-evaluates them (the baseline included).

Training data (`default_training_data`): COUNTINGTRICKS scenes of every case plus ordinary counting
scenes, from training seeds (≥ 1000) — never an evaluation scene.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import pandas as pd
import xarray as xr

from countlens.progress import Bar
from countlens.results import samples_digest, write_text
from countlens.training.finetune import FinetuneConfig, finetune, target_layers_from, with_adapter

VARIANTS: dict[str, dict] = {
    "+SFT": {"focus": 0.0, "mas": 0.0},
    "+SFT+focus": {"focus": 1.0, "mas": 0.0},
    "+SFT+focus+MAS": {"focus": 1.0, "mas": 0.1},
}


def default_training_data(grid, n: int = 2048, prompt: str = "short", seed: int = 1000) -> list:
    """Half COUNTINGTRICKS (all 32 cases), half counting task scenes; training seeds only."""
    from countlens.datasets.countingtricks import CASES, countingtricks
    from countlens.datasets.tasks import task_samples

    per_case = max(1, n // (2 * len(CASES)))
    tricks = countingtricks(None, per_case, grid, seed=seed, prompt=prompt, color=("red", "green", "blue"))
    if n <= len(tricks):  # small n: one scene per case already fills it
        return tricks
    return tricks + task_samples("count", n - len(tricks), seed, image_size=grid.image_height)


def evaluation_sets(grid, n: int = 200, prompt: str = "short", seed: int = 7) -> dict[str, list]:
    from countlens.datasets.countingtricks import CASES, countingtricks
    from countlens.datasets.tasks import task_samples

    size = grid.image_height
    tricks = countingtricks(None, max(1, n // 8), grid, seed=seed, prompt=prompt, color=("red", "green", "blue"))
    groups = {f: [s for s in tricks if CASES[s.meta["case"]].family == f] for f in ("position", "dilation", "adjacency")}
    return {"count (in-dist.)": task_samples("count", n, seed, image_size=size),
            **{f"tricks {f}": v for f, v in groups.items()},
            "color": task_samples("color", n // 2, seed, image_size=size),
            "shape": task_samples("shape", n // 2, seed, image_size=size)}


def _accuracies(vlm, sets: dict[str, list], batch_size: int, generated: frozenset = frozenset()) -> dict[str, float]:
    """Accuracy per set: scoring (`score`: single-token, or candidate scoring for multi-token answers),
    or greedy generation + answer parsing for the sets in ``generated`` (real benchmarks)."""
    from countlens.analysis.evaluate import generate, score

    return {name: float((generate(vlm, samples, batch_size=batch_size) if name in generated else
                         score(vlm, samples, batch_size=batch_size)).correct.mean()) for name, samples in sets.items()}


class _Rows:
    """Finished rows of the before/after table in a JSON file, valid only for the same settings."""

    def __init__(self, path: Path, spec: dict):
        self.path, self.spec = path, spec
        saved = json.loads(path.read_text()) if path.exists() else {}
        self.rows = saved.get("rows", {}) if saved.get("spec") == spec else {}

    def __contains__(self, name: str) -> bool:
        return name in self.rows

    def get(self, name: str, compute):
        if name not in self.rows:
            self.rows[name] = compute()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text(self.path, json.dumps({"spec": self.spec, "rows": self.rows}, indent=1))
        return self.rows[name]


def importance_from(circuit) -> xr.DataArray:
    """The circuit's per-head importance (layer, head) from its ``heads.csv``."""
    from countlens.training.finetune import read_heads

    return read_heads(circuit).set_index(["layer", "head"])["importance"].to_xarray()


def before_after(model: str, circuit: str | Path, out: str | Path, config: FinetuneConfig = FinetuneConfig(),
                 train=None, sets: dict[str, list] | None = None, alpha: float = 1.2, top_k: int = 3,
                 batch_size: int = 32, n_train: int = 2048, n_eval: int = 200, extra_sets: dict | None = None,
                 log=print) -> pd.DataFrame | None:
    """Train the variants and evaluate them; returns the table (rows: variants) and writes it.

    ``extra_sets``: more evaluation columns, e.g. ``{"FSC-147": load_fsc147(root, limit=200)}`` — a
    real benchmark kept locally, scored like the rest."""
    import countlens
    from countlens import distributed
    from countlens.circuits.temperature import beta_from_importance, head_temperature

    # Data parallel (accelerate launch / torchrun): every rank trains each variant with the others;
    # rank 0 alone evaluates and writes, and the other ranks return None.
    lead = distributed.current().rank == 0
    out = Path(out)
    base = countlens.load(model)
    prompt = "short" if base.name == "toy" else "std"
    layers = config.target_layers or target_layers_from(circuit)
    config = replace(config, target_layers=tuple(layers))
    train = default_training_data(base.geometry, n_train, prompt=prompt) if train is None else train
    sets = evaluation_sets(base.geometry, n_eval, prompt=prompt) if sets is None else sets
    sets = {**sets, **(extra_sets or {})}
    generated = frozenset(extra_sets or {})
    betas = beta_from_importance(importance_from(circuit), alpha=alpha, top_k=top_k)
    # Each row's accuracies are kept in out/accuracies.json, so a resumed run evaluates only what is new.
    done = _Rows(out / "accuracies.json", {"model": str(model), "sets": {k: len(v) for k, v in sets.items()},
                                            "digest": samples_digest([*train, *(x for v in sets.values() for x in v)]),
                                            "config": json.loads(json.dumps(asdict(config), default=str)),
                                            "n_train": len(train), "betas": {f"L{a}H{b}": v for (a, b), v in betas.items()}})
    if lead:
        log(f"baseline: {done.get('baseline', lambda: _accuracies(base, sets, batch_size, generated))}")
    for name, terms in VARIANTS.items():
        wanted = [name] + (["+SFT+focus+temperature"] if name == "+SFT+focus" else [])
        if all(w in done for w in wanted):  # the same on every rank: all read one file at the start
            if lead:
                log(f"{name}: done before")
            continue
        variant = replace(config, **terms)
        with Bar(f"training {name}", variant.steps) if lead else nullcontext() as bar:
            adapter = finetune(base, train, out / name.strip("+").replace("+", "_").lower(), variant,
                               progress=lambda row: bar.update(row["step"] + 1, f"loss {row['loss']:.3f}"))
        if not lead:
            continue
        tuned = with_adapter(model, adapter)
        log(f"{name}: {done.get(name, lambda: _accuracies(tuned, sets, batch_size, generated))}")
        if name == "+SFT+focus":
            def sharpened():
                with head_temperature(tuned, betas):
                    return _accuracies(tuned, sets, batch_size, generated)

            log(f"+SFT+focus+temperature: {done.get('+SFT+focus+temperature', sharpened)}")
    if not lead:
        return None
    rows = done.rows
    order = ["baseline", "+SFT", "+SFT+focus", "+SFT+focus+temperature", "+SFT+focus+MAS"]
    table = pd.DataFrame(rows).T.loc[order]
    table.attrs.update(target_layers=list(layers), betas={f"L{a}H{b}": v for (a, b), v in betas.items()},
                       n_train=len(train), n_eval={k: len(v) for k, v in sets.items()})
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "before_after.csv")
    (out / "before_after.md").write_text(_markdown(table, config))
    return table


def _markdown(table: pd.DataFrame, config: FinetuneConfig) -> str:
    a = table.attrs
    return (f"{(100 * table).round(1).to_markdown()}\n\nAccuracy in %. LoRA r={config.lora_r} on the language model's "
            f"attention projections, {config.steps} steps × batch {config.batch_size}, lr {config.lr}; target layers "
            f"{a['target_layers']}; λ_focus 1.0 (σ = {config.sigma} cell), λ_mas 0.1 (τ = {config.tau}); temperature "
            f"β = {a['betas']}; {a['n_train']} training scenes; evaluation sizes {a['n_eval']}.\n")

