"""``countlens compare``: finished `countlens discover` runs side by side, running no model
(`countlens.analysis.compare.compare_runs`: what it reads, checks and writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from countlens.cli.paths import check_out


def compare_cmd(
    runs: Annotated[list[Path], typer.Argument(help="The `countlens discover` run directories to compare.")],
    out: Annotated[Path, typer.Option(help="Where compare.md, compare.html, the CSV / LaTeX tables and figures/ go.")],
    allow_mixed: Annotated[
        bool,
        typer.Option("--allow-mixed", help="Compare runs that differ in protocol; compare.md says how they differ."),
    ] = False,
    top_k: Annotated[int, typer.Option(help="Top heads shown per relative-depth bin.", min=1)] = 3,
) -> None:
    """Compare finished runs: accuracy per case, number avoidance, Digit-in-Conflict, the VAP hand-off
    and the head classes on relative depth, faithfulness, MAS and probe AP, one row per model; compare.md
    and the same as one self-contained page, compare.html.

    Example: countlens compare runs/toy runs/qwen --out runs/compare
    """
    from countlens.analysis.compare import compare_runs

    check_out(out)
    path = compare_runs(runs, out, allow_mixed=allow_mixed, k=top_k)
    typer.echo(f"comparison: {path} (and {path.with_suffix('.html').name} beside it)")
