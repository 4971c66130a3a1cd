"""Build the Jupyter notebooks under examples/ from their sources, so each is written once.

- ``your-own-experiment.ipynb`` from docs/tutorials/your-own-experiment.md (prose → markdown cells,
  each ```python block → a code cell);
- ``walkthrough.ipynb`` from the README's Python walk-through block.

Outputs are stripped (the notebooks hold code only); the tests rebuild both and compare, then execute
them on the organism. python examples/notebooks.py [--check]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
SOURCES = {
    "your-own-experiment.ipynb": ROOT / "docs" / "tutorials" / "your-own-experiment.md",
    "walkthrough.ipynb": ROOT / "README.md",
}


def cells_of(page: Path) -> list[dict]:
    """Markdown and code cells of a page; from the README, only its walk-through block."""
    text = page.read_text()
    if page.name == "README.md":
        section = text.split("## Python walk-through", 1)[1].split("\n## ", 1)[0]
        intro = "# Python walk-through\n\nThe README's walk-through on the organism, as a notebook."
        return [_cell("markdown", intro), _cell("code", BLOCK.search(section).group(1))]
    cells, at = [], 0
    for match in BLOCK.finditer(text):
        prose = text[at : match.start()].strip()
        if prose:
            cells.append(_cell("markdown", prose))
        cells.append(_cell("code", match.group(1)))
        at = match.end()
    if text[at:].strip():
        cells.append(_cell("markdown", text[at:].strip()))
    return cells


def _cell(kind: str, source: str) -> dict:
    lines = source.rstrip("\n").splitlines(True)
    cell = {"cell_type": kind, "metadata": {}, "source": lines}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def notebook(page: Path) -> str:
    nb = {
        "cells": cells_of(page),
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i}"
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(check: bool) -> int:
    stale = []
    for name, page in SOURCES.items():
        path, text = ROOT / "examples" / name, notebook(page)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python examples/notebooks.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
