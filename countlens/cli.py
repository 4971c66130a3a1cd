"""The `countlens` command line: every command is a thin call into the packages."""

from __future__ import annotations

from pathlib import Path

import typer

from countlens.errors import CountlensError

app = typer.Typer(no_args_is_help=True, help="countlens: counting as a probe of how VLMs reason.")
toy_app = typer.Typer(no_args_is_help=True, help="The shipped model organism: train it from scratch.")
app.add_typer(toy_app, name="toy")


def _fail(err: Exception) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
