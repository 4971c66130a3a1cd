"""The main job: from a model to a counting-circuit report, one resumable stage at a time.

Stages (each writes ``results/<stage>.nc`` and is skipped when that file exists, so a killed run
resumes where it stopped; the long sweeps also stream their chunks to ``results/sweeps/``):

1. ``cases`` — COUNTINGTRICKS accuracy, 32 cases, and number avoidance; ``conflict_std`` /
   ``conflict`` — Digit-in-Conflict on the position cases;
2. ``vap`` — visual activation patching by layer over image / last / text tokens;
3. ``heads`` and ``atp`` — head patching of z and attribution patching, and how well AtP ranks heads;
4. ``lens`` — logit lens of the gold answer at the last prompt token;
5. ``headlens`` — HeadLens maps, decoded tokens, VGS / CTER; ``attention`` — image-attention share;
   ``attention_metrics`` — MAS, VRA, Attention-IoU, ARS per layer on COUNTINGTRICKS scenes;
6. ``ablation`` — mean ablation of every head on the counting, colour and shape tasks; Jaccard;
7. ``temperature`` — counting accuracy with the most important heads sharpened (β = α·γ);
then the head table (``heads.csv`` / ``.md`` / ``.tex``), plots and ``report.md``.

Launched as several processes (``torchrun --nproc_per_node N -m countlens.cli discover …`` or
``accelerate launch``; `countlens.distributed`), every rank first takes its share of the three
sweeps (``vap``, ``heads``, ``ablation``), meeting in ``results/sweeps/``; then rank 0 alone runs
the other stages and writes the report, the same as one process would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from countlens.analysis.heads import HeadThresholds, classify_heads, constancy
from countlens.errors import InputError, require_count

FINETUNE_SECTION = "## 9. Circuit-guided fine-tune"
STAGES: tuple[str, ...] = ("cases", "conflict_std", "conflict", "vap", "heads", "atp", "lens", "headlens", "attention",
                           "attention_metrics", "ablation", "temperature")


#: DiscoverConfig fields added after runs were made: a run without them resumes under their defaults.
ADDED_FIELDS: tuple[str, ...] = ("jaccard_k", "preset")


@dataclass(frozen=True)
class DiscoverConfig:
    n_per_case: int = 100  # COUNTINGTRICKS samples per case
    n_pairs: int = 128  # clean/corrupt pairs for patching
    n_samples: int = 128  # task samples for lens, HeadLens, attention, ablation (per task)
    seed: int = 0
    prompt: str = "auto"  # "auto": the organism's short form for "toy", else Pstd
    pair_kind: str = "shapes"
    alpha: float = 1.2  # head temperature: β_h = α·γ_h
    top_k: int = 5  # heads sharpened; AtP's top-k overlap with exact patching
    batch_size: int = 16
    jaccard_k: int = 5  # top heads per task compared across tasks (Jaccard)
    preset: str = ""  # a `countlens.presets` name whose values these are ("": none)


def check_config(c: DiscoverConfig) -> None:
    """Refuse settings no stage can run with, naming the setting."""
    from countlens.datasets.pairs import check_kind
    from countlens.datasets.prompts import PAIR_PROMPTS

    for name in ("n_per_case", "n_pairs", "n_samples", "batch_size", "top_k", "jaccard_k"):
        require_count(getattr(c, name), name)
    if c.preset:
        from countlens.presets import get

        get(c.preset)  # raises for an unknown name
    if c.prompt != "auto" and c.prompt not in PAIR_PROMPTS:
        raise InputError(f"prompt {c.prompt!r}: use 'auto' or one of {PAIR_PROMPTS}")
    try:
        check_kind(c.pair_kind)
    except InputError as err:
        raise InputError(f"pair_kind: {err}") from None
    if not c.alpha > 0:
        raise InputError(f"alpha (head temperature) must be > 0, got {c.alpha}")


def read_spec(run: str | Path) -> dict:
    """A run's ``spec.json``, checked for what reports read (model, arch)."""
    path = Path(run) / "spec.json"
    if not path.exists():
        raise InputError(f"{run} is not a countlens discover run (no spec.json); run `countlens discover --out {run}`")
    try:
        spec = json.loads(path.read_text())
    except ValueError as err:
        raise InputError(f"{path} is not JSON ({err}); rerun `countlens discover --out {run}`") from None
    missing = [k for k in ("model", "arch") if not isinstance(spec, dict) or k not in spec]
    if missing:
        raise InputError(f"{path} lacks {missing}: not written by `countlens discover`; rerun it with --out {run}")
    return spec


