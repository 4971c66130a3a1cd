"""``report.md`` of a discover run, and its figures, read from the run's stored results only.

Nothing here runs a model: `write_report` loads ``results/*.nc`` (`countlens.pipeline.rundir`); each
section of the registry (`countlens.pipeline.stages.SECTIONS`) measures what it states (accuracies,
the patching transition, AtP's rank agreement, the Jaccard overlaps) and draws its figures; the text
is rendered from ``templates/header.md.j2`` and ``templates/sections/`` (Jinja2: the prose is there,
the values are computed in the stage modules). ``countlens report RUN`` re-renders it.
The section `countlens finetune` appends (`FINETUNE_SECTION`) is kept when the report is rebuilt.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from countlens.analysis.evaluate import unanswered
from countlens.analysis.heads import read_heads
from countlens.pipeline.rundir import load_run, read_spec
from countlens.pipeline.stages import SECTIONS, ReportContext
from countlens.pipeline.stages.classes import preset_summary

#: The heading of the section `countlens finetune` appends, numbered after the registry's sections.
FINETUNE_SECTION = f"## {len(SECTIONS) + 1}. Circuit-guided fine-tune"

# The report's prose: templates/header.md.j2 and sections/. `fmt` formats as an f-string does (format(x, ".3f")).
_TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    keep_trailing_newline=True,
    undefined=StrictUndefined,
    autoescape=False,
)
_TEMPLATES.filters["fmt"] = format


def write_report(
    model: str, arch: str, out: str | Path, table: pd.DataFrame | None = None, prompt: str | None = None
) -> Path:
    """Figures and ``report.md`` from the results in ``out`` (``table``: the head table, else heads.csv):
    the header, then each section of the registry (`countlens.pipeline.stages.SECTIONS`), numbered."""
    out = Path(out)
    table = read_heads(out) if table is None else table  # checked before anything is drawn or written
    ctx = ReportContext(model, arch, out, read_spec(out), load_run(out), table)
    values = [section.values(ctx) for section in SECTIONS]  # every check passes before anything is drawn
    for section in SECTIONS:
        section.draw(ctx)
    header = _TEMPLATES.get_template("header.md.j2").render(
        model=model,
        arch=arch,
        prompt=prompt or ctx.spec["prompt"],
        warning=unanswered(ctx.results["cases"]),
        preset=preset_summary(ctx.spec),
    )
    parts = [header] + [
        _TEMPLATES.get_template(f"sections/{section.template}").render(number=number, **v)
        for number, (section, v) in enumerate(zip(SECTIONS, values), start=1)
    ]
    text = "\n\n".join(part.rstrip("\n") for part in parts) + "\n"
    path = out / "report.md"
    if path.exists() and FINETUNE_SECTION in path.read_text():
        # Keep the section `countlens finetune` appended: it is not rebuilt from results/.
        text = text.rstrip("\n") + "\n\n" + FINETUNE_SECTION + path.read_text().split(FINETUNE_SECTION, 1)[1]
    path.write_text(text)
    return path
