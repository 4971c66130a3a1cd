"""``countlens features train``: per-layer transcoders of a model's MLPs (`countlens.features`), with a
progress bar and a checkpoint a rerun resumes from; the fidelity table and the replacement model's
counting accuracy beside the original's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from countlens.cli.options import Device, Dtype, Model, check_positive
from countlens.errors import ConfigError


def features_train(
    out: Annotated[
        Path, typer.Option(help="Directory for the checkpoint, the transcoder set (transcoders/) and fidelity.nc.")
    ],
    model: Model = "toy",
    width: Annotated[int, typer.Option(help="Features per layer.")] = 512,
    k: Annotated[int, typer.Option(help="Active features per token (TopK).")] = 16,
    steps: Annotated[int, typer.Option(help="Training steps per layer.")] = 1500,
    seed: Annotated[int, typer.Option(help="Seed of the data, the initialisation and the batches.")] = 0,
    n_eval: Annotated[int, typer.Option(help="Held-out counting scenes scored by the replacement model.")] = 256,
    device: Device = None,
    dtype: Dtype = None,
) -> None:
    """Train one TopK transcoder per layer (rerun the same command to resume after an interruption).

    Example: countlens features train --model toy --out runs/transcoders
    """
    import countlens
    from countlens.datasets.tasks import task_samples
    from countlens.features import replacement_accuracy, train_transcoders

    check_positive(width=width, k=k, steps=steps, n_eval=n_eval)
    if k > width:
        raise ConfigError(f"--k {k} exceeds --width {width}: give k ≤ width")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory")
    vlm = countlens.load(model, dtype=dtype, device_map=device)
    run = train_transcoders(vlm, width=width, k=k, steps=steps, seed=seed, out=out, progress=True)
    typer.echo(run.fidelity[["fvu", "l0", "dead"]].to_dataframe().round(4).to_string())
    acc = replacement_accuracy(vlm, run.transcoders, task_samples("count", n_eval, seed=0))
    for name in acc.model.values:
        typer.echo(f"counting accuracy, {name}: {float(acc.accuracy.sel(model=name)):.3f}")
    typer.echo(f"saved to {out / 'transcoders'}")
