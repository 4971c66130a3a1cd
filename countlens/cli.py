"""The `countlens` command line: every command is a thin call into the packages."""

from __future__ import annotations

from pathlib import Path

import typer

from countlens.errors import CountlensError

app = typer.Typer(no_args_is_help=True, help="countlens: counting as a probe of how VLMs reason.")
toy_app = typer.Typer(no_args_is_help=True, help="The shipped model organism: train it from scratch.")
app.add_typer(toy_app, name="toy")
data_app = typer.Typer(no_args_is_help=True, help="Generate controlled counting data sets on disk.")
app.add_typer(data_app, name="data")


def _fail(err: Exception) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _check_out(out: Path | None, flag: str = "--out") -> None:
    """Refuse an output directory that cannot be written, before any model loads; writes nothing."""
    import os

    if out is None:
        return
    if out.exists() and not out.is_dir():
        _fail(CountlensError(f"{flag} {out} is a file; give a directory"))
    base = out
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        _fail(CountlensError(f"{flag} {out}: {base} is a file, so no directory can be made under it; give another path"))
    if not os.access(base, os.W_OK | os.X_OK) or base.resolve().parts[1:2] in (("proc",), ("sys",)):
        _fail(CountlensError(f"{flag} {out}: {base} is not writable; give a directory you can write to"))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            _fail(CountlensError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}"))


@toy_app.command("train")
def toy_train(
    out: Path = typer.Option(..., help="Directory to write the HF checkpoint, recipe and training log into."),
    seed: int = typer.Option(0, help="Seed of the initialisation and of the training scenes."),
    steps: int = typer.Option(None, help="Override the recipe's number of steps (e.g. for a quick check)."),
) -> None:
    """Train the organism deterministically (about 25 min on 2 CPU cores).

    Example: countlens toy train --seed 0 --out runs/toy-model
    """
    from dataclasses import replace

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from countlens.toy.recipe import ToyConfig, TrainConfig
    from countlens.toy.train import train

    if out.exists() and not out.is_dir():
        _fail(CountlensError(f"--out {out} is a file; give a directory"))
    tc = TrainConfig(seed=seed)
    if steps is not None:
        tc = replace(tc, steps=steps)
    with Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("train", total=tc.steps, info="")

        def report(row: dict) -> None:
            bar.update(task, completed=row["step"] + 1, info=f"loss {row['loss']:.3f}" + (
                f" held-out {row['held_out_acc']:.3f}" if "held_out_acc" in row else ""))

        last = train(out, ToyConfig(), tc, progress=report)
    typer.echo(f"saved to {out}: {last}")


