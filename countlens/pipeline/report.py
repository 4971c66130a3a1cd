"""``report.md`` of a discover run, and its figures, read from the run's stored results only.

Nothing here runs a model: `write_report` loads ``results/*.nc`` (`countlens.pipeline.rundir`); each
section of the registry (`countlens.pipeline.stages.SECTIONS`) measures what it states (accuracies,
the patching transition, AtP's rank agreement, the Jaccard overlaps) and draws its figures; the text
is rendered from ``templates/header.md.j2`` and ``templates/sections/`` (Jinja2: the prose is there,
the values are computed in the stage modules). The header gives the pairs' clean × corrupt count
table, and a section whose stage divided by a normaliser below the noise rule is marked under its
heading (``templates/noise.md.j2``; `countlens.pipeline.report_notes`). ``countlens report RUN``
re-renders it.
``report.html`` beside it is the same report as one self-contained page with an interactive head grid
(`countlens.pipeline.html_report`). `countlens finetune` puts its before/after table into the report
(`add_finetune_section`, both files); that section (`FINETUNE_SECTION`) is kept when the report is
rebuilt. `splice_finetune_section` does both splices.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from countlens.analysis.heads import read_heads
from countlens.analysis.metrics import unanswered
from countlens.pipeline.html_report import write_html
from countlens.pipeline.report_notes import noisy_stages, pairs_values, with_mark
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
    pairs = pairs_values(ctx.results)
    for section in SECTIONS:
        section.draw(ctx)
    header = header_text(ctx, prompt or ctx.spec["prompt"], pairs)
    parts = [header] + [
        with_mark(
            _TEMPLATES.get_template(f"sections/{section.template}").render(number=number, **v),
            noise_mark(ctx.results, section.stages),
        )
        for number, (section, v) in enumerate(zip(SECTIONS, values), start=1)
    ]
    text = "\n\n".join(part.rstrip("\n") for part in parts) + "\n"
    path = out / "report.md"
    kept = path.read_text() if path.exists() else ""
    if FINETUNE_SECTION in kept:  # the section `countlens finetune` wrote is not rebuilt from results/
        text = splice_finetune_section(text, kept[kept.index(FINETUNE_SECTION) :])
    path.write_text(text)
    write_html(ctx, text)
    return path


def header_text(ctx: ReportContext, prompt: str, pairs: dict | None) -> str:
    """The report's header: title, prompt, preset, the pairs' count table (``pairs``: `pairs_values`),
    and the mark of any noisy stage that no section shows (so none goes unsaid)."""
    header = _TEMPLATES.get_template("header.md.j2").render(
        model=ctx.model,
        arch=ctx.arch,
        prompt=prompt,
        warning=unanswered(ctx.results["cases"]),
        preset=preset_summary(ctx.spec),
        pairs=pairs,
    )
    placed = {s for section in SECTIONS for s in section.stages}
    unplaced = noise_mark(ctx.results, sorted(set(ctx.results) - placed))
    return header.rstrip("\n") + "\n\n" + unplaced if unplaced else header


def noise_mark(results: dict, stages) -> str:
    """The mark (``templates/noise.md.j2``) of each of ``stages`` whose normaliser is below the noise
    rule, as markdown; "" when none is."""
    return _TEMPLATES.get_template("noise.md.j2").render(noisy=noisy_stages(results, stages)).strip()


def splice_finetune_section(report: str, section: str) -> str:
    """``report`` with ``section`` (the text from `FINETUNE_SECTION` on) as its fine-tune section: in
    place of the one it has, else after its end."""
    return report.split(FINETUNE_SECTION, 1)[0].rstrip("\n") + "\n\n" + section


def add_finetune_section(run: str | Path, finetune_out: str | Path, command: str) -> Path | None:
    """Put the before/after table of a fine-tune (``finetune_out/before_after.md``, written by
    `countlens.pipeline.finetune_job.before_after`) into ``run``'s report.md, under `FINETUNE_SECTION`
    with the ``command`` that made it; an earlier fine-tune's section is replaced. Returns the report's
    path, or None (nothing written) when the run has no report."""
    path = Path(run) / "report.md"
    if not path.exists():
        return None
    table = (Path(finetune_out) / "before_after.md").read_text()
    section = f"{FINETUNE_SECTION}\n\nCommand: `{command}`.\n\n{table}"
    text = splice_finetune_section(path.read_text(), section)
    path.write_text(text)
    if (path.parent / "report.html").exists():  # the page shows the report as it now reads
        spec = read_spec(run)
        ctx = ReportContext(spec["model"], spec["arch"], Path(run), spec, load_run(run), read_heads(run))
        write_html(ctx, text)
    return path
