"""``countlens finetune``: circuit-guided fine-tunes of a model and their before/after table
(`countlens.pipeline.finetune_job.before_after`), put into the circuit's report.md with the command
line that made them (`countlens.pipeline.report.add_finetune_section`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from countlens.cli.options import FINETUNE, RECIPE, check_positive, given, shown
from countlens.cli.paths import check_out
from countlens.errors import ConfigError, CountlensError, RunDirError


def finetune_cmd(
    circuit: Annotated[Path, typer.Option(help="A `countlens discover` run directory (its heads.csv and report.md).")],
    model: Annotated[str, typer.Option(help="The model the circuit was found in.")] = "toy",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where adapters and the table go (default: CIRCUIT/finetune, with a preset CIRCUIT/finetune-PRESET)."
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="A paper's recipe: counting-circuits or counting-to-four "
            "(countlens.pipeline.presets); the flags below override it."
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Optimiser steps per variant.", show_default=f"{FINETUNE['steps']}; a preset: from its epochs"
        ),
    ] = None,
    epochs: Annotated[
        float | None, typer.Option(help="Epochs over the training scenes (sets the steps); default: the preset's.")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Global batch.", show_default=shown(FINETUNE["batch_size"]))
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate.", show_default=shown(FINETUNE["lr"]))] = None,
    lora_r: Annotated[
        int | None, typer.Option(help="LoRA rank (alpha = 2 × rank).", show_default=shown(FINETUNE["lora_r"]))
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(
            help="lora (adapters on the language model's attention) or full (every language-model weight; "
            "the MAS paper's script).",
            show_default="lora; a preset: its own",
        ),
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="Comma-separated target layers (default: from the circuit's head classes).")
    ] = None,
    n_train: Annotated[
        int | None,
        typer.Option(
            help="Training scenes.", show_default=f"{RECIPE['n_train']}: half COUNTINGTRICKS, half counting scenes"
        ),
    ] = None,
    n_eval: Annotated[
        int, typer.Option(help="Evaluation scenes per set (COUNTINGTRICKS: n/8 per case; local copies: their first n).")
    ] = 200,
    fsc147: Annotated[
        Path | None,
        typer.Option(
            help="A local FSC-147 copy: its FSC-Val / FSC-Test columns (and counting-to-four's training data)."
        ),
    ] = None,
    pixmo: Annotated[Path | None, typer.Option(help="A local PixMo-Count file (JSONL or parquet): its column.")] = None,
    mmmu: Annotated[
        Path | None,
        typer.Option(help="A local MMMU copy (its parquet files, or a folder of them): MMMU columns, both ways."),
    ] = None,
    realworldqa: Annotated[
        Path | None,
        typer.Option(help="A local RealWorldQA copy (parquet, or a folder of them): its columns, both ways."),
    ] = None,
    mathvista: Annotated[
        Path | None,
        typer.Option(help="A local MathVista testmini (parquet / JSON, or its folder): its columns, both ways."),
    ] = None,
) -> None:
    """Circuit-guided LoRA fine-tunes (SFT, +focus, +MAS, +temperature) and the before/after table
    (accuracy, MAE), appended to CIRCUIT/report.md. Resumable.

    Example: countlens finetune --model toy --circuit runs/toy
    """
    from dataclasses import replace

    from countlens.analysis.heads import read_heads
    from countlens.pipeline import presets
    from countlens.pipeline.finetune_job import before_after
    from countlens.pipeline.report import add_finetune_section

    try:
        recipe = presets.recipe(preset or "")
    except CountlensError as err:
        raise ConfigError(f"--preset: {err}") from None
    if epochs is not None and not epochs > 0:
        raise ConfigError(f"--epochs {epochs}: give a positive number")
    if epochs is not None and steps is not None:
        raise ConfigError("--steps and --epochs both set the run's length; give one of them")
    try:
        read_heads(circuit)
    except CountlensError as err:
        raise RunDirError(f"--circuit {circuit}: {err}") from None
    out = out or circuit / (f"finetune-{preset}" if preset else "finetune")  # a preset's adapters apart
    if out.resolve() == circuit.resolve():
        raise ConfigError(
            f"--out {out} is the discover run itself (--circuit): the adapters and the table would mix with its "
            "results; give a folder of its own (the default is CIRCUIT/finetune)"
        )
    check_out(out)
    try:
        target = tuple(int(x) for x in layers.split(",")) if layers else ()
    except ValueError:
        raise ConfigError(f"--layers {layers!r}: give comma-separated integers, e.g. 0,1") from None
    check_positive(steps=steps, n_train=n_train, n_eval=n_eval, batch_size=batch_size, lora_r=lora_r)
    local = given(fsc147=fsc147, pixmo=pixmo, mmmu=mmmu, realworldqa=realworldqa, mathvista=mathvista)
    overrides = given(
        steps=steps, batch_size=batch_size, lr=lr, lora_r=lora_r, target_layers=target or None, method=method
    )
    if lora_r is not None:
        overrides["lora_alpha"] = 2 * lora_r
    table = before_after(
        model,
        circuit,
        out,
        overrides=overrides,
        n_train=n_train,
        n_eval=n_eval,
        recipe=replace(recipe, epochs=epochs) if epochs is not None else recipe,
        preset=preset or "",
        local=local,
        log=typer.echo,
    )
    if table is None:  # a data-parallel rank other than 0: rank 0 writes the table and the report
        return
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in given(
            preset=preset,
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            lora_r=lora_r,
            method=method,
            layers=layers,
            n_train=n_train,
            n_eval=n_eval,
            fsc147=fsc147,
            pixmo=pixmo,
            mmmu=mmmu,
            realworldqa=realworldqa,
            mathvista=mathvista,
        ).items()
    )
    command = f"countlens finetune --model {model} --circuit {circuit}{' ' + flags if flags else ''}"
    add_finetune_section(circuit, out, command)  # when the circuit's run has a report.md
    typer.echo(table.round(3).to_string())
