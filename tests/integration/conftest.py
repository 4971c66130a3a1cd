"""One small `countlens discover` run of the organism, shared by the end-to-end tests that read a run,
one headless browser (`browser`) for the pages' tests, and `undrawn_report` for the runs whose figures
are not what a test checks.

The report, resume, fine-tune, compare, browser and sharded tests all need a finished run of the same
small spec; each ran its own before. The run is made once, through the command line, with the single
torch thread a torchrun rank gets (so the sharded test can compare ranks with it bit for bit), and kept
in the tests' disk cache under a key of every file of the package, the libraries and the CPU-kernel
settings: any edit to countlens/ makes it again. A test that changes the run copies it first
(`toy_run_copy`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from disk_cache import cached_dir, run_key
from shared_run import KERNEL_SETTINGS, TOY_RUN, discover_toy_run


@pytest.fixture
def undrawn_report(monkeypatch) -> None:
    """discover writes its report without drawing its figures, for this test: a test of what a preset,
    a family or a stage computes spends much of a small run drawing figures that the figures' own tests
    (test_figures, the shared run's report tests, test_new_architectures' drawn families) check."""
    import dataclasses

    import countlens.pipeline.report as report_module

    undrawn = tuple(dataclasses.replace(s, draw=lambda ctx: None) for s in report_module.SECTIONS)
    monkeypatch.setattr(report_module, "SECTIONS", undrawn)


@pytest.fixture(scope="session")
def toy_run() -> Path:
    """The shared run's directory: read it, don't change it."""
    kernels = tuple(os.environ.get(k, "") for k in KERNEL_SETTINGS)
    return cached_dir(run_key("toy-run", *TOY_RUN, kernels), discover_toy_run) / "run"


@pytest.fixture
def toy_run_copy(toy_run, tmp_path) -> Path:
    """A private copy of the shared run, for a test that writes into it."""
    return Path(shutil.copytree(toy_run, tmp_path / "run"))


@pytest.fixture(scope="session")
def browser():
    """One headless chromium (tests/browser.py) for the browser tests of report.html and graph.html.
    Without it they fail where CI is set (CI always runs them) and are skipped elsewhere, naming the
    packages to install."""
    from browser import chromium, missing

    lacking = missing()
    if lacking:
        message = f"the browser tests need chromium: {lacking}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with chromium() as driver:
        yield driver
