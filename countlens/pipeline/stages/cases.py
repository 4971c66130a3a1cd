"""COUNTINGTRICKS accuracy per case, and Digit-in-Conflict on the position cases.

``cases`` answers the run's COUNTINGTRICKS design (countlens's 32 cases, or the MAS paper's code's 18
with ``design="paper-code"``); ``conflict_std`` and ``conflict`` ask about the same position-case
images without and with a distractor digit in the prompt. The report's section gives accuracy per
case family, number avoidance (Pearson r between the count and its accuracy) and how often the
distractor is answered.
"""

from __future__ import annotations

import pandas as pd

from countlens.analysis import plots
from countlens.analysis.metrics import accuracy, digit_in_conflict, number_avoidance, summary, unanswered
from countlens.analysis.tables import case_families, finite_markdown
from countlens.errors import RunDirError
from countlens.pipeline.config import conflict_styles
from countlens.pipeline.stages.base import ReportContext, RunContext, Section, Stage


def answered_cases(run: RunContext) -> tuple:
    """(the cases stage's stored answers, the run's case samples), refused where the two disagree in
    number (a cases.nc written by another countlens): what a later stage that reads both starts from."""
    cases = run.results["cases"]
    samples = run.inputs["cases"]()
    if len(samples) != cases.sizes["sample"]:
        raise RunDirError(
            f"{run.out}/results/cases.nc holds {cases.sizes['sample']} answers but the run's cases are "
            f"{len(samples)} samples: it was written by another countlens; delete it and rerun discover"
        )
    return cases, samples


def _warn_unanswered(run: RunContext, cases) -> None:
    warning = unanswered(cases)
    if warning:  # the report repeats it at its top
        run.log(f"warning: on COUNTINGTRICKS, {warning}")


CASES = Stage(
    "cases",
    inputs=("cases",),
    compute=lambda run: run.answers(run.inputs["cases"](), progress=True),
    plan=lambda p: p.score("cases", p.samples("cases")),
    check=_warn_unanswered,
    variables={"correct": ("sample",), "case": ("sample",)},
)
# Digit-in-Conflict: the same position-case images under Pstd and with a distractor digit.
CONFLICT_STD = Stage(
    "conflict_std",
    inputs=("conflict_std",),
    compute=lambda run: run.answers(run.inputs["conflict_std"](), stage="conflict_std"),
    plan=lambda p: p.score("conflict_std", p.samples("conflict_std")),
    variables={"correct": ("sample",), "case": ("sample",)},
)
CONFLICT = Stage(
    "conflict",
    inputs=("conflict",),
    compute=lambda run: run.answers(run.inputs["conflict"](), stage="conflict"),
    plan=lambda p: p.score("conflict", p.samples("conflict")),
    variables={"correct": ("sample",), "case": ("sample",)},
)


def _families(ctx: ReportContext) -> pd.Series:
    """Each case of the run's design by its family (position, dilation, adjacency)."""
    return case_families(ctx.spec.get("design", "countlens"))


def _by_case(ctx: ReportContext) -> pd.Series:
    family = _families(ctx)
    return accuracy(ctx.results["cases"], "case")["accuracy"].reindex(list(family.index))


def _avoidance(ctx: ReportContext) -> dict:
    """Number avoidance over the cases' counting samples (`number_avoidance`): r, per count, n."""
    cases = ctx.results["cases"]
    return number_avoidance(cases.where(cases["count"] >= 0, drop=True))


#: The fewest samples behind an accuracy the report presents as a rate (per case, per count): with
#: fewer, an accuracy is a handful of single answers, and r over the counts is noise or undefined.
MIN_PER_COUNT = 5


def _unmeasured(avoid: dict) -> str:
    """Why number avoidance's r is not a finding ("" when it is): too few counts, too few samples at
    some count, or the same accuracy at every count (r undefined)."""
    n = avoid["n"]
    if len(n) < 2 or min(n.values()) < MIN_PER_COUNT:
        return (
            f"not measured: {sum(n.values())} counting samples over {len(n)} counts, {min(n.values())} at the "
            f"fewest; r needs at least 2 counts with {MIN_PER_COUNT} samples each (run with a larger --n-per-case)"
        )
    if avoid["r"] != avoid["r"]:  # NaN with enough samples: accuracy does not vary with the count
        return "undefined: the accuracy is the same at every count"
    return ""


def _values(ctx: ReportContext) -> dict:
    r, spec = ctx.results, ctx.spec
    cases = r["cases"]
    avoid = _avoidance(ctx)
    overall = summary(cases).loc["all"]
    dic = digit_in_conflict(r["conflict_std"], r["conflict"])
    by_case = _by_case(ctx)
    fam_acc = by_case.groupby(_families(ctx)).mean()
    return {
        "family": {f: fam_acc.get(f, float("nan")) for f in ("position", "dilation", "adjacency")},
        "design": spec.get("design", "countlens"),
        "n_cases": int(cases.sizes["sample"]),
        "overall": {"accuracy": overall["accuracy"], "mae": overall["mae"], "unparsed": overall["unparsed"]},
        "evaluation": spec.get("evaluate", "score"),
        "max_new_tokens": spec.get("max_new_tokens"),
        "case_table": finite_markdown(by_case.to_frame().T.round(2), index=False),
        "avoidance": {
            "r": avoid["r"],
            "per_count": ", ".join(f"{k}: {v:.2f}" for k, v in avoid["per_count"].items()),
            "unmeasured": _unmeasured(avoid),
        },
        "per_case": int(spec.get("n_per_case", MIN_PER_COUNT)),
        "min_per_count": MIN_PER_COUNT,
        "conflict": {**dic, "style": conflict_styles(ctx.model)[0]},
    }


def _draw(ctx: ReportContext) -> None:
    by_case = _by_case(ctx)
    plots.plot_bars(by_case, ctx.figures / "cases.png", "COUNTINGTRICKS accuracy per case")
    plots.plot_case_grid(by_case, ctx.figures / "case_grid.png")
    avoid = _avoidance(ctx)
    plots.plot_accuracy_by_count(avoid["per_count"], avoid["n"], avoid["r"], ctx.figures / "accuracy_by_count.png")


SECTION = Section("cases.md.j2", _values, _draw)