class Stages:
    """Runs named stages once: a finished stage's result is loaded from disk instead of recomputed."""

    def __init__(self, out: Path, spec: dict, log: Callable[[str], None] = print):
        self.out, self.log = out, log
        self.dir = out / "results"
        self.dir.mkdir(parents=True, exist_ok=True)
        spec_file = out / "spec.json"
        if spec_file.exists():
            old = json.loads(spec_file.read_text())
            # Fields added since a run was made, at their defaults, change none of its stages.
            defaults = asdict(DiscoverConfig())
            old = {**{k: defaults[k] for k in ADDED_FIELDS if k not in old and spec.get(k) == defaults[k]}, **old}
            if old != spec:
                raise InputError(f"{out} holds a run with a different spec ({old}); use a new --out directory "
                                 f"or the same settings ({spec})")
        else:
            from countlens.results import write_text

            write_text(spec_file, json.dumps(spec, indent=1, sort_keys=True))  # atomic: ranks may race

    def run(self, name: str, compute: Callable[[], xr.Dataset | xr.DataArray], save: bool = True):
        """The stage's stored result, else ``compute()`` (stored unless ``save=False``: the ranks
        of a sharded run other than 0 compute their share and leave the writing to rank 0)."""
        from countlens import results

        path = self.dir / f"{name}.nc"
        if path.exists():
            self.log(f"[{name}] done before: {path}")
            return results.load(path)
        self.log(f"[{name}] running")
        value = compute()
        if save:
            results.save(value, path)
        return value


def discover(vlm, out: str | Path, config: DiscoverConfig = DiscoverConfig(),
             log: Callable[[str], None] = print) -> Path:
    """Run every stage on ``vlm`` into ``out``; returns the path of ``report.md``."""
    from countlens import circuits, distributed
    from countlens.analysis.evaluate import score
    from countlens.analysis.heads import export_heads
    from countlens.analysis.attention_metrics import attention_metrics

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out} is a file; give a directory")
    c = config
    check_config(c)  # before anything is written: a refused run leaves no spec behind
    prompt = resolved_prompt(vlm, c)
    # The resolved prompt, not "auto": reports re-rendered from spec.json name what ran.
    from countlens.datasets.prompts import PROMPTS

    # The template too: a run made when a style's text or answer form differed is another spec.
    spec = {**asdict(c), "model": vlm.name, "arch": vlm.arch.name, "prompt": prompt,
            "prompt_template": PROMPTS[prompt].template, "answer_form": PROMPTS[prompt].answer}
    stages = Stages(out, spec, log)
    bs = c.batch_size

    inputs = stage_inputs(vlm, c, prompt)
    pairs, data = inputs["pairs"](), inputs["tasks"]()
    sweeps = out / "results" / "sweeps"
    shard = distributed.current()
    sweep_stages = {
        "vap": lambda: circuits.patch_layers(vlm, pairs, groups=("image", "last", "text"), batch_size=bs,
                                             store=sweeps / "vap", progress=True, shard=shard),
        "heads": lambda: circuits.patch_heads(vlm, pairs, batch_size=bs, store=sweeps / "heads", progress=True,
                                              shard=shard),
        "ablation": lambda: circuits.ablation_scan(vlm, data, batch_size=bs, store=sweeps / "ablation",
                                                   progress=True, shard=shard),
    }
    if shard.sharded:
        # Every rank takes its share of the sweeps first; then rank 0 alone runs the other stages
        # (the sweeps' results now stored) and writes the report.
        for name, sweep in sweep_stages.items():
            stages.run(name, sweep, save=shard.rank == 0)
        if shard.rank != 0:
            log(f"rank {shard.rank} of {shard.world}: its share of the sweeps is done; rank 0 writes the report")
            return out / "report.md"
    # 1. COUNTINGTRICKS
    stages.run("cases", lambda: score(vlm, inputs["cases"](), batch_size=bs, progress=True))
    # Digit-in-Conflict: the same position-case images under Pstd and with a distractor digit.
    for stage in ("conflict_std", "conflict"):
        stages.run(stage, lambda stage=stage: score(vlm, inputs[stage](), batch_size=bs))
    # 2–3. patching
    stages.run("vap", sweep_stages["vap"])
    heads = stages.run("heads", sweep_stages["heads"])
    stages.run("atp", lambda: circuits.attribution_patch(vlm, pairs, batch_size=bs))
    # 4–5. lenses and attention
    stages.run("lens", lambda: circuits.logit_lens(vlm, data["count"], batch_size=bs))

    def headlens() -> xr.Dataset:
        return circuits.HeadLens.fit(vlm, inputs["headlens_fit"](), batch_size=bs).decode(vlm, data["count"], batch_size=bs)

    hl = stages.run("headlens", headlens)
    att = stages.run("attention", lambda: circuits.image_attention_share(vlm, data["count"], batch_size=bs)
                     .to_dataset(name="image_attention"))
    stages.run("attention_metrics", lambda: attention_metrics(vlm, inputs["attention_metrics"](), batch_size=bs))
    # 6. ablation across tasks
    abl = stages.run("ablation", sweep_stages["ablation"])
    # 7. temperature from head-patching importance (the head table's `importance`)
    betas = circuits.beta_from_importance(heads.effect, alpha=c.alpha, top_k=c.top_k)

    def temperature() -> xr.Dataset:
        held = inputs["temperature"]()
        base = score(vlm, held, batch_size=bs)
        with circuits.head_temperature(vlm, betas):
            sharp = score(vlm, held, batch_size=bs)
        return xr.Dataset({"base": base.correct, "sharpened": sharp.correct},
                          attrs={"betas": json.dumps({f"L{la}H{h}": b for (la, h), b in betas.items()})})

    stages.run("temperature", temperature)
    from countlens.presets import thresholds

    table = head_table(heads, abl, hl, att, thresholds(c.preset))
    export_heads(table, out)
    return write_report(vlm.name, vlm.arch.name, out, table=table, prompt=prompt)


