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
    import countlens
    from countlens.analysis import accuracy, score
    from countlens.datasets.tasks import TASKS, TRAIN_SEED_BASE, task_samples

    if out is not None and out.exists() and not out.is_dir():
        _fail(CountlensError(f"--out {out} is a file; give a directory"))
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
    by_task = accuracy(ds, "task")
    counting = ds.where(ds.task == "count", drop=True)
    by_count = accuracy(counting, "count")
    by_count.index = by_count.index.astype(int)
    upto10 = float(counting.correct.where(counting["count"] <= 10, drop=True).mean())
    text = (
        f"# Held-out accuracy of {model} (seed {seed})\n\n"
        f"Counting, N ≤ 10: **{upto10:.3f}**\n\n## Per task\n\n{by_task.to_markdown(floatfmt=('g', '.3f', 'g'))}\n\n"
        f"## Counting, per N\n\n{by_count.to_markdown(floatfmt=('g', '.3f', 'g'))}\n"
    )
    typer.echo(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        ds.to_dataframe().to_csv(out / "samples.csv")
        (out / "accuracy.md").write_text(text)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
