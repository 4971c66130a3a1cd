"""Before/after report of the circuit-guided fine-tune, in the papers' ablation layout.

A `countlens.settings.Recipe` says what trains and what is measured: countlens's own
(`DEFAULT_RECIPE`), or a paper's (``preset="counting-circuits"``: Baseline / +SFT / +SFT+focus /
Full with β on SynDot + SynPoly scenes, SynReal and PixMo-Count columns; ``"counting-to-four"``:
SFT against SFT+MAS on FSC-147, Circles (Syn) / FSC-Val / FSC-Test columns). Rows, from
`VARIANTS`: baseline / +SFT / +SFT+focus / +SFT+focus+temperature / +SFT+focus+MAS / +SFT+MAS.
Columns: accuracy per evaluation set and, for counting sets, MAE. countlens's own columns are
counting on held-out task scenes (in distribution), COUNTINGTRICKS by group (position 1–4,
dilation 5A–8A, adjacency 9–15), and the organism's non-counting tasks (colour, shape: transfer or
damage); local benchmark copies (FSC-147, PixMo-Count) add theirs. Each variant trains its own
adapter under ``out/<variant>/`` (resumable, with a progress bar); the temperature row reuses the
+SFT+focus adapter with the circuit's heads sharpened (β = α·γ). Finished rows are kept in
``out/accuracies.json``: a resumed run neither retrains nor re-evaluates them (the baseline included).

Training data (`training_data`) comes from training seeds (≥ 1000) or a train split — never an
evaluation scene; it and the evaluation columns are `countlens.pipeline.finetune_sets`'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import xarray as xr

import countlens
from countlens import distributed
from countlens.analysis.heads import CLASSES, read_heads
from countlens.circuits.engine.temperature import beta_from_importance, head_temperature
from countlens.datasets.loaders import load_fsc147
from countlens.errors import ConfigError, RunDirError
from countlens.files import read_json, write_text
from countlens.labels import head_label
from countlens.model.arch import SOFTMAX_KINDS
from countlens.pipeline.config import default_prompt
from countlens.pipeline.finetune_sets import (
    EVALUATION,
    LOCAL_DEFAULT_SET,
    LOCAL_SETS,
    REASONING_COPIES,
    REASONING_SETS,
    check_training_source,
    evaluation_metrics,
    evaluation_names,
    evaluation_sets,
    load_reasoning,
    training_data,
)
from countlens.pipeline.presets import recipe as preset_recipe
from countlens.progress import Bar
from countlens.sweep_store import samples_digest
from countlens.training.finetune import (
    FinetuneConfig,
    check_trainable,
    check_variant,
    finetune,
    target_layers_from,
    with_adapter,
)

if TYPE_CHECKING:
    pass

VARIANTS: dict[str, dict] = {
    "+SFT": {"focus": 0.0, "mas": 0.0},
    "+SFT+focus": {"focus": 1.0, "mas": 0.0},
    "+SFT+focus+MAS": {"focus": 1.0, "mas": 0.1},
    "+SFT+MAS": {"focus": 0.0, "mas": 0.1},
}
#: The +SFT+focus adapter evaluated with the circuit's heads sharpened (β = α·γ): no training of its own.
TEMPERATURE_ROW = "+SFT+focus+temperature"


def check_recipe(
    recipe,
    local: dict | None = None,
    train=None,
    overrides: dict | None = None,
    n_train: int | None = None,
    n_eval: int | None = None,
) -> None:
    """Refuse a recipe no run can finish, naming the field, before any model loads: its fields, the
    local copies (a general-reasoning copy's first ``n_eval`` records) and, for a recipe that trains on
    FSC-147, its train split (every image there)."""
    _check_fields({**recipe.config, **(overrides or {})}, "Recipe.config / overrides")
    FinetuneConfig(**{**recipe.config, **(overrides or {})})  # every field's range (FinetuneConfig.__post_init__)
    bad_classes = [c for c in recipe.temperature_classes if c not in CLASSES]
    if bad_classes:
        raise ConfigError(f"Recipe.temperature_classes {bad_classes}: use some of {list(CLASSES)}")
    for key, path in (local or {}).items():
        if key not in LOCAL_DEFAULT_SET:
            raise ConfigError(
                f"local copy {key!r}: give some of {list(LOCAL_DEFAULT_SET)} (a root directory, a file or a folder)"
            )
        if not Path(path).exists():
            raise ConfigError(f"--{key} {path}: no such file or directory; give the path of a local copy")
        if key in REASONING_COPIES:  # every record read now, before a model loads or a file is written
            load_reasoning(key, path, limit=n_eval)
    if recipe.training == "fsc147" and train is None and any(VARIANTS.get(r, {}).get("focus") for r in recipe.rows):
        raise ConfigError(
            "the focus loss needs object centres of synthetic scenes; a recipe that trains on "
            "FSC-147 takes rows without focus (e.g. '+SFT', '+SFT+MAS')"
        )
    bad_rows = [r for r in recipe.rows if r not in VARIANTS and r != TEMPERATURE_ROW]
    if bad_rows:
        raise ConfigError(f"Recipe.rows {bad_rows}: use some of {[*VARIANTS, TEMPERATURE_ROW]}")
    if TEMPERATURE_ROW in recipe.rows and "+SFT+focus" not in recipe.rows:
        raise ConfigError(f"Recipe.rows: {TEMPERATURE_ROW!r} evaluates the +SFT+focus adapter; list '+SFT+focus' too")
    bad_sets = [x for x in recipe.evaluation if x not in EVALUATION]
    if bad_sets:
        raise ConfigError(f"Recipe.evaluation {bad_sets}: use some of {list(EVALUATION)}")
    if recipe.layers not in ("circuit", "all"):
        raise ConfigError(f"Recipe.layers={recipe.layers!r}: use 'circuit' or 'all'")
    if train is None:
        check_training_source(recipe, local)
        if recipe.training == "fsc147":
            load_fsc147(local["fsc147"], split="train", limit=recipe.n_train if n_train is None else n_train)


class _Rows:
    """Finished rows of the before/after table in a JSON file, valid only for the same settings."""

    def __init__(self, path: Path, spec: dict):
        self.path, self.spec = path, spec
        saved = read_json(path, f"delete {path} to evaluate every row again") if path.exists() else {}
        saved = saved if isinstance(saved, dict) else {}
        self.rows = saved.get("rows", {}) if saved.get("spec") == spec else {}

    def __contains__(self, name: str) -> bool:
        return name in self.rows

    def get(self, name: str, compute):
        if name not in self.rows:
            self.rows[name] = compute()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text(self.path, json.dumps({"spec": self.spec, "rows": self.rows}, indent=1))
        return self.rows[name]


def importance_from(circuit, classes: Sequence[str] = ()) -> xr.DataArray:
    """The circuit's per-head importance (layer, head) from its ``heads.csv``; with ``classes``, zero
    outside the heads of those classes (all heads when none has one of them). Heads of layers without
    softmax (a ``kind`` column saying "linear": Qwen3.5) have no temperature: NaN, no candidates."""
    table = read_heads(circuit)
    if "kind" in table:
        table = table.assign(importance=table["importance"].where(table["kind"].isin(SOFTMAX_KINDS)))
    chosen = table["class"].isin(classes)
    if len(classes) and chosen.any():
        table = table.assign(importance=table["importance"].where(chosen, 0.0))
    return table.set_index(["layer", "head"])["importance"].to_xarray()


def recipe_config(recipe, n_train: int, **given) -> FinetuneConfig:
    """The recipe's `FinetuneConfig` with the ``given`` fields over it; with the recipe's ``epochs``
    (and no ``steps`` given), steps = ceil(epochs · n_train / (batch_size · grad_accum))."""
    values = {**recipe.config, **given}
    _check_fields(values, "Recipe.config / overrides")
    if recipe.epochs is not None and "steps" not in given:
        per_step = values.get("batch_size", FinetuneConfig.batch_size) * values.get(
            "grad_accum", FinetuneConfig.grad_accum
        )
        values["steps"] = max(1, math.ceil(recipe.epochs * n_train / per_step))
    return FinetuneConfig(**values)


def _check_fields(values: dict, what: str) -> None:
    from dataclasses import fields

    known = {f.name for f in fields(FinetuneConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{what}: {unknown} are not FinetuneConfig fields; use some of {sorted(known)}")


def before_after(
    model: str,
    circuit: str | Path,
    out: str | Path,
    config: FinetuneConfig | None = None,
    overrides: dict | None = None,
    train=None,
    sets: dict[str, list] | None = None,
    alpha: float = 1.2,
    top_k: int = 3,
    batch_size: int = 32,
    n_train: int | None = None,
    n_eval: int = 200,
    extra_sets: dict | None = None,
    recipe=None,
    preset: str = "",
    local: dict | None = None,
    log=print,
) -> pd.DataFrame | None:
    """Train the recipe's variants and evaluate them; returns the table (rows: variants) and writes it.

    ``recipe``: a `countlens.settings.Recipe` (default: the ``preset``'s, else countlens's own). Without
    ``config``, the run's config is the recipe's with ``overrides`` (FinetuneConfig fields) over it.
    ``local``: local benchmark copies, ``{"fsc147": ROOT, "pixmo": FILE}``, for the recipe's columns
    and FSC-147 training data.
    ``extra_sets``: more evaluation columns, e.g. ``{"mine": samples}``, scored by generation."""
    # Data parallel (accelerate launch / torchrun): every rank trains each variant with the others;
    # rank 0 alone evaluates and writes, and the other ranks return None.
    lead = distributed.check_process_group().rank == 0
    out = Path(out)
    recipe = preset_recipe(preset) if recipe is None else recipe
    check_recipe(recipe, local, train, overrides, n_train, n_eval)  # before the model loads
    for state in [out / "accuracies.json", *out.glob("*/finetune.json")]:  # a resumed run's own files
        if state.exists():
            read_json(state, f"delete {state.parent if state.name == 'finetune.json' else state} to redo it")
    rows = ["baseline", *recipe.rows]
    betas = beta_from_importance(importance_from(circuit, recipe.temperature_classes), alpha=alpha, top_k=top_k)
    if TEMPERATURE_ROW in rows and not betas:  # it would repeat +SFT+focus under another name
        _no_betas(circuit, recipe, alpha)
    base = countlens.load(model)
    check_trainable(base)  # before the baseline evaluation and anything written
    prompt = default_prompt(base.name)
    say = log if lead else (lambda _: None)
    train = training_data(recipe, base.geometry, prompt, local, n_train) if train is None else train
    config = recipe_config(recipe, len(train), **(overrides or {})) if config is None else config
    layers = config.target_layers or (
        tuple(range(base.arch.n_layers)) if recipe.layers == "all" else target_layers_from(circuit)
    )
    config = replace(config, target_layers=tuple(layers))
    # Every variant's needs (softmax at each target layer for focus / MAS), before the baseline is
    # written: a variant late in the table must not be refused after the earlier ones have trained.
    variants = [replace(config, **VARIANTS[r]) for r in recipe.rows if r in VARIANTS]
    for variant in variants or [replace(config, focus=0.0, mas=0.0)]:
        check_variant(base, train, variant)
    sets = (
        evaluation_sets(
            base.geometry, n_eval, prompt=prompt, names=evaluation_names(recipe, local), local=local, log=say
        )
        if sets is None
        else sets
    )
    sets = {**sets, **(extra_sets or {})}
    generated = frozenset(name for name in sets if name in LOCAL_SETS) | frozenset(extra_sets or {})
    # Each row's metrics are kept in out/accuracies.json, so a resumed run evaluates only what is new.
    done = _Rows(
        out / "accuracies.json",
        {
            "model": str(model),
            "preset": preset,
            "rows": rows,
            "metrics": ["accuracy", "mae"],
            "sets": {k: len(v) for k, v in sets.items()},
            "digest": samples_digest([*train, *(x for v in sets.values() for x in v)]),
            "config": json.loads(json.dumps(asdict(config), default=str)),
            "n_train": len(train),
            "betas": {head_label(h): v for h, v in betas.items()},
        },
    )
    if lead:
        log(f"baseline: {done.get('baseline', lambda: evaluation_metrics(base, sets, batch_size, generated))}")
    for name in (r for r in recipe.rows if r in VARIANTS):
        wanted = [name] + ([TEMPERATURE_ROW] if name == "+SFT+focus" and TEMPERATURE_ROW in rows else [])
        if all(w in done for w in wanted):  # the same on every rank: all read one file at the start
            say(f"{name}: done before")
            continue
        variant = replace(config, **VARIANTS[name])
        with Bar(f"training {name}", variant.steps) if lead else nullcontext() as bar:
            adapter = finetune(
                base,
                train,
                out / name.strip("+").replace("+", "_").lower(),
                variant,
                progress=lambda row: bar.update(row["step"] + 1, f"loss {row['loss']:.3f}"),
            )
        if not lead:
            continue
        tuned = with_adapter(model, adapter)
        log(f"{name}: {done.get(name, lambda tuned=tuned: evaluation_metrics(tuned, sets, batch_size, generated))}")
        if TEMPERATURE_ROW in wanted:

            def sharpened(tuned=tuned):
                with head_temperature(tuned, betas):
                    return evaluation_metrics(tuned, sets, batch_size, generated)

            log(f"{TEMPERATURE_ROW}: {done.get(TEMPERATURE_ROW, sharpened)}")
    if not lead:
        return None
    table = pd.DataFrame(done.rows).T.loc[rows]
    table.attrs.update(
        target_layers=list(layers),
        betas={head_label(h): v for h, v in betas.items()},
        n_train=len(train),
        n_eval={k: len(v) for k, v in sets.items()},
        n_options={
            k: sum(bool(getattr(x, "choices", None)) for x in v) for k, v in sets.items() if k in REASONING_SETS
        },
        preset=preset,
        alpha=alpha,
    )
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "before_after.csv")
    (out / "before_after.md").write_text(_markdown(table, config, recipe))
    return table


def _no_betas(circuit, recipe, alpha: float) -> None:
    """Refuse a temperature row that would sharpen no head, saying why: it would be the +SFT+focus row
    again, reported as a result."""
    if alpha < 1:
        raise ConfigError(f"alpha {alpha} < 1: head temperature sharpens (β ≥ 1) and β = α·γ ≤ α; give alpha ≥ 1")
    chosen = f"the heads of classes {list(recipe.temperature_classes)}" if recipe.temperature_classes else "every head"
    raise RunDirError(
        f"{circuit}/heads.csv gives {chosen} importance 0, so the {TEMPERATURE_ROW!r} row would sharpen no head; "
        f"rerun `countlens discover --out {circuit}` (its head patching), or fine-tune with rows without it"
    )


def _markdown(table: pd.DataFrame, config: FinetuneConfig, recipe) -> str:
    a = table.attrs
    shown = pd.DataFrame(
        {
            c: (table[c].astype(float).round(2) if c.endswith(" MAE") else (100 * table[c].astype(float)).round(1))
            for c in table.columns
        },
        index=table.index,
    )
    terms = {row: VARIANTS.get(row, VARIANTS["+SFT+focus"]) for row in table.index if row != "baseline"}
    lambdas = "; ".join(f"{row}: λ_focus {t['focus']}, λ_mas {t['mas']}" for row, t in terms.items())
    source = f"preset `{a['preset']}`" if a["preset"] else "countlens's own recipe (no preset)"
    temperature = (
        f" Temperature row: β = α·γ_h, α = {a['alpha']}, on {a['betas']}." if TEMPERATURE_ROW in table.index else ""
    )
    # A cell with no value (no option scored, no count parsed) shows "—", not "nan".
    cells = (shown.astype(object).where(shown.notna(), None) if shown.isna().any().any() else shown).to_markdown(
        missingval="—"
    )
    reasoning = [c for c in REASONING_SETS if c in table.columns]
    read = (
        f" {', '.join(reasoning)}: accuracy of greedy answers read by each benchmark's rule (MMMU's own; "
        "MathVista's normalisation after countlens's extraction, where MathVista's uses GPT-4; countlens's own "
        'for RealWorldQA: `countlens.analysis.benchmark_answers`); "options": the most probable option, '
        f'teacher-forced, over the multiple-choice questions ({a["n_options"]}); "unparsed": the share of '
        "answers the rule could not read."
        + (
            " An options cell \"—\": the model's vocabulary cannot write every option (the organism's has no "
            "letters), so they are not scored."
            if table[[f"{c} options" for c in reasoning]].isna().any().any()
            else ""
        )
        + (f" {recipe.quoted}" if recipe.quoted else "")
        if reasoning
        else ""
    )
    trained = (
        f"LoRA r={config.lora_r} (α {config.lora_alpha}) on the language model's attention projections, "
        if config.method == "lora"
        else "every language-model weight trained (vision tower and projector frozen), "
    )
    return (
        f"{cells}\n\nAccuracy in %, MAE in counts (parsed answers of counting sets).{read} {source}: "
        f"{trained}{config.steps} steps × batch {config.batch_size}, lr {config.lr}, warm-up {config.warmup:.0%}; "
        f"target layers {a['target_layers']}; {lambdas} (σ = {config.sigma} cell, τ = {config.tau}).{temperature} "
        f"{a['n_train']} training scenes ({recipe.training}); evaluation sizes {a['n_eval']}.\n"
    )
