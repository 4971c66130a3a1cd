"""The documentation's code runs as written: every ```python block of the tutorials and concept pages,
in order, one namespace per page, in a scratch directory (blocks after a ``<!-- not run`` comment are
skipped: they need a GPU, weights or an NDIF key)."""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted([*DOCS.glob("tutorials/*.md"), *DOCS.glob("concepts/*.md")])
BLOCK = re.compile(r"(<!-- not run[^>]*-->\s*)?```python\n(.*?)```", re.S)


def blocks(page: Path) -> list[str]:
    return [code for skip, code in BLOCK.findall(page.read_text()) if not skip]


def test_every_tutorial_page_is_collected():
    names = {p.stem for p in PAGES}
    assert {"patch-heads", "countingtricks", "classify-heads", "finetune", "real-checkpoints"} <= names
    assert all(blocks(DOCS / "tutorials" / f"{n}.md") for n in ("patch-heads", "countingtricks", "classify-heads",
                                                                 "finetune"))
    assert not blocks(DOCS / "tutorials" / "real-checkpoints.md")  # GPU / NDIF only: shown, not run


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_page_code_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(blocks(page)):
        name = f"{page.relative_to(DOCS)}[block {i}]"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # nnsight reads traced source back
        exec(compile(code, name, "exec"), namespace)  # noqa: S102
