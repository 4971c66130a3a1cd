"""The commands that read a model as it is: ``countlens eval`` scores it on held-out scenes
(`countlens.pipeline.held_out`), ``countlens check`` proves countlens reads it right
(`countlens.pipeline.selfcheck`); and ``countlens model tiny`` writes a tiny random-init model of a
family to try them on (`countlens.toy.tiny_models`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import countlens
from countlens.cli.options import Device, Dtype, Model, check_positive
from countlens.cli.paths import check_file_out, check_out
from countlens.errors import ConfigError


def eval_cmd(
    model: Model = "toy",
    out: Annotated[
        Path | None, typer.Option(help="Directory for samples.csv and accuracy.md (nothing written if omitted).")
    ] = None,
    n: Annotated[int, typer.Option(help="Counting scenes to score (each other task gets n/4).")] = 600,
    seed: Annotated[int, typer.Option(help="Evaluation seed (< 1000: never a training seed of the organism).")] = 1,
    batch_size: Annotated[int, typer.Option()] = 32,
    device: Device = None,
    dtype: Dtype = None,
) -> None:
    """Score a model on held-out task scenes: accuracy per task and, for counting, per count.

    Example: countlens eval --model toy --out runs/eval
    """
    from countlens.datasets.tasks import TRAIN_SEED_BASE
    from countlens.pipeline.held_out import accuracy_report, held_out_scores, write_held_out

    check_out(out)
    check_positive(n=n, batch_size=batch_size)
    if not 0 <= seed < TRAIN_SEED_BASE:
        raise ConfigError(
            f"--seed {seed}: evaluation seeds are 0..{TRAIN_SEED_BASE - 1}; larger ones are the "
            "organism's training scenes"
        )
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    ds = held_out_scores(vlm, n, seed, batch_size)
    text = accuracy_report(ds, model, seed)
    typer.echo(text)
    if out is not None:
        write_held_out(out, ds, text)


def check_cmd(
    model: Model = "toy",
    device: Device = None,
    dtype: Dtype = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the table as JSON here.")] = None,
) -> None:
    """Prove that countlens reads this checkpoint right: the spec, the image-token layout, the
    answers, the interventions' invariants and the memory plan, one row per check (read-only).
    Exits 1 when a check fails.

    Example: countlens check --model /models/Qwen2.5-VL-7B-Instruct --device cuda --dtype bfloat16
    """
    import json

    from countlens.pipeline.selfcheck import as_json, check, failed, table

    check_file_out(json_out, "--json")
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    rows = check(vlm)
    typer.echo(table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps(as_json(rows), indent=1))
    bad = failed(rows)
    typer.echo(f"{len(rows) - len(bad)} of {len(rows)} checks passed or skipped; {len(bad)} failed")
    if bad:
        raise typer.Exit(1)


def tiny_cmd(
    family: Annotated[
        str,
        typer.Option(
            help="The tiny model to write: a name of the registry, as the example below (a name it lacks is "
            "refused with the list of all)."
        ),
    ],
    out: Annotated[
        Path, typer.Option(help="Folder to write the checkpoint into (new or empty); countlens.load(OUT) opens it.")
    ],
) -> None:
    """Write a tiny random-init model of a family as a checkpoint folder, to try the family offline
    (random weights: its shapes, layout, tokenizer and code paths, not its answers). Seconds on a CPU.

    Example: countlens model tiny --family gemma3 --out runs/tiny-gemma3
    """
    from countlens.toy.tiny_models import check_name, save

    check_name(family)
    check_out(out)
    folder = save(family, out)
    typer.echo(
        f"wrote a tiny random-init {family} to {folder}: countlens.load({str(folder)!r}) opens it, "
        f"countlens check --model {folder} checks it"
    )
