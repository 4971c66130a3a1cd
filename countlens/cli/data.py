"""``countlens data countingtricks``: COUNTINGTRICKS images and their manifest on disk
(`countlens.datasets.export`), for countlens's 32 cases or the MAS paper code's 18, on the patch
grid of a model, of the organism, or of plain numbers (`grid_of`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import countlens
from countlens.cli.options import check_positive
from countlens.cli.paths import check_out
from countlens.errors import ConfigError
from countlens.model.geometry import Geometry
from countlens.model.shipped import is_organism
from countlens.validate import require_image_side


def grid_of(model: str, image_size: int | None, patch_size: int | None):
    """The patch grid from plain numbers, the organism's recipe (no weights needed) or a loaded model."""
    if (image_size is None) != (patch_size is None):
        raise ConfigError("give both --image-size and --patch-size, or neither (the model's grid)")
    if image_size is not None:
        if image_size < 1 or patch_size < 1:
            raise ConfigError(f"--image-size {image_size} and --patch-size {patch_size} must be positive pixel sizes")
        require_image_side(image_size, "--image-size", ConfigError)
        if image_size < patch_size:
            raise ConfigError(f"--image-size {image_size} is smaller than --patch-size {patch_size}")
        return Geometry.data_grid(image_size, patch_size)
    if is_organism(model):
        from countlens.toy.recipe import ToyConfig

        return ToyConfig().geometry
    return countlens.load(model).geometry


def data_countingtricks(
    out: Annotated[Path, typer.Option(help="Directory for images/<case>/*.png and manifest.jsonl.")],
    cases: Annotated[str | None, typer.Option(help="Comma-separated cases, e.g. 1A,4A,9B (default: all 32).")] = None,
    n: Annotated[int, typer.Option(help="Samples per case.")] = 1000,
    seed: Annotated[int, typer.Option()] = 0,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model whose patch grid places the objects.",
            show_default="toy; --design paper-code: the code's 384 px / 27 px",
        ),
    ] = None,
    image_size: Annotated[
        int | None, typer.Option(help="Plain grid instead of a model's: image side in pixels.")
    ] = None,
    patch_size: Annotated[
        int | None, typer.Option(help="Plain grid instead of a model's: patch side in pixels.")
    ] = None,
    shapes: Annotated[
        str, typer.Option(help="Comma-separated shapes the samples cycle through.")
    ] = "circle,square,triangle",
    color: Annotated[
        str, typer.Option(help="Object colour, or several comma-separated (one drawn per object).")
    ] = "red",
    prompt: Annotated[
        str,
        typer.Option(
            help="Prompt style: std (the papers' Pstd, answers 'circle: 7'), number "
            "(number only), objects, short, conflict or number_conflict "
            "(Digit-in-Conflict)."
        ),
    ] = "std",
    workers: Annotated[
        int | None, typer.Option(help="Processes (default: all cores); output is identical for any number.")
    ] = None,
    counts: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated counts the samples cycle through (default: 3…12, as the grid allows), e.g. 3,4,5."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(help="Replace a previous export in --out (only its images, manifest and export.json)."),
    ] = False,
    design: Annotated[
        str,
        typer.Option(
            help="countlens (its 32 cases) or paper-code (the MAS paper generator's 18 red-circle cases, "
            "counts 1-10, layouts shared across cases; its grid: --image-size 384 --patch-size 27)."
        ),
    ] = "countlens",
) -> None:
    """Write COUNTINGTRICKS images and a manifest with every object's geometry.

    Example: countlens data countingtricks --out runs/tricks --cases 1A,4A,9B --n 100
    """
    from rich.progress import Progress

    from countlens.datasets.countingtricks import CASES
    from countlens.datasets.export import check_export, export_countingtricks

    check_out(out)
    check_positive(n=n, workers=workers)
    try:
        wanted = None if counts is None else tuple(int(x) for x in counts.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--counts {counts!r}: give comma-separated integers, e.g. 3,4,5") from None
    if design == "paper-code" and model is None and image_size is None and patch_size is None:
        from countlens.datasets.paper_generator import reference_grid

        grid = reference_grid()  # the code's own grid
    else:
        grid = grid_of(model or "toy", image_size, patch_size)
    if design == "paper-code":
        from countlens.datasets.paper_generator import REFERENCE_CASES

        if wanted is not None or shapes not in ("circle", "circle,square,triangle") or "," in color:
            raise ConfigError(
                "--design paper-code draws one colour of circles at the code's counts (1-10); "
                "leave --counts and --shapes out and give one --color"
            )
        names = list(REFERENCE_CASES) if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
        kw = dict(color=color, prompt=prompt, design=design)
    elif design == "countlens":
        names = list(CASES) if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
        kw = dict(shapes=tuple(shapes.split(",")), color=tuple(color.split(",")), prompt=prompt, counts=wanted)
    else:
        raise ConfigError(f"--design {design!r}: use countlens or paper-code")
    check_export(out, names, n, grid, seed, workers, overwrite, **kw)  # before the progress bar
    with Progress() as bar:
        task = bar.add_task("countingtricks", total=len(names) * n)
        manifest = export_countingtricks(
            out,
            names,
            n,
            grid,
            seed,
            workers,
            overwrite=overwrite,
            progress=lambda k: bar.update(task, completed=k),
            log=typer.echo,
            **kw,
        )
    typer.echo(f"{manifest}: {len(names) * n} images")
