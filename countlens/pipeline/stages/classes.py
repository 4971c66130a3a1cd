"""The head classes section of the report: how many heads fall in each class and the head table's top
rows, in the columns and order of ``heads.csv`` whether the table was just computed or read back by
``countlens report`` (the table itself: ``heads.csv`` / ``.md`` / ``.tex``; the rules:
`countlens.analysis.heads`).
It reads the head table, built from several stages' results, and is no stage of its own. Its
figure puts the classes on the layer × head grid; its HeadLens table shows what each class's most
important head decodes to (`key_head_tokens`), as Counting Circuits reads its key heads.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd
import xarray as xr

from countlens.analysis import plots
from countlens.analysis.heads import CLASSES, shown_columns
from countlens.analysis.tables import finite_markdown
from countlens.labels import head_label
from countlens.pipeline import presets
from countlens.pipeline.stages.base import ReportContext, Section


def preset_summary(spec: dict) -> dict | None:
    """The preset a run was set to, with the values it set (None: no preset)."""
    if not spec.get("preset"):
        return None
    chosen = presets.get(spec["preset"])
    values = {**chosen.discover, **chosen.thresholds}
    return {
        "name": chosen.name,
        "paper": chosen.paper,
        "settings": ", ".join(f"{k} = {v}" for k, v in values.items()),
    }


def _code(token: str) -> str:
    """``token`` as a markdown code span inside a table cell: quoted (spaces show), pipes escaped."""
    text = repr(token).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def key_head_tokens(table: pd.DataFrame, headlens: xr.Dataset, shown: int = 5) -> pd.DataFrame:
    """The most important head of each named class (the head table is sorted by importance) and the
    tokens HeadLens decodes it to most often: each with the share of the counting samples that have it
    among the head's top-k tokens (``headlens.attrs["top_k"]``)."""
    rows = []
    named = [c for c in CLASSES if c != "other"]
    for name in named:
        heads = table[table["class"] == name]
        if heads.empty:
            continue
        top = heads.iloc[0]
        tokens = headlens.token.sel(layer=int(top["layer"]), head=int(top["head"])).transpose("sample", "k").values
        # Once per sample (a share of samples); dict.fromkeys, not set: ties keep the decoded order,
        # the same on every run (a set's order follows the per-process string hash).
        seen = Counter(str(t) for sample in tokens for t in dict.fromkeys(sample))
        words = ", ".join(f"{_code(t)} {n / len(tokens):.2f}" for t, n in seen.most_common(shown))
        head = head_label((int(top["layer"]), int(top["head"])))
        rows.append({"head": head, "class": name, "HeadLens tokens": words})
    return pd.DataFrame(rows, columns=["head", "class", "HeadLens tokens"])


def _values(ctx: ReportContext) -> dict:
    classes = ctx.table["class"].value_counts().to_dict()
    tokens = key_head_tokens(ctx.table, ctx.results["headlens"])
    return {
        "classes_table": finite_markdown(pd.Series(classes).to_frame("heads")),
        "heads_table": finite_markdown(shown_columns(ctx.table).head(10).round(3), index=False),
        "preset": preset_summary(ctx.spec),
        "key_tokens": {
            "table": finite_markdown(tokens, index=False),
            "top_k": int(ctx.results["headlens"].attrs.get("top_k", ctx.results["headlens"].sizes["k"])),
        },
    }


def _draw(ctx: ReportContext) -> None:
    grid = ctx.results["heads"]  # the model's layer × head grid: heads the table lacks stay blank
    plots.plot_head_classes(
        ctx.table, grid["layer"].values, grid["head"].values, ctx.figures / "head_classes.png", "Head classes"
    )


SECTION = Section("classes.md.j2", _values, _draw)
