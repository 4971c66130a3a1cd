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
    assert all(
        blocks(DOCS / "tutorials" / f"{n}.md") for n in ("patch-heads", "countingtricks", "classify-heads", "finetune")
    )
    assert not blocks(DOCS / "tutorials" / "real-checkpoints.md")  # GPU / NDIF only: shown, not run


@pytest.mark.slow  # each page's code end to end
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_page_code_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(blocks(page)):
        name = f"{page.relative_to(DOCS)}[block {i}]"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # nnsight reads traced source back
        exec(compile(code, name, "exec"), namespace)  # noqa: S102


@pytest.mark.slow
def test_make_docs_fails_on_a_broken_link(tmp_path):
    """`make docs` exits non-zero and names the link when a page links to a page that does not exist
    (mkdocs' --quiet once hid the warnings --strict counts, so a broken site built green)."""
    import shutil
    import subprocess
    import sys

    repo, copy = DOCS.parent, tmp_path / "repo"
    for name in ("docs", "countlens"):
        shutil.copytree(repo / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    for name in ("Makefile", "mkdocs.yml"):
        shutil.copy2(repo / name, copy / name)
    page = copy / "docs" / "concepts" / "effect.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "mkdocs").exists(), f"mkdocs is not installed beside {sys.executable} (pip install -e '.[dev]')"
    # STAMP= : the copy has no .venv of its own; this interpreter's bin/ stands in for it.
    done = subprocess.run(
        ["make", "-s", "docs", "STAMP=", f"BIN={bin_dir}"], cwd=copy, capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0, done.stdout[-2000:]
    assert "no-such-page.md" in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
