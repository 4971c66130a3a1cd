"""``countlens toy train``: the shipped model organism, trained from scratch with its recipe
(`countlens.toy.train`), a progress bar showing the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import countlens
from countlens.cli.options import TOY_TRAIN, shown
from countlens.cli.paths import check_out
from countlens.errors import ConfigError


def toy_train(
    out: Annotated[Path, typer.Option(help="Directory to write the HF checkpoint, recipe and training log into.")],
    seed: Annotated[int, typer.Option(help="Seed of the initialisation and of the training scenes.")] = TOY_TRAIN[
        "seed"
    ],
    steps: Annotated[
        int | None,
        typer.Option(
            help="Override the recipe's number of steps (e.g. for a quick check).",
            show_default=shown(TOY_TRAIN["steps"]),
        ),
    ] = None,
) -> None:
    """Train the organism deterministically (about 25 min on 2 CPU cores).

    Example: countlens toy train --seed 0 --out runs/toy-model
    """
    from dataclasses import replace

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from countlens.toy.recipe import ToyConfig, TrainConfig
    from countlens.toy.train import train

    check_out(out)
    tc = TrainConfig(seed=seed)
    if steps is not None:
        tc = replace(tc, steps=steps)  # TrainConfig checks its ranges: before anything is written
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
        TimeElapsedColumn(),
    ) as bar:
        task = bar.add_task("train", total=tc.steps, info="")

        def report(row: dict) -> None:
            bar.update(
                task,
                completed=row["step"] + 1,
                info=f"loss {row['loss']:.3f}"
                + (f" held-out {row['held_out_acc']:.3f}" if "held_out_acc" in row else ""),
            )

        last = train(out, ToyConfig(), tc, progress=report)
    typer.echo(f"saved to {out}: {last}")


def toy_plant(
    circuit: Annotated[
        str,
        typer.Option(
            help="The circuit to plant: route, two-hop, spread, mlp, top-half (objects) or value-route (edges)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Directory for the checkpoint, training log and planted.json.")],
    seed: Annotated[int, typer.Option(help="Seed of torch and of the training pairs.")] = 0,
    steps: Annotated[
        int | None,
        typer.Option(
            help="Override the circuit's number of steps (of its first stage, where it has two).",
            show_default="the circuit's",
        ),
    ] = None,
) -> None:
    """Train a planted-circuit organism from the shipped one and verify it (figures in planted.json).

    Example: countlens toy plant --circuit route --out runs/planted-route
    """
    import json
    from dataclasses import replace

    from countlens.toy.plant import PlantConfig, plant
    from countlens.toy.planted import CIRCUITS, EDGE_CIRCUITS

    known = (*CIRCUITS, "top-half", *EDGE_CIRCUITS)
    if circuit not in known:  # before anything is written
        raise ConfigError(f"--circuit {circuit!r}: no such planted circuit; choose one of {', '.join(known)}")
    if circuit in EDGE_CIRCUITS:
        from countlens.toy.edge_plant import plant_edges

        check_out(out)
        spec = EDGE_CIRCUITS[circuit]
        pc = PlantConfig(seed=seed, steps=spec.steps if steps is None else steps)
        record = plant_edges(out, spec, pc, progress=lambda row: typer.echo(json.dumps(row)))
        checks = {"edges": record["fresh_checks"], "nodes": record["fresh_node_checks"]}
        typer.echo(json.dumps({"figures": record["fresh"], "checks": checks}, indent=2))
        return
    if circuit == "top-half":
        check_out(out)
        record = plant_top_half(out, seed, steps)
        typer.echo(json.dumps({"figures": record["fresh"], "checks": record["fresh_checks"]}, indent=2))
        return
    spec = CIRCUITS[circuit]
    check_out(out)
    pc = replace(PlantConfig(seed=seed), steps=spec.steps if steps is None else steps)
    record = plant(out, spec, pc, progress=lambda row: typer.echo(json.dumps(row)))
    typer.echo(json.dumps({"figures": record["figures"], "checks": record["checks"]}, indent=2))


def plant_top_half(out: Path, seed: int, steps: int | None) -> dict:
    """The top-half organism (`countlens.toy.regions`) trained into ``out``, its planted.json completed
    with the object-level figures: exact object effects (removed reference, at the input) on 64 fresh
    scenes scored against the objects it counts by design."""
    import json

    from countlens.circuits.graph.recovery import object_recovery
    from countlens.circuits.objects.effects import object_effects
    from countlens.circuits.sites import Residual
    from countlens.toy.regions import REGION_RECIPE, plant_regions, region_checks, top_half_sample
    from countlens.toy.strictness import FRESH_SEED

    steps = REGION_RECIPE["steps"] if steps is None else steps
    record = plant_regions(out, steps=steps, seed=seed, progress=lambda row: typer.echo(json.dumps(row)))
    vlm = countlens.load(str(out))
    scenes = [top_half_sample(FRESH_SEED, i) for i in range(64)]
    record["fresh"]["objects"] = object_recovery(object_effects(vlm, scenes, "removed", Residual(-1)).effect, scenes)
    record["fresh_checks"] = region_checks(record["fresh"])
    (out / "planted.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
