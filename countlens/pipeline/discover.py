"""The main job: from a model to a counting-circuit report, one resumable stage at a time.

The stages are the registry's (`countlens.pipeline.stages`: each one object that names its inputs,
computes, plans its cost and feeds a report section). Each writes ``results/<stage>.nc`` and is
skipped when that file exists, so a killed run resumes where it stopped; the long sweeps also
stream their chunks to ``results/sweeps/``:

1. ``cases`` — COUNTINGTRICKS accuracy, 32 cases, and number avoidance; ``conflict_std`` /
   ``conflict`` — Digit-in-Conflict on the position cases;
2. ``vap`` — visual activation patching by layer over image / last / text tokens;
3. ``heads`` and ``atp`` — head patching of z and attribution patching, and how well AtP ranks heads;
4. ``lens`` — logit lens of the gold answer at the last prompt token;
5. ``headlens`` — HeadLens maps, decoded tokens, VGS / CTER; ``attention`` — image-attention share;
   ``attention_metrics`` — MAS, VRA, Attention-IoU, ARS per layer on COUNTINGTRICKS scenes;
   ``attention_maps`` — the last token's attention on the image tokens of a few right and wrong
   answers, with their images, for the report's attention-on-image figure; ``objects`` — each
   object's exact effect on the count answer (its image tokens at the input patched from the scene
   without it) on up to 4 COUNTINGTRICKS scenes per case, for the report's section on which objects
   the model counts, by placement class;
6. ``ablation`` — mean ablation of every head on the config's tasks (counting, colour and shape by
   default; the counting-circuits preset: counting, math, spatial, colour); Jaccard;
7. ``temperature`` — counting accuracy with the most important heads sharpened (β = α·γ);
8. ``probes`` (with ``probes=True``) — the MAS paper's detection probes on its three taps;
then the head table (``heads.csv`` / ``.md`` / ``.tex``), plots and ``report.md``. The stages run under
`countlens.circuits.tolerate_noise`: a normaliser below the noise rule is marked in the report, not refused.

Launched as several processes (``torchrun --nproc_per_node N -m countlens.cli discover …`` or
``accelerate launch``; `countlens.distributed`), every rank first takes its share of the three
sweeps (``vap``, ``heads``, ``ablation``), meeting in ``results/sweeps/``; then rank 0 alone runs
the other stages and writes the report, the same as one process would.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from countlens import distributed, files
from countlens.analysis.heads import export_heads, head_table
from countlens.circuits.engine.pair_batch import tolerate_noise
from countlens.datasets.prompts import PROMPTS
from countlens.errors import ConfigError, CountlensError
from countlens.pipeline import presets
from countlens.pipeline.config import DiscoverConfig, resolved_prompt
from countlens.pipeline.inputs import stage_inputs
from countlens.pipeline.report import write_report
from countlens.pipeline.rundir import Stages, check_run_dir
from countlens.pipeline.stages import STAGES, RunContext, Stage
from countlens.reference.counting_to_four.attention import chatml_sets

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


def check_preset(c: DiscoverConfig) -> None:
    """The preset named (`presets.get`), before anything is written; the fields themselves were checked
    when ``c`` was made (`DiscoverConfig.__post_init__` runs `validate_config`)."""
    if c.preset:
        presets.get(c.preset)


def discover(
    vlm: VLM, out: str | Path, config: DiscoverConfig = DiscoverConfig(), log: Callable[[str], None] = print
) -> Path:
    """Run every stage of the registry (`countlens.pipeline.stages.STAGES`) that ``config`` enables on
    ``vlm`` into ``out``; returns the path of ``report.md``."""
    out = Path(out)
    check_run_dir(out)
    c = config
    check_preset(c)  # before anything is written: a refused run leaves no spec behind
    prompt = resolved_prompt(vlm, c)
    # The resolved prompt, not "auto": reports re-rendered from spec.json name what ran.
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
    if not c.methods:  # every discover method: the spec as runs wrote it before they could name some
        del spec["methods"]
    shard = distributed.current()  # the launcher's variables checked before anything is written
    check_inputs(vlm, c, prompt)
    inputs = stage_inputs(vlm, c, prompt)
    # One process writes a run folder at a time (the ranks of one sharded run share it by design): a
    # second discover into the same --out is refused while the first runs; a killed run leaves no lock.
    out.mkdir(parents=True, exist_ok=True)
    lock = nullcontext() if shard.sharded else files.directory_lock(out, LOCK, "discover", "give another --out")
    # A stage whose normaliser is below the noise rule is marked (its result's ``normaliser_noisy``, shown
    # beside its figures in the report), not refused: one noisy stage does not stop the others.
    with lock, tolerate_noise():
        return _run(vlm, c, prompt, inputs, out, shard, log, spec)


#: The lock file a discover run holds in its folder while it runs.
LOCK = ".discover.lock"


def _run(vlm: VLM, c: DiscoverConfig, prompt: str, inputs: dict, out: Path, shard, log, spec: dict) -> Path:
    """`discover`'s stages and report, by the process that holds ``out``'s lock."""
    run = RunContext(vlm, c, prompt, inputs, out, shard, log)
    run.pairs, run.data = inputs["pairs"](), inputs["tasks"]()
    stages = Stages(out, spec, log)
    chosen = [s for s in STAGES if s.enabled(c)]

    def run_stage(stage: Stage, save: bool = True) -> None:
        result = stages.run(stage.name, lambda: stage.compute(run), save=save)
        if stage.check is not None:
            stage.check(run, result)
        run.results[stage.name] = result

    if shard.sharded:
        # Every rank takes its share of the sweeps first; then rank 0 alone runs the other stages
        # (the sweeps' results now stored) and writes the report.
        for stage in (s for s in chosen if s.sweep):
            stages.run(stage.name, lambda stage=stage: stage.compute(run), save=shard.rank == 0)
        if shard.rank != 0:
            log(f"rank {shard.rank} of {shard.world}: its share of the sweeps is done; rank 0 writes the report")
            return out / "report.md"
    for stage in chosen:
        run_stage(stage)
    r = run.results
    table = head_table(r["heads"], r["ablation"], r["headlens"], r["attention"], presets.thresholds(c.preset))
    export_heads(table, out)
    return write_report(vlm.name, vlm.arch.name, out, table=table, prompt=prompt)


def check_inputs(vlm: VLM, c: DiscoverConfig, prompt: str) -> None:
    """Build one of each stage's inputs (every COUNTINGTRICKS case on this model's grid, each task) and
    read every record the run will take from a local MathVista / CLEVR copy, so that a grid no stage can
    draw on, or a broken record, is refused before spec.json is written, not hours later."""
    from dataclasses import replace

    small = replace(c, n_per_case=1, n_pairs=1, n_samples=1)
    made = stage_inputs(vlm, small, prompt)
    for name in dict.fromkeys(i for stage in STAGES if stage.enabled(c) for i in stage.inputs):
        made[name]()
    local = tuple(t for t in c.tasks if (t == "math" and c.math) or (t == "spatial" and c.spatial))
    if local:  # every row of a local copy the run reads (a few JSON records each), checked now
        stage_inputs(vlm, c, prompt)["tasks"](names=local)
    if c.probes and c.voc:  # every VOC image and annotation the probes will read
        stage_inputs(vlm, c, prompt)["probes"]()
    if c.attention_at == "generation":  # the MAS code's 4-way share reads ChatML turns: refuse other prompts now
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
