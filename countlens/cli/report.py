"""The commands that re-read a finished `countlens discover` run, running no model: ``countlens
classify`` classes its heads again under other thresholds (one option per `HeadThresholds` field,
`countlens.cli.options.with_threshold_options`), ``countlens report`` re-renders its figures and
report.md (`countlens.pipeline.report`)."""

from __future__ import annotations

import typer

from countlens.cli.options import Run, given, with_threshold_options


@with_threshold_options
def classify_cmd(run: Run, **thresholds: float | None) -> None:
    """Re-classify a run's heads with other thresholds; rewrites heads.csv / .md / .tex and report.md.
    Thresholds not given keep the run's (its preset's, else the defaults in brackets).

    Example: countlens classify --run runs/toy --cter-min 0.6
    """
    from countlens.analysis.heads import export_heads, head_table
    from countlens.pipeline.presets import thresholds as preset_thresholds
    from countlens.pipeline.report import write_report
    from countlens.pipeline.rundir import load_run, read_spec

    spec = read_spec(run)
    chosen = preset_thresholds(spec.get("preset", ""), **given(**thresholds))  # checked before the results are read
    r = load_run(run)
    table = head_table(r["heads"], r["ablation"], r["headlens"], r["attention"], chosen)
    export_heads(table, run)
    write_report(spec["model"], spec["arch"], run, table=table)
    typer.echo(table["class"].value_counts().to_string())


def report_cmd(run: Run) -> None:
    """Re-render a run's figures and report.md from its saved results.

    Example: countlens report --run runs/toy
    """
    from countlens.pipeline.report import write_report
    from countlens.pipeline.rundir import read_spec

    spec = read_spec(run)
    path = write_report(spec["model"], spec["arch"], run)
    typer.echo(f"report: {path}")
