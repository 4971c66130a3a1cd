"""The spec of the organism run that the end-to-end tests share (`conftest.toy_run`), and its maker."""

from __future__ import annotations

from pathlib import Path

from launch import one_thread_here

#: The shared run's spec: 8 pairs in chunks of 4, so that two ranks each own chunks of every sweep.
TOY_RUN = ["--model", "toy", "--n-per-case", "1", "--n-pairs", "8", "--n-samples", "8", "--batch-size", "4"]
KERNEL_SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def discover_toy_run(path: Path) -> None:
    from typer.testing import CliRunner

    from countlens.cli import app

    with one_thread_here():
        done = CliRunner().invoke(app, ["discover", *TOY_RUN, "--out", str(path / "run")])
    assert done.exit_code == 0, done.output