@app.command("eval")
def eval_cmd(
    model: str = typer.Option("toy", help="'toy', a local checkpoint directory, or a cached hub id."),
    out: Path = typer.Option(None, help="Directory for samples.csv and accuracy.md (nothing written if omitted)."),
    n: int = typer.Option(600, help="Counting scenes to score (each other task gets n/4)."),
    seed: int = typer.Option(1, help="Evaluation seed (< 1000: never a training seed of the organism)."),
    batch_size: int = typer.Option(32),
    device: str = typer.Option(None, help="e.g. cuda; default: where from_pretrained puts it."),
    dtype: str = typer.Option(None, help="e.g. bfloat16."),
) -> None:
    """Score a model on held-out task scenes: accuracy per task and, for counting, per count.

    Example: countlens eval --model toy --out runs/eval
    """
    import numpy as np

    import countlens
    from countlens.analysis import accuracy, score
    from countlens.datasets.tasks import TASKS, TRAIN_SEED_BASE, scene_kind, task_samples

    _check_out(out)
    _check_positive(n=n, batch_size=batch_size)
    if not 0 <= seed < TRAIN_SEED_BASE:
        _fail(CountlensError(f"--seed {seed}: evaluation seeds are 0..{TRAIN_SEED_BASE - 1}; larger ones are the organism's training scenes"))
    try:
        vlm = countlens.load(model, dtype=dtype, device_map=device)
        size = vlm.geometry.image_height
        samples = task_samples("count", n, seed, image_size=size)
        samples += [s for t in TASKS if t != "count" for s in task_samples(t, max(1, n // 4), seed, image_size=size)]
        ds = score(vlm, samples, batch_size=batch_size, progress=True)
    except CountlensError as err:
        _fail(err)
    ds = ds.assign(scene=("sample", np.array([scene_kind(s) for s in samples], dtype=object)))
    by_task = accuracy(ds, "task")
    counting = ds.where(ds.task == "count", drop=True)
    up_to_ten = counting.where(counting["count"] <= 10, drop=True)
    by_scene = accuracy(up_to_ten, "scene")
    by_count = accuracy(counting, "count")
    by_count.index = by_count.index.astype(int)
    upto10 = float(up_to_ten.correct.mean())
    text = (
        f"# Held-out accuracy of {model} (seed {seed})\n\n"
        f"Counting, N ≤ 10: **{upto10:.3f}**\n\n## Per task\n\n{by_task.to_markdown(floatfmt=('g', '.3f', 'g'))}\n\n"
        f"## Counting with N ≤ 10, per scene kind\n\n{by_scene.to_markdown(floatfmt=('g', '.3f', 'g'))}\n\n"
        f"## Counting, per N\n\n{by_count.to_markdown(floatfmt=('g', '.3f', 'g'))}\n"
    )
    typer.echo(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        ds.to_dataframe().to_csv(out / "samples.csv")
        (out / "accuracy.md").write_text(text)


def _grid(model: str, image_size: int | None, patch_size: int | None):
    """The patch grid from plain numbers, the organism's recipe (no weights needed) or a loaded model."""
    from countlens.geometry import Geometry

    if (image_size is None) != (patch_size is None):
        raise CountlensError("give both --image-size and --patch-size, or neither (the model's grid)")
    if image_size is not None:
        if image_size < 1 or patch_size < 1:
            raise CountlensError(f"--image-size {image_size} and --patch-size {patch_size} must be positive pixel sizes")
        if image_size < patch_size:
            raise CountlensError(f"--image-size {image_size} is smaller than --patch-size {patch_size}")
        return Geometry.data_grid(image_size, patch_size)
    if model == "toy":
        from countlens.toy.recipe import ToyConfig

        return ToyConfig().geometry
    import countlens

    return countlens.load(model).geometry


@data_app.command("countingtricks")
def data_countingtricks(
    out: Path = typer.Option(..., help="Directory for images/<case>/*.png and manifest.jsonl."),
    cases: str = typer.Option(None, help="Comma-separated cases, e.g. 1A,4A,9B (default: all 32)."),
    n: int = typer.Option(1000, help="Samples per case."),
    seed: int = typer.Option(0),
    model: str = typer.Option("toy", help="Model whose patch grid places the objects."),
    image_size: int = typer.Option(None, help="Plain grid instead of a model's: image side in pixels."),
    patch_size: int = typer.Option(None, help="Plain grid instead of a model's: patch side in pixels."),
    shapes: str = typer.Option("circle,square,triangle", help="Comma-separated shapes the samples cycle through."),
    color: str = typer.Option("red", help="Object colour, or several comma-separated (one drawn per object)."),
    prompt: str = typer.Option("std", help="Prompt style: std (the papers' Pstd, answers 'circle: 7'), number "
                               "(number only), objects, short, conflict or number_conflict (Digit-in-Conflict)."),
    workers: int = typer.Option(None, help="Processes (default: all cores); output is identical for any number."),
    counts: str = typer.Option(None, help="Comma-separated counts the samples cycle through (default: 3…12, as the "
                               "grid allows), e.g. 3,4,5."),
    overwrite: bool = typer.Option(False, help="Replace a previous export in --out (only its images and manifest)."),
) -> None:
    """Write COUNTINGTRICKS images and a manifest with every object's geometry.

    Example: countlens data countingtricks --out runs/tricks --cases 1A,4A,9B --n 100
    """
    from rich.progress import Progress

    from countlens.datasets.countingtricks import CASES
    from countlens.datasets.export import export_countingtricks

    _check_out(out)
    _check_positive(n=n, workers=workers)
    try:
        wanted = None if counts is None else tuple(int(x) for x in counts.split(",") if x.strip())
    except ValueError:
        _fail(CountlensError(f"--counts {counts!r}: give comma-separated integers, e.g. 3,4,5"))
    try:
        names = list(CASES) if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
        grid = _grid(model, image_size, patch_size)
        kw = dict(shapes=tuple(shapes.split(",")), color=tuple(color.split(",")), prompt=prompt, counts=wanted)
        with Progress() as bar:
            task = bar.add_task("countingtricks", total=len(names) * n)
            manifest = export_countingtricks(out, names, n, grid, seed, workers, overwrite=overwrite,
                                             progress=lambda k: bar.update(task, completed=k), **kw)
    except CountlensError as err:
        _fail(err)
    typer.echo(f"wrote {len(names) * n} images and {manifest}")


def _given(**values) -> dict:
    """The options given on the command line: those whose value is not None."""
    return {k: v for k, v in values.items() if v is not None}


def _discover_config(preset: str | None, **values):
    """A DiscoverConfig from the flags given (None: not given): over the preset's values, if any,
    else over the defaults."""
    from countlens.pipeline import presets
    from countlens.pipeline.config import DiscoverConfig

    given = _given(**values)
    return presets.discover_config(preset, **given) if preset else DiscoverConfig(**given)


@app.command("discover")
def discover_cmd(
    model: str = typer.Option("toy", help="'toy', a local checkpoint directory, or a cached hub id."),
    out: Path = typer.Option(..., help="Run directory: results/, figures/, heads.csv and report.md go here."),
    preset: str = typer.Option(None, help="A paper's protocol: counting-circuits or counting-to-four "
                               "(countlens.pipeline.presets); the flags below override it."),
    n_per_case: int = typer.Option(None, help="COUNTINGTRICKS samples per case [100]."),
    n_pairs: int = typer.Option(None, help="Clean/corrupt pairs for patching [128]."),
    n_samples: int = typer.Option(None, help="Samples per task for lenses, attention and ablation [128]."),
    seed: int = typer.Option(0),
    prompt: str = typer.Option(None, help="Prompt style [auto]: auto (short for toy, std otherwise), std (the "
                               "papers' Pstd), number, objects, short."),
    batch_size: int = typer.Option(16),
    device: str = typer.Option(None, help="e.g. cuda; default: where from_pretrained puts it."),
    dtype: str = typer.Option(None, help="e.g. bfloat16."),
    remote: bool = typer.Option(False, help="Run traces on NDIF (needs a hub id and an NDIF key)."),
) -> None:
    """Find the counting circuit: COUNTINGTRICKS, VAP, head patching, AtP, logit lens, HeadLens,
    head classes, mean ablation across tasks, head temperature; writes report.md. Resumable.

    Example: countlens discover --model toy --out runs/toy
    """
    import countlens
    from countlens.datasets.prompts import PAIR_PROMPTS
    from countlens.pipeline.config import check_config
    from countlens.pipeline.discover import discover

    _check_out(out)
    if prompt is not None and prompt != "auto" and prompt not in PAIR_PROMPTS:
        _fail(CountlensError(f"--prompt {prompt!r}: use auto or one of {', '.join(PAIR_PROMPTS)}"))
    _check_positive(n_per_case=n_per_case, n_pairs=n_pairs, n_samples=n_samples, batch_size=batch_size)
    try:
        config = _discover_config(preset, seed=seed, batch_size=batch_size, n_per_case=n_per_case, n_pairs=n_pairs,
                                  n_samples=n_samples, prompt=prompt)
        check_config(config)  # before the model loads
        vlm = countlens.load(model, dtype=dtype, device_map=device, remote=remote)
        report = discover(vlm, out, config, log=typer.echo)
    except CountlensError as err:
        _fail(err)
    typer.echo(f"report: {report}")


@app.command("plan")
def plan_cmd(
    model: str = typer.Option("toy", help="'toy', a local checkpoint directory (its config and processor are "
                              "read; no weights), or a cached hub id."),
    image_size: int = typer.Option(None, help="Square image side in pixels (dynamic-resolution processors); "
                                   "default: the processor's."),
    memory: float = typer.Option(None, help="The device's memory in GiB (e.g. 141 for an H200); default: this "
                                 "machine's available memory."),
    device: str = typer.Option("cpu", help="Where discover would run: cpu or cuda."),
    dtype: str = typer.Option(None, help="e.g. bfloat16; default: the checkpoint's."),
    preset: str = typer.Option(None, help="Plan a preset's run (as `countlens discover --preset`)."),
    n_per_case: int = typer.Option(None, help="As `countlens discover` [100]."),
    n_pairs: int = typer.Option(None, help="[128]"),
    n_samples: int = typer.Option(None, help="[128]"),
    prompt: str = typer.Option(None, help="[auto]"),
    batch_size: int = typer.Option(16),
    json_out: Path = typer.Option(None, "--json", help="Also write the plan as JSON here."),
) -> None:
    """Plan `countlens discover` before running it: per stage, its forwards, rows per stacked
    forward, peak memory and FLOPs, for the given image size, batch and device memory.

    Example: countlens plan --model runs/qwen2.5-vl-7b --image-size 448 --memory 141 --device cuda --dtype bfloat16
    """
    import json

    from countlens.loading import meta_vlm
    from countlens.pipeline import plan

    _check_positive(image_size=image_size, n_per_case=n_per_case, n_pairs=n_pairs, n_samples=n_samples,
                    batch_size=batch_size)
    if memory is not None and not memory > 0:
        _fail(CountlensError(f"--memory must be > 0 GiB, got {memory}"))
    try:
        config = _discover_config(preset, batch_size=batch_size, n_per_case=n_per_case, n_pairs=n_pairs,
                                  n_samples=n_samples, prompt=prompt)
        vlm = meta_vlm(model, dtype=dtype, image_size=image_size)
        p = plan.plan(vlm, config, memory=None if memory is None else int(memory * 2**30), device=device)
    except CountlensError as err:
        _fail(err)
    gib = 2**30
    typer.echo(f"{p.model} on {p.device} with {p.memory / gib:.1f} GiB: weights {p.widths.weight_bytes / gib:.2f} GiB, "
               f"runtime {p.base / gib:.2f} GiB, {p.image_size} px images ({p.patches} patches each); "
               f"batch {batch_size}")
    typer.echo(p.table().to_markdown())
    for s in p.stages:
        for note in s.notes:
            typer.echo(f"{s.name}: {note}")
    over = p.over()
    if over:
        typer.echo(f"over {p.memory / gib:.1f} GiB: {', '.join(over)}; lower --batch-size or give a larger device")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(p.to_dict(), indent=1) + "\n")


@app.command("classify")
def classify_cmd(
    run: Path = typer.Option(..., help="A `countlens discover` run directory."),
    early: float = typer.Option(None, help="Depth (layer / last layer) at or below which a head is early [0.34]."),
    late: float = typer.Option(None, help="Depth at or above which a head is late (aggregation) [0.5]."),
    image_high: float = typer.Option(None, help="Image-attention share that counts as reading the image [0.3]."),
    image_low: float = typer.Option(None, help="Image-attention share below which a head ignores the image [0.2]."),
    vgs_min: float = typer.Option(None, help="Minimum VGS of a visual-grounding head [0.2]."),
    cter_min: float = typer.Option(None, help="Minimum CTER of routing and aggregation heads [0.5]."),
    important: float = typer.Option(None, help="Minimum importance (|patching effect|) of routing and aggregation "
                                    "heads [0.05]."),
    constant: float = typer.Option(None, help="Top-1 constancy of an awareness head [0.9]."),
    routing_from: float = typer.Option(None, help="Depth from which routing heads may sit [0]."),
    routing_to: float = typer.Option(None, help="Depth below which routing heads sit [--late]."),
    align_min: float = typer.Option(None, help="Share of samples whose top-1 token is the count, for an "
                                    "aggregation head [0: not tested]."),
    difficulty_min: float = typer.Option(None, help="Difficulty-word share that makes an awareness head [not tested]."),
) -> None:
    """Re-classify a run's heads with other thresholds; rewrites heads.csv / .md / .tex and report.md.
    Thresholds not given keep the run's (its preset's, else the defaults in brackets).

    Example: countlens classify --run runs/toy --cter-min 0.6
    """
    from countlens.analysis.heads import export_heads
    from countlens.analysis.heads import head_table
    from countlens.pipeline.rundir import load_run, read_spec
    from countlens.pipeline.report import write_report
    from countlens.pipeline.presets import thresholds as preset_thresholds

    given = _given(early=early, late=late, image_high=image_high, image_low=image_low, vgs_min=vgs_min,
                   cter_min=cter_min, important=important, constant=constant, routing_from=routing_from,
                   routing_to=routing_to, align_min=align_min, difficulty_min=difficulty_min)
    try:
        spec = read_spec(run)
        r = load_run(run)
        thresholds = preset_thresholds(spec.get("preset", ""), **given)
        table = head_table(r["heads"], r["ablation"], r["headlens"], r["attention"], thresholds)
        export_heads(table, run)
        write_report(spec["model"], spec["arch"], run, table=table)
    except CountlensError as err:
        _fail(err)
    typer.echo(table["class"].value_counts().to_string())


@app.command("report")
def report_cmd(run: Path = typer.Option(..., help="A `countlens discover` run directory.")) -> None:
    """Re-render a run's figures and report.md from its saved results.

    Example: countlens report --run runs/toy
    """
    from countlens.pipeline.rundir import read_spec
    from countlens.pipeline.report import write_report

    try:
        spec = read_spec(run)
        path = write_report(spec["model"], spec["arch"], run)
    except CountlensError as err:
        _fail(err)
    typer.echo(f"report: {path}")


@app.command("finetune")
def finetune_cmd(
    circuit: Path = typer.Option(..., help="A `countlens discover` run directory (its heads.csv and report.md)."),
    model: str = typer.Option("toy", help="The model the circuit was found in."),
    out: Path = typer.Option(None, help="Where adapters and the table go (default: CIRCUIT/finetune, with a "
                             "preset CIRCUIT/finetune-PRESET)."),
    preset: str = typer.Option(None, help="A paper's recipe: counting-circuits or counting-to-four "
                               "(countlens.pipeline.presets); the flags below override it."),
    steps: int = typer.Option(None, help="Optimiser steps per variant [300; a preset: from its epochs]."),
    epochs: float = typer.Option(None, help="Epochs over the training scenes (sets the steps); default: the preset's."),
    batch_size: int = typer.Option(None, help="[16]"),
    lr: float = typer.Option(None, help="[1e-3]"),
    lora_r: int = typer.Option(None, help="LoRA rank (alpha = 2 × rank) [32]."),
    layers: str = typer.Option(None, help="Comma-separated target layers (default: from the circuit's head classes)."),
    n_train: int = typer.Option(None, help="Training scenes [2048: half COUNTINGTRICKS, half counting scenes]."),
    n_eval: int = typer.Option(200, help="Evaluation scenes per set (COUNTINGTRICKS: n/8 per case; local copies: "
                               "their first n)."),
    fsc147: Path = typer.Option(None, help="A local FSC-147 copy: its FSC-Val / FSC-Test columns (and counting-to-four's "
                                "training data)."),
    pixmo: Path = typer.Option(None, help="A local PixMo-Count file (JSONL or parquet): its column."),
) -> None:
    """Circuit-guided LoRA fine-tunes (SFT, +focus, +MAS, +temperature) and the before/after table
    (accuracy, MAE), appended to CIRCUIT/report.md. Resumable.

    Example: countlens finetune --model toy --circuit runs/toy
    """
    from dataclasses import replace

    from countlens.pipeline import presets
    from countlens.training.finetune import read_heads
    from countlens.pipeline.finetune_job import before_after

    try:
        recipe = presets.recipe(preset or "")
    except CountlensError as err:
        _fail(CountlensError(f"--preset: {err}"))
    if epochs is not None and not epochs > 0:
        _fail(CountlensError(f"--epochs {epochs}: give a positive number"))
    if epochs is not None and steps is not None:
        _fail(CountlensError("--steps and --epochs both set the run's length; give one of them"))
    try:
        read_heads(circuit)
    except CountlensError as err:
        _fail(CountlensError(f"--circuit {circuit}: {err}"))
    out = out or circuit / (f"finetune-{preset}" if preset else "finetune")  # a preset's adapters apart
    _check_out(out)
    try:
        target = tuple(int(x) for x in layers.split(",")) if layers else ()
    except ValueError:
        _fail(CountlensError(f"--layers {layers!r}: give comma-separated integers, e.g. 0,1"))
    _check_positive(steps=steps, n_train=n_train, n_eval=n_eval, batch_size=batch_size, lora_r=lora_r)
    local = _given(fsc147=fsc147, pixmo=pixmo)
    given = _given(steps=steps, batch_size=batch_size, lr=lr, lora_r=lora_r, target_layers=target or None)
    if lora_r is not None:
        given["lora_alpha"] = 2 * lora_r
    try:
        table = before_after(model, circuit, out, overrides=given, n_train=n_train, n_eval=n_eval,
                             recipe=replace(recipe, epochs=epochs) if epochs is not None else recipe,
                             preset=preset or "", local=local, log=typer.echo)
    except CountlensError as err:
        _fail(err)
    if table is None:  # a data-parallel rank other than 0: rank 0 writes the table and the report
        return
    report = circuit / "report.md"
    if report.exists():
        from countlens.pipeline.report import FINETUNE_SECTION

        text = report.read_text().split(FINETUNE_SECTION)[0].rstrip("\n")
        section = (out / "before_after.md").read_text()
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in _given(
            preset=preset, steps=steps, epochs=epochs, batch_size=batch_size, lr=lr, lora_r=lora_r, layers=layers,
            n_train=n_train, n_eval=n_eval, fsc147=fsc147, pixmo=pixmo).items())
        report.write_text(f"{text}\n\n{FINETUNE_SECTION}\n\nCommand: `countlens finetune --model {model} "
                          f"--circuit {circuit}{' ' + flags if flags else ''}`.\n\n{section}")
    typer.echo(table.round(3).to_string())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
