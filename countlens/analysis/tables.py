"""Result tables in the papers' layout, written as Markdown, CSV and LaTeX.

`case_table` builds the "Counting to Four" paper's Table 5: one row per COUNTINGTRICKS case in the
canonical order of `countlens.datasets.countingtricks.CASES` (1A … 4D position, 5A–8A dilation,
9A … 15A adjacency), one column per model, accuracy in percent; then one mean row per case family
and an overall mean. Means are *macro* averages over cases (each case weighs the same, whatever its
sample count), as in the paper, taken over the cases a model was evaluated on. `case_families` gives
each case's family in either COUNTINGTRICKS design. `write_table` writes a frame as sibling ``.md``,
``.csv`` and ``.tex`` (booktabs) files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from countlens.datasets.countingtricks import CASES
from countlens.datasets.paper_generator import DILATION, REFERENCE_CASES
from countlens.errors import InputError
from countlens.validate import require_dataset

FAMILIES: tuple[str, ...] = ("position", "dilation", "adjacency")
OVERALL = "mean (all)"


def case_families(design: str = "countlens") -> pd.Series:
    """Each case of a COUNTINGTRICKS design by its family (position, dilation, adjacency), in the
    design's order: countlens's 32 cases, or the MAS paper's code's 18 circle cases (``design="paper-code"``,
    no adjacency)."""
    if design == "paper-code":
        return pd.Series({n: "dilation" if n in DILATION else "position" for n in REFERENCE_CASES}, dtype=object)
    return pd.Series({n: c.family for n, c in CASES.items()}, dtype=object)


def family_row(family: str) -> str:
    """The label of a family's mean row in `case_table`."""
    return f"mean ({family})"


def _case_accuracy(name: str, ds: xr.Dataset) -> pd.Series:
    """Accuracy (%) per case of one result; raises on cases that are not COUNTINGTRICKS cases."""
    if "case" not in ds or "correct" not in ds:
        raise InputError(
            f"result {name!r} has no 'case' or 'correct' variable; give a score() or generate() "
            "result of COUNTINGTRICKS samples"
        )
    cases = ds["case"].values.astype(str)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise InputError(
            f"result {name!r} has samples of cases {unknown} that are not COUNTINGTRICKS cases; "
            "select the COUNTINGTRICKS samples first, e.g. ds.where(ds.case != '', drop=True)"
        )
    df = pd.DataFrame({"case": cases, "correct": ds["correct"].values.astype(float)})
    return 100.0 * df.groupby("case")["correct"].mean()


def case_table(results: dict[str, xr.Dataset]) -> pd.DataFrame:
    """Accuracy (%) with COUNTINGTRICKS cases as rows and models as columns, plus family and overall means.

    ``results`` maps a model (column) name to its per-sample result over ``sample`` with ``case`` and
    ``correct``. Rows are the cases any model has, in canonical order, then ``mean (position)``,
    ``mean (dilation)``, ``mean (adjacency)`` (for the families present) and ``mean (all)``. A model
    without a case has NaN there, and its means skip that case.
    """
    if not isinstance(results, dict) or not results:
        raise InputError("no results given; pass {model name: score() or generate() result}")
    for name, ds in results.items():
        require_dataset(ds, f"results[{name!r}]", ("case", "correct"))
    cols = {name: _case_accuracy(name, ds) for name, ds in results.items()}
    present = set().union(*(c.index for c in cols.values()))
    order = [c for c in CASES if c in present]
    table = pd.DataFrame({name: acc.reindex(order) for name, acc in cols.items()}, index=order)
    means = {}
    for fam in FAMILIES:
        rows = [c for c in order if CASES[c].family == fam]
        if rows:
            means[family_row(fam)] = table.loc[rows].mean(skipna=True)
    means[OVERALL] = table.mean(skipna=True)
    out = pd.concat([table, pd.DataFrame(means).T])
    out.index.name = "case"
    out.columns.name = "model"
    return out


def _fmt(value, digits: int) -> str:
    return (
        "–"
        if value is None or (isinstance(value, float) and np.isnan(value))
        else (f"{value:.{digits}f}" if isinstance(value, (float, np.floating)) else str(value))
    )


def finite_markdown(df, **kw) -> str:
    """``df.to_markdown(**kw)`` with every NaN or ±inf cell shown as "–" (empty: no figure there), never as
    nan or inf; a table without one is rendered exactly as pandas renders it."""
    frame = df.to_frame() if isinstance(df, pd.Series) else df
    numeric = frame.select_dtypes("number")
    if numeric.empty or np.isfinite(numeric.to_numpy(dtype=float)).all():
        return df.to_markdown(**kw)
    shown = frame.astype(object).where(frame.map(_finite_cell), None)
    return shown.to_markdown(missingval="–", **kw)


def _finite_cell(value) -> bool:
    return not isinstance(value, (float, np.floating)) or bool(np.isfinite(value))


def _is_mean_row(label) -> bool:
    return str(label).startswith("mean (")


def to_markdown(df: pd.DataFrame, digits: int = 1) -> str:
    """A GitHub Markdown table; NaN shows as "–", numbers with ``digits`` decimals."""
    head = [str(df.index.name or "")] + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * len(df.columns)) + "|"]
    for label, row in df.iterrows():
        lines.append("| " + " | ".join([str(label)] + [_fmt(v, digits) for v in row]) + " |")
    return "\n".join(lines) + "\n"


def _tex(text) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#")):
        text = str(text).replace(a, b)
    return text


def to_latex(df: pd.DataFrame, digits: int = 1, bold_best: bool = True) -> str:
    """A booktabs ``tabular``: a rule before the mean rows; with ``bold_best`` each row's highest value bold."""
    cols = "l" + "r" * len(df.columns)
    head = " & ".join(_tex(x) for x in [df.index.name or ""] + list(df.columns))
    lines = [rf"\begin{{tabular}}{{{cols}}}", r"\toprule", head + r" \\", r"\midrule"]
    ruled = False
    for label, row in df.iterrows():
        if _is_mean_row(label) and not ruled:
            lines.append(r"\midrule")
            ruled = True
        values = pd.to_numeric(row, errors="coerce")
        best = values.max() if bold_best and values.notna().any() and len(values) > 1 else None
        cells = [_fmt(v, digits) for v in row]
        cells = [rf"\textbf{{{c}}}" if best is not None and v == best else c for c, v in zip(cells, values)]
        lines.append(" & ".join([_tex(label)] + [_tex(c) if not c.startswith("\\") else c for c in cells]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_table(df: pd.DataFrame, out_stem: str | Path, digits: int = 1) -> list[Path]:
    """Write ``out_stem``.md, .csv (full precision) and .tex; returns the three paths."""
    stem = Path(out_stem)
    if stem.is_dir():
        raise InputError(f"out_stem {stem} is a directory; give a file stem such as {stem / 'table5'}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ext) for ext in (".md", ".csv", ".tex")]
    paths[0].write_text(to_markdown(df, digits))
    df.to_csv(paths[1])
    paths[2].write_text(to_latex(df, digits))
    return paths
