"""The notebooks under examples/ are their sources' code (rebuilt and compared), and run on the organism."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_notebooks_match_their_sources():
    build = runpy.run_path(str(EXAMPLES / "notebooks.py"))
    assert {p.name for p in NOTEBOOKS} == set(build["SOURCES"])
    for path in NOTEBOOKS:
        assert path.read_text() == build["notebook"](build["SOURCES"][path.name]), (
            f"{path.name} is out of date: run python examples/notebooks.py"
        )


@pytest.mark.slow  # a kernel per notebook, the code end to end
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert all(cell.get("outputs") is not None for cell in nb.cells if cell.cell_type == "code")
