"""The head classes section of the report: how many heads fall in each class and the head table's top
rows, in the columns and order of ``heads.csv`` whether the table was just computed or read back by
``countlens report`` (the table itself: ``heads.csv`` / ``.md`` / ``.tex``; the rules:
`countlens.analysis.heads`).
It reads the head table, built from several stages' results, and is no stage of its own.
"""

from __future__ import annotations

import pandas as pd

from countlens.analysis.heads import shown_columns
from countlens.pipeline.stages.base import ReportContext, Section


def preset_summary(spec: dict) -> dict | None:
    """The preset a run was set to, with the values it set (None: no preset)."""
    if not spec.get("preset"):
        return None
    from countlens.pipeline import presets

    chosen = presets.get(spec["preset"])
    values = {**chosen.discover, **chosen.thresholds}
    return {
        "name": chosen.name,
        "paper": chosen.paper,
        "settings": ", ".join(f"{k} = {v}" for k, v in values.items()),
    }


def _values(ctx: ReportContext) -> dict:
    classes = ctx.table["class"].value_counts().to_dict()
    return {
        "classes_table": pd.Series(classes).to_frame("heads").to_markdown(),
        "heads_table": shown_columns(ctx.table).head(10).round(3).to_markdown(index=False),
        "preset": preset_summary(ctx.spec),
    }


SECTION = Section("classes.md.j2", _values)