def resolved_prompt(vlm, c: DiscoverConfig) -> str:
    """The prompt style a run uses: ``c.prompt``, or for "auto" the organism's short form on the
    organism (its vocabulary cannot write Pstd's answers) and Pstd elsewhere."""
    return ("short" if vlm.name == "toy" else "std") if c.prompt == "auto" else c.prompt


def stage_inputs(vlm, c: DiscoverConfig, prompt: str) -> dict[str, Callable[[], list]]:
    """Each stage's samples, made on demand (every one a pure function of the seed): ``pairs`` for
    patching, ``tasks`` ({task: samples}) for the lens, attention and ablation, and the samples of
    ``cases``, ``conflict_std`` / ``conflict``, ``headlens_fit``, ``attention_metrics`` and
    ``temperature``. `countlens.plan` sizes the stages from the same lists."""
    from countlens.datasets.countingtricks import CASES, countingtricks
    from countlens.datasets.pairs import count_pairs
    from countlens.datasets.tasks import task_samples

    grid = vlm.geometry
    size = grid.image_height
    colors = ("red", "green", "blue")

    def tasks(seed_offset: int = 0) -> dict:
        return {t: task_samples(t, c.n_samples, c.seed + seed_offset, image_size=size) for t in ("count", "color", "shape")}

    position = [n for n, case in CASES.items() if case.family == "position"]
    base, distractor = conflict_styles(vlm.name)
    conflict = lambda style: countingtricks(position, max(1, c.n_per_case // 5), grid,  # noqa: E731
                                            seed=c.seed, prompt=style, color=colors)
    return {
        "pairs": lambda: count_pairs(c.n_pairs, kind=c.pair_kind, grid=grid, seed=c.seed, prompt=prompt,
                                     counts=range(1, 10)),
        "tasks": tasks,
        "cases": lambda: countingtricks(None, c.n_per_case, grid, seed=c.seed, prompt=prompt, color=colors),
        "conflict_std": lambda: conflict(base),
        "conflict": lambda: conflict(distractor),
        "headlens_fit": lambda: [s for samples in tasks(seed_offset=500).values() for s in samples],
        "attention_metrics": lambda: countingtricks(None, max(1, c.n_per_case // 12), grid, seed=c.seed,
                                                    prompt=prompt, color=colors),
        "temperature": lambda: task_samples("count", 2 * c.n_samples, c.seed + 900, image_size=size),
    }


def conflict_styles(model: str) -> tuple[str, str]:
    """The Digit-in-Conflict prompt styles (base, with distractor): Pstd, except for the organism,
    whose vocabulary cannot write Pstd's "circle: 7" answers and gets the number-only prompt."""
    return ("number", "number_conflict") if model == "toy" else ("std", "conflict")


def head_table(heads: xr.Dataset, abl: xr.Dataset, hl: xr.Dataset, att: xr.Dataset,
               thresholds: HeadThresholds = HeadThresholds()) -> pd.DataFrame:
    """Classify heads from a run's results. ``importance`` is on one scale, the paper's γ_h:
    |effect| of patching the head's z (the share of the logit difference it carries, 0 … 1).
    ``ablation_drop`` is a column of its own, the counting task's mean drop in log p(gold) (nats)
    when the head is mean-ablated: a second measure, not mixed into the first. ``alignment``: the
    share of counting samples whose top-1 decoded token is the first token of their count (runs
    made before HeadLens recorded it: not measured); ``difficulty``: HeadLens's difficulty-word share."""
    for field, measure in (("align_min", "count_token"), ("difficulty_min", "difficulty")):
        value = getattr(thresholds, field)
        if value is not None and value > 0 and measure not in hl:
            raise InputError(f"{field}={value}: this run's HeadLens results have no {measure!r} (made before "
                             "countlens recorded it); delete results/headlens.nc and rerun `countlens discover` "
                             "with the same --out to compute it")
    top1 = hl.token_id.isel(k=0)
    alignment = None
    if "count_token" in hl:
        known = hl.count_token >= 0
        alignment = (top1 == hl.count_token).where(known).mean("sample")
    table = classify_heads(hl.vgs, hl.cter, att.image_attention.mean("sample"), np.abs(heads.effect),
                           constancy(hl.token.isel(k=0)), thresholds, alignment=alignment,
                           difficulty=hl.get("difficulty"))
    drop = abl.logp_drop.sel(task="count")
    table.insert(table.columns.get_loc("importance") + 1, "ablation_drop",
                 [float(drop.sel(layer=la, head=h)) for la, h in zip(table["layer"], table["head"])])
    return table


def load_run(out: str | Path) -> dict:
    """Every stage result of a finished (or partial) run directory, by stage name."""
    from countlens import results

    out = Path(out)
    read_spec(out)
    found = {p.stem: results.load(p) for p in sorted((out / "results").glob("*.nc"))}
    missing = [s for s in STAGES if s not in found]
    if missing:
        raise InputError(f"{out} misses stages {missing}; rerun `countlens discover --out {out}` to finish it")
    return found


def _transition(vap: xr.Dataset) -> tuple[int | None, int | None]:
    """(last layer where image tokens still carry half the effect, first layer where the last token does)."""
    img = vap.effect.sel(group="image")
    last = vap.effect.sel(group="last")
    img_layers = [int(layer) for layer in vap.layer.values if float(img.sel(layer=layer)) >= 0.5]
    last_layers = [int(layer) for layer in vap.layer.values if float(last.sel(layer=layer)) >= 0.5]
    return (max(img_layers) if img_layers else None), (min(last_layers) if last_layers else None)


def write_report(model: str, arch: str, out: str | Path, table: pd.DataFrame | None = None,
                 prompt: str | None = None) -> Path:
    """Figures and ``report.md`` from the results in ``out`` (``table``: the head table, else heads.csv)."""
    from countlens import circuits
    from countlens.analysis import plots
    from countlens.analysis.evaluate import accuracy
    from countlens.datasets.countingtricks import CASES

    out = Path(out)
    r = load_run(out)
    cases, std, conflict, vap, heads, atp, lens, hl, att, am, abl, temp = (r[s] for s in STAGES)
    from countlens.analysis.attention_metrics import aggregate
    from countlens.analysis.evaluate import digit_in_conflict, number_avoidance, summary

    avoid = number_avoidance(cases.where(cases["count"] >= 0, drop=True))
    overall = summary(cases).loc["all"]
    dic = digit_in_conflict(std, conflict)
    per_layer = aggregate(am, by=None, per_layer=True)
    mas_iou = per_layer.unstack("outcome")[["mas", "iou"]].round(3)
    mas_iou.columns = [f"{m} ({o})" for m, o in mas_iou.columns]
    paper_iou = ""
    if "pixel_iou" in am:  # runs made before it have the head-mean IoU only
        by_head = am.pixel_iou.mean("sample", skipna=True).fillna(0.0)
        paper_iou = (f"\n\nThe paper's Attention-IoU (one layer-head's map back-projected to the pixels, "
                     f"binarised at 0.5 × max, vs the object pixels; `pixel_iou`): highest mean over the scenes "
                     f"{_argmax_head(by_head)}, mean over all heads {float(by_head.mean()):.3f}.")
    table = pd.read_csv(out / "heads.csv") if table is None else table
    spec = read_spec(out)
    prompt = prompt or spec.get("prompt", "?")
    k = int(spec.get("top_k", 5))
    jk = int(spec.get("jaccard_k", k))
    atp_score = circuits.compare(atp.effect, heads.effect, k=k)
    jac = circuits.jaccard(abl, k=jk)

    figs = out / "figures"
    by_case = accuracy(cases, "case")["accuracy"].reindex(list(CASES))
    family = pd.Series({n: c.family for n, c in CASES.items()})
    fam_acc = by_case.groupby(family).mean()
    plots.plot_bars(by_case, figs / "cases.png", "COUNTINGTRICKS accuracy per case")
    plots.plot_layers(vap, figs / "vap.png")
    plots.plot_heatmap(heads.effect, figs / "heads.png", "Head patching effect (z, all positions)", center=True)
    plots.plot_scatter(heads.effect, atp.effect, figs / "atp.png", "exact patching effect", "AtP estimate",
                       f"AtP vs exact (Spearman {atp_score['spearman']:.2f})")
    plots.plot_lens(lens, figs / "lens.png")
    plots.plot_heatmap(att.image_attention.mean("sample"), figs / "image_attention.png",
                       "Attention of the last token on image tokens")
    plots.plot_heatmap(abl.logp_drop.sel(task="count"), figs / "ablation_count.png",
                       "Mean ablation: drop in log p(gold), counting", center=True)
    first_img, first_last = _transition(vap)
    decoded_layer = next((int(la) for la in lens.layer.values if float(lens["rank"].sel(layer=la).median()) == 0), None)
    sharp = float(temp.sharpened.mean()), float(temp.base.mean())
    classes = table["class"].value_counts().to_dict()
    tops = {t: ", ".join(f"L{la}H{h}" for la, h in v) for t, v in circuits.top_heads(abl, k=jk).items()}
    vap_table = vap.effect.to_pandas().round(3).to_markdown()
    overwrite_table = vap.overwrite.to_pandas().round(3).to_markdown()
    preset_line = ""
    if spec.get("preset"):
        from countlens.presets import get

        chosen = get(spec["preset"])
        values = {**chosen.discover, **chosen.thresholds}
        preset_line = (f"\n\nPreset `{chosen.name}` ({chosen.paper}): " + ", ".join(f"{k_} = {v}" for k_, v in values.items())
                       + " (their sources: `countlens.presets`; what is still countlens's own: docs/fidelity.md).")
    text = f"""# Counting circuit of `{model}` ({arch})

Produced by `countlens discover`. Prompt style: `{prompt}`. Every number below is read from the
result files in `results/` (xarray netCDF; `countlens.results.load`).{preset_line}

## 1. COUNTINGTRICKS

![cases](figures/cases.png)

Mean accuracy: position cases (1–4) **{fam_acc.get('position', float('nan')):.3f}**, dilation (5A–8A)
**{fam_acc.get('dilation', float('nan')):.3f}**, adjacency (9–15) **{fam_acc.get('adjacency', float('nan')):.3f}**
({int(cases.sizes['sample'])} samples); over all cases, accuracy **{overall['accuracy']:.3f}** and MAE
**{overall['mae']:.2f}** (|predicted − true count| over the parsed answers). Per case:

{by_case.to_frame().T.round(2).to_markdown(index=False)}

Number avoidance: Pearson r between the count and its accuracy = **{avoid['r']:.2f}** (per count:
{", ".join(f"{k}: {v:.2f}" for k, v in avoid['per_count'].items())}).

Digit-in-Conflict (position cases, the same {dic['n_std']} images under the `{conflict_styles(model)[0]}` prompt and with
a distractor digit N±1 / N±2 in it): accuracy {dic['accuracy_std']:.3f} → {dic['accuracy_conflict']:.3f}; the
distractor is answered in {dic['distractor_share']:.1%} of conflict answers.

## 2. Where the count travels: visual activation patching

![vap](figures/vap.png)

Effect = share of the corrupt answer's logit difference that patching one layer's residual stream,
over one token group, carries into the clean run ({int(vap.sizes['pair'])} pairs).
{_image_sentence(first_img)};
{"the last prompt token carries at least half from layer " + str(first_last) if first_last is not None else "the last token never carries half"}.

{vap_table}

Overwrite rate (the papers' measure): the share of pairs whose prediction becomes the corrupt answer.

{overwrite_table}

## 3. Heads: exact patching and attribution patching

![heads](figures/heads.png) ![atp](figures/atp.png)

Top heads by exact patching effect: {_top_effects(heads.effect, 5)}. AtP ranks heads
with Spearman ρ = **{atp_score['spearman']:.3f}** against exact patching (top-{atp_score['top_k']} overlap
{atp_score['top_k_overlap']:.2f}), from three passes instead of one sweep.

## 4. Logit lens

![lens](figures/lens.png)

The gold answer is the top token (median rank 0) from layer **{decoded_layer}** on; mean p(gold) after the last
layer is {float(lens.prob.isel(layer=-1).mean()):.3f}.

## 5. HeadLens and attention

![attention](figures/image_attention.png)

HeadLens maps fit with held-out R² per layer: {", ".join(f"{float(v):.2f}" for v in hl.r2.values)}.
Most image-attentive head: {_argmax_head(att.image_attention.mean("sample"))}; highest VGS:
{_argmax_head(hl.vgs)}; highest CTER: {_argmax_head(hl.cter)}.

Attention diagnostics on {int(am.sizes['sample'])} COUNTINGTRICKS scenes (last prompt token, head mean;
`countlens.analysis.attention_metrics`): MAS = share of attention on image tokens, Attention-IoU =
binarised (≥ 0.5 × max) attention map vs object cells, split by whether the answer was correct.

{mas_iou.to_markdown()}{paper_iou}

## 6. Head classes

{pd.Series(classes).to_frame("heads").to_markdown()}

The full table is in `heads.csv` / `heads.md` / `heads.tex` (rules in `countlens.analysis.heads`; thresholds: {"the preset's, `countlens.presets`" if spec.get("preset") else "the defaults, `HeadThresholds`"}; `countlens classify` changes them).

{table.head(10).round(3).to_markdown(index=False)}

## 7. Mean ablation across tasks

![ablation](figures/ablation_count.png)

Top-{jac.attrs['k']} heads by drop in log p(gold): {"; ".join(f"{t}: {v}" for t, v in tops.items())}.
Jaccard overlap between tasks' sets:

{jac.to_pandas().round(2).to_markdown()}

## 8. Head temperature

Sharpening {temp.attrs['betas']} (β = α·γ from head patching): counting accuracy
{sharp[1]:.3f} → **{sharp[0]:.3f}** on {int(temp.sizes['sample'])} held-out scenes.
"""
    path = out / "report.md"
    if path.exists() and FINETUNE_SECTION in path.read_text():
        # Keep the section `countlens finetune` appended: it is not rebuilt from results/.
        text = text.rstrip("\n") + "\n\n" + FINETUNE_SECTION + path.read_text().split(FINETUNE_SECTION, 1)[1]
    path.write_text(text)
    return path


def _top_effects(effect: xr.DataArray, k: int) -> str:
    flat = effect.stack(site=("layer", "head"))
    order = np.argsort(-np.abs(flat.values), kind="stable")[:k]
    return ", ".join(f"L{flat.site.values[i][0]}H{flat.site.values[i][1]} ({float(flat.values[i]):.2f})" for i in order)


def _image_sentence(layer: int | None) -> str:
    if layer is None:
        return "Image tokens never carry half the effect by themselves, not even at the input"
    if layer == -1:
        return ("Image tokens carry the count at the input (layer −1, the embeddings) but not after layer 0: "
                "layer 0 already moves it onto text positions")
    return f"Image tokens carry at least half the effect up to layer {layer}"


def _argmax_head(da: xr.DataArray) -> str:
    flat = da.stack(site=("layer", "head"))
    layer, head = flat.site.values[int(np.argmax(flat.values))]
    return f"L{layer}H{head} ({float(flat.max()):.2f})"
