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
6. ``ablation`` — mean ablation of every head on the config's tasks (counting, colour and shape by
   default; the counting-circuits preset: counting, math, spatial, colour); Jaccard;
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
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import xarray as xr

from countlens import circuits, distributed
from countlens.analysis.attention_metrics import attention_metrics
from countlens.analysis.evaluate import generate, score, unanswered
from countlens.analysis.heads import check_effects, export_heads, head_sites, head_table
from countlens.pipeline import presets
from countlens.pipeline.config import DiscoverConfig, conflict_styles, resolved_prompt
from countlens.pipeline.report import write_report
from countlens.pipeline.rundir import Stages, check_run_dir
from countlens.results import head_label

if TYPE_CHECKING:
    from countlens.vlm import VLM


def check(c: DiscoverConfig) -> None:
    """The preset named (`presets.get`), before anything is written; the fields themselves were checked
    when ``c`` was made (`DiscoverConfig.__post_init__` runs `check_config`)."""
    if c.preset:
        presets.get(c.preset)


def discover(
    vlm: VLM, out: str | Path, config: DiscoverConfig = DiscoverConfig(), log: Callable[[str], None] = print
) -> Path:
    """Run every stage on ``vlm`` into ``out``; returns the path of ``report.md``."""
    out = Path(out)
    check_run_dir(out)
    c = config
    check(c)  # before anything is written: a refused run leaves no spec behind
    prompt = resolved_prompt(vlm, c)
    # The resolved prompt, not "auto": reports re-rendered from spec.json name what ran.
    from countlens.datasets.prompts import PROMPTS

    # The template and answer form too, not only the style's name: the same name with other text or
    # another answer form asks the model another question, so it is another spec.
    spec = {
        **asdict(c),
        "model": vlm.name,
        "arch": vlm.arch.name,
        "prompt": prompt,
        "prompt_template": PROMPTS[prompt].template,
        "answer_form": PROMPTS[prompt].answer,
    }
    shard = distributed.current()  # the launcher's variables checked before anything is written
    bs = c.batch_size
    check_inputs(vlm, c, prompt)
    inputs = stage_inputs(vlm, c, prompt)
    pairs, data = inputs["pairs"](), inputs["tasks"]()
    stages = Stages(out, spec, log)
    sweeps = out / "results" / "sweeps"
    sweep_stages = {
        "vap": lambda: circuits.patch_layers(
            vlm,
            pairs,
            batch_size=bs,
            store=sweeps / "vap",
            progress=True,
            shard=shard,
        ),
        "heads": lambda: circuits.patch_heads(
            vlm, pairs, batch_size=bs, store=sweeps / "heads", progress=True, shard=shard
        ),
        "ablation": lambda: circuits.ablation_scan(
            vlm, data, batch_size=bs, store=sweeps / "ablation", progress=True, shard=shard
        ),
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
    def answers(samples: list, progress: bool = False) -> xr.Dataset:
        if c.evaluate == "generate":
            return generate(
                vlm, samples, max_new_tokens=c.max_new_tokens, batch_size=bs, progress=progress, parser=c.parser
            )
        return score(vlm, samples, batch_size=bs, progress=progress)

    cases = stages.run("cases", lambda: answers(inputs["cases"](), progress=True))
    warning = unanswered(cases)
    if warning:  # the report repeats it at its top
        log(f"warning: on COUNTINGTRICKS, {warning}")
    # Digit-in-Conflict: the same position-case images under Pstd and with a distractor digit.
    for stage in ("conflict_std", "conflict"):
        stages.run(stage, lambda stage=stage: answers(inputs[stage]()))
    # 2–3. patching
    stages.run("vap", sweep_stages["vap"])
    heads = stages.run("heads", sweep_stages["heads"])
    check_effects(heads.effect, sites=head_sites(heads))  # the importance every later stage reads
    stages.run("atp", lambda: circuits.attribution_patch(vlm, pairs, batch_size=bs))
    # 4–5. lenses and attention
    stages.run("lens", lambda: circuits.logit_lens(vlm, data["count"], batch_size=bs))

    def headlens() -> xr.Dataset:
        return circuits.HeadLens.fit(vlm, inputs["headlens_fit"](), batch_size=bs).decode(
            vlm, data["count"], batch_size=bs
        )

    hl = stages.run("headlens", headlens)
    att = stages.run(
        "attention",
        lambda: circuits.image_attention_share(vlm, data["count"], batch_size=bs).to_dataset(name="image_attention"),
    )
    stages.run(
        "attention_metrics",
        lambda: attention_metrics(
            vlm,
            inputs["attention_metrics"](),
            batch_size=bs,
            at=c.attention_at,  # the notebook's 50 new tokens
        ),
    )
    # 6. ablation across tasks
    abl = stages.run("ablation", sweep_stages["ablation"])
    # 7. temperature from head-patching importance (the head table's `importance`)
    # Only heads with softmax attention have a temperature (Qwen3.5's linear layers: none).
    softmax = xr.DataArray([vlm.arch.softmax(int(la)) for la in heads.layer.values], coords={"layer": heads.layer})
    betas = circuits.beta_from_importance(heads.effect.where(softmax), alpha=c.alpha, top_k=c.top_k)

    def temperature() -> xr.Dataset:
        held = inputs["temperature"]()
        base = score(vlm, held, batch_size=bs)
        with circuits.head_temperature(vlm, betas):
            sharp = score(vlm, held, batch_size=bs)
        return xr.Dataset(
            {"base": base.correct, "sharpened": sharp.correct},
            attrs={"betas": json.dumps({head_label(h): b for h, b in betas.items()})},
        )

    stages.run("temperature", temperature)
    if c.probes:  # the MAS paper's detection probes, as its code trains them, on its three taps
        from countlens.analysis.probes import ProbeConfig, code_taps, probe_taps

        train, test = inputs["probes"]()
        stages.run(
            "probes",
            lambda: probe_taps(
                vlm, train, test, code_taps(vlm), ProbeConfig(seed=c.seed), batch_size=bs, recipe="counting-to-four"
            ),
        )
    table = head_table(heads, abl, hl, att, presets.thresholds(c.preset))
    export_heads(table, out)
    return write_report(vlm.name, vlm.arch.name, out, table=table, prompt=prompt)


def check_inputs(vlm: VLM, c: DiscoverConfig, prompt: str) -> None:
    """Build one of each stage's inputs (every COUNTINGTRICKS case on this model's grid, each task) and
    read every record the run will take from a local MathVista / CLEVR copy, so that a grid no stage can
    draw on, or a broken record, is refused before spec.json is written, not hours later."""
    from dataclasses import replace

    small = replace(c, n_per_case=1, n_pairs=1, n_samples=1)
    for name, make in stage_inputs(vlm, small, prompt).items():
        if name != "probes" or c.probes:
            make()
    local = tuple(t for t in c.tasks if (t == "math" and c.math) or (t == "spatial" and c.spatial))
    if local:  # every row of a local copy the run reads (a few JSON records each), checked now
        stage_inputs(vlm, c, prompt)["tasks"](names=local)
    if c.probes and c.voc:  # every VOC image and annotation the probes will read
        stage_inputs(vlm, c, prompt)["probes"]()
    if c.attention_at == "generation":  # the MAS code's 4-way share reads ChatML turns: refuse other prompts now
        from countlens.analysis.code_attention import chatml_sets
        from countlens.errors import ConfigError, CountlensError

        if vlm.arch.spec.cross_attention is not None:
            raise ConfigError(
                f"attention_at='generation' reads the MAS code's diagnostics of image tokens; {vlm.arch.name} has "
                "none (cross-attention): give attention_at='prompt'"
            )
        sample = stage_inputs(vlm, small, prompt)["attention_metrics"]()[:1]
        try:
            chatml_sets(vlm, vlm.prepare_samples(sample), 0)
        except CountlensError as err:
            raise ConfigError(f"{err}; give attention_at='prompt' for this model") from None


def stage_inputs(vlm: VLM, c: DiscoverConfig, prompt: str) -> dict[str, Callable[[], list]]:
    """Each stage's samples, made on demand (every one a pure function of the seed): ``pairs`` for
    patching, ``tasks`` ({task: samples}) for the lens, attention and ablation, and the samples of
    ``cases``, ``conflict_std`` / ``conflict``, ``headlens_fit``, ``attention_metrics`` and
    ``temperature``. `countlens.pipeline.plan` sizes the stages from the same lists."""
    from countlens.datasets.countingtricks import CASES, countingtricks
    from countlens.datasets.pairs import count_pairs
    from countlens.datasets.tasks import task_samples

    grid = vlm.geometry
    size = grid.image_height
    colors = ("red", "green", "blue")

    def task(name: str, seed_offset: int) -> list:
        """A task's samples: from a local copy where the config names one (math: MathVista, spatial:
        CLEVR; its first n_samples), else procedural."""
        if name == "math" and c.math:
            from countlens.datasets.loaders import load_mathvista

            return load_mathvista(c.math, limit=c.n_samples)
        if name == "spatial" and c.spatial:
            from countlens.datasets.loaders import load_clevr

            return load_clevr(c.spatial, limit=c.n_samples)
        return task_samples(name, c.n_samples, c.seed + seed_offset, image_size=size)

    def tasks(seed_offset: int = 0, names: tuple[str, ...] = c.tasks) -> dict:
        return {t: task(t, seed_offset) for t in names}

    def probe_data() -> tuple[list, list]:
        """The probes' (train, test): VOC2007's trainval and test lists (first n_samples each) when a
        copy is given, else COUNTINGTRICKS scenes of the run's design (its own seeds)."""
        if c.voc:
            from countlens.datasets.loaders import load_voc2007

            return load_voc2007(c.voc, "trainval", limit=c.n_samples), load_voc2007(c.voc, "test", limit=c.n_samples)
        per_case = max(1, c.n_samples // 16)
        design = {"design": "paper-code"} if c.design == "paper-code" else {"color": colors}
        return (
            countingtricks(None, 2 * per_case, grid, seed=c.seed + 700, prompt=prompt, **design),
            countingtricks(None, per_case, grid, seed=c.seed + 800, prompt=prompt, **design),
        )

    position = [n for n, case in CASES.items() if case.family == "position"]
    base, distractor = conflict_styles(vlm.name)

    def conflict(style: str) -> list:
        return countingtricks(position, max(1, c.n_per_case // 5), grid, seed=c.seed, prompt=style, color=colors)

    return {
        "pairs": lambda: count_pairs(
            c.n_pairs, kind=c.pair_kind, grid=grid, seed=c.seed, prompt=prompt, counts=range(1, 10)
        ),
        "tasks": tasks,
        "cases": lambda: (
            countingtricks(None, c.n_per_case, grid, seed=c.seed, prompt=prompt, design="paper-code")
            if c.design == "paper-code"
            else countingtricks(None, c.n_per_case, grid, seed=c.seed, prompt=prompt, color=colors)
        ),
        "conflict_std": lambda: conflict(base),
        "conflict": lambda: conflict(distractor),
        # HeadLens learns its maps on the organism's three trained tasks, whatever the ablation compares.
        "headlens_fit": lambda: [
            s for samples in tasks(seed_offset=500, names=("count", "color", "shape")).values() for s in samples
        ],
        "attention_metrics": lambda: countingtricks(
            None, max(1, c.n_per_case // 12), grid, seed=c.seed, prompt=prompt, color=colors
        ),
        "temperature": lambda: task_samples("count", 2 * c.n_samples, c.seed + 900, image_size=size),
        "probes": probe_data,
    }
