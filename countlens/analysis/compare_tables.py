"""The tables of `countlens compare`, one function per table, each computed from the runs' stored
results only (`countlens.analysis.runs.StoredRun`) with the same functions the runs' own reports use.

Every function returns ``(table, notes)``: a DataFrame with one row per run (or per run and item) and
the sentences that say which runs lack the result a table reads — their cells are left empty (NaN)
rather than refused, since a run may predate a stage or leave an optional one out.

- `accuracy_table`: the "Counting to Four" paper's Table 5 layout turned so that rows are models and
  columns are COUNTINGTRICKS cases (in the design's order), then the family means (position,
  dilation, adjacency) and the mean over all cases — macro means over the cases a run has, as
  `countlens.analysis.tables.case_table` takes them. Accuracy is a fraction (0 … 1).
- `counting_table`: accuracy over all COUNTINGTRICKS samples, the number-avoidance r
  (`countlens.analysis.metrics.number_avoidance` over the counting samples) and Digit-in-Conflict
  (`digit_in_conflict`: accuracy without and with the distractor, the drop, the share of answers
  that repeat the hinted digit).
- `handoff_table`: the VAP hand-off on relative depth (`countlens.analysis.depth.handoff`).
- `mas_table`: MAS (the answer position's attention share on image tokens, `attention_metrics.aggregate`,
  mean over layers and samples) for all, right and wrong answers; with the MAS code's token sets
  (``attention_at="generation"``), its 4-way share (special, system, image and text tokens) too.
- `probes_table`: the detection probes' AP@50 per tap (the optional ``probes`` stage: the MAS
  paper's code's probes on its three taps), "Counting to Four"'s Figure 4 as a table.
- `faithfulness_table`: per ranking of the heads, CPR, CMD and the smallest circuit reaching
  `FAITHFUL` (as a fraction of the heads and in heads), the report's faithfulness table.
- `placement_table`: per model and placement class (centred, edge, intersection, all), the objects'
  mean effect on the count answer and the missed rate on wrongly answered scenes, with their 95 %
  intervals and the chance rate (`countlens.analysis.object_misses.run_misses` of the ``objects``
  stage); a run without that result gets one "not run" row, one whose model had no object to measure
  a "not measured" row, each with a note.
- `class_table` and `top_heads_table`: head classes per relative-depth bin and each bin's top heads
  (`countlens.analysis.depth`).
"""

from __future__ import annotations

import math

import pandas as pd

from countlens.analysis import depth
from countlens.analysis.attention_metrics import aggregate
from countlens.analysis.metrics import accuracy, digit_in_conflict, number_avoidance, summary
from countlens.analysis.object_misses import PLACEMENT_ROWS, run_misses
from countlens.analysis.runs import MEASURED, StoredRun
from countlens.analysis.tables import FAMILIES, OVERALL, case_families, family_row
from countlens.circuits.graph.faithfulness import smallest_faithful
from countlens.errors import RunDirError
from countlens.reference.counting_to_four.attention import SETS, modality_shares
from countlens.validate import require_finite_tensor

#: The faithfulness a circuit must reach in `faithfulness_table` (the report's level).
FAITHFUL = 0.8

_SAMPLE, _SCENE_OBJECT = ("sample",), ("scene", "object")
#: What the tables read of each stage's result: each variable and its dims. `check_reads` refuses a run
#: whose stored result lacks one (renamed, edited, another program's) before any table is made.
READS: dict[str, dict[str, tuple[str, ...]]] = {
    "cases": {"correct": _SAMPLE, "case": _SAMPLE, "count": _SAMPLE},
    "conflict_std": {"correct": _SAMPLE},
    "conflict": {"correct": _SAMPLE, "distractor": _SAMPLE},
    "vap": {"effect": ("layer", "group")},
    "heads": {"effect": ("layer", "head")},
    "faithfulness": {
        "faithfulness": ("ranking", "size"),
        "kept_fraction": ("size",),
        "cpr": ("ranking",),
        "cmd": ("ranking",),
    },
    "attention_metrics": {m: ("layer", "sample") for m in ("mas", "vra", "iou", "ars")} | {"correct": _SAMPLE},
    "probes": {"ap50": ("tap",)},
    "objects": {
        **dict.fromkeys(("effect", "exists", "n_tokens", "placement", "size", "touches"), _SCENE_OBJECT),
        "answered_right": ("scene",),
    },
}


def check_reads(runs: list[StoredRun]) -> None:
    """Refuse a run whose stored result lacks a variable the tables read (`READS`), holds it over other
    dims, or holds NaN where a number is measured (`MEASURED`): a `RunDirError` naming the file and the
    fix, before anything is written."""
    for run in runs:
        for stage, wanted in READS.items():
            ds = run.get(stage)
            if ds is None or "refused" in ds.attrs:  # no result, or one that says why it measured nothing
                continue
            file = run.path / "results" / f"{stage}.nc"
            fix = f"delete {file} and rerun `countlens discover --out {run.path}` (it resumes, recomputing that stage)"
            problems = [
                f"{var!r} is missing" if var not in ds else f"{var!r} is over {list(ds[var].dims)}, not {list(dims)}"
                for var, dims in wanted.items()
                if var not in ds or set(ds[var].dims) != set(dims)
            ]
            if stage == "faithfulness" and "n_nodes" not in ds.attrs:
                problems.append("its attr 'n_nodes' is missing")
            if problems:
                raise RunDirError(f"{file}: {'; '.join(problems)}: not a {stage} result compare can read; {fix}")
            for var in MEASURED.get(stage, ()):
                require_finite_tensor(ds[var].values, f"{file}: {var!r}", RunDirError, fix=fix)


def missing(run: StoredRun, stage: str, what: str) -> str:
    """The note of a run that lacks a stage's result."""
    return f"{run.label} has no results/{stage}.nc ({run.path}): its {what} cells are empty"


def _rows_of(runs: list[StoredRun], stage: str, what: str, row) -> tuple[dict[str, dict], list[str]]:
    """``row(run, ds)`` of each run's ``stage`` result by label; a run without it gets an empty row
    and a `missing` note naming ``what``."""
    rows, notes = {}, []
    for run in runs:
        ds = run.get(stage)
        if ds is None:
            notes.append(missing(run, stage, what))
        rows[run.label] = {} if ds is None else row(run, ds)
    return rows, notes


def _frame(rows: dict[str, dict], columns: list[str], index: str = "model") -> pd.DataFrame:
    table = pd.DataFrame.from_dict(rows, orient="index").reindex(columns=columns).astype(float)
    table.index.name = index
    return table


def accuracy_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """Accuracy per COUNTINGTRICKS case (columns) per model (rows), then family and overall means."""
    designs = list(dict.fromkeys(r.spec.get("design", "countlens") for r in runs))
    families = pd.concat([case_families(d) for d in designs])
    families = families[~families.index.duplicated()]

    def row_of(run: StoredRun, cases) -> dict:
        by_case = accuracy(cases, "case")["accuracy"].astype(float)  # as the run's own report (cases section)
        own = case_families(run.spec.get("design", "countlens"))
        by_case = by_case.reindex([c for c in own.index if c in by_case.index])
        row = by_case.to_dict()
        for fam in FAMILIES:
            part = by_case[[c for c in by_case.index if own[c] == fam]]
            row[family_row(fam)] = float(part.mean()) if len(part) else math.nan
        row[OVERALL] = float(by_case.mean()) if len(by_case) else math.nan
        return row

    rows, notes = _rows_of(runs, "cases", "COUNTINGTRICKS accuracy", row_of)
    present = {c for row in rows.values() for c in row}
    columns = [c for c in families.index if c in present] + [family_row(f) for f in FAMILIES] + [OVERALL]
    return _frame(rows, columns), notes


COUNTING_COLUMNS = ["accuracy", "number-avoidance r", "DiC accuracy (std)", "DiC accuracy (conflict)", "DiC drop"]
COUNTING_COLUMNS += ["DiC distractor share"]


def counting_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """Overall COUNTINGTRICKS accuracy, number-avoidance r and Digit-in-Conflict per model."""
    rows, notes = {}, []
    for run in runs:
        row = {}
        cases = run.get("cases")
        if cases is None:
            notes.append(missing(run, "cases", "accuracy and number-avoidance"))
        else:
            row["accuracy"] = float(summary(cases).loc["all", "accuracy"])
            row["number-avoidance r"] = number_avoidance(cases.where(cases["count"] >= 0, drop=True))["r"]
        std, conflict = run.get("conflict_std"), run.get("conflict")
        if std is None or conflict is None:
            stage = "conflict_std" if std is None else "conflict"
            notes.append(missing(run, stage, "Digit-in-Conflict"))
        else:
            dic = digit_in_conflict(std, conflict)
            row |= {
                "DiC accuracy (std)": dic["accuracy_std"],
                "DiC accuracy (conflict)": dic["accuracy_conflict"],
                "DiC drop": dic["drop"],
                "DiC distractor share": dic["distractor_share"],
            }
        rows[run.label] = row
    return _frame(rows, COUNTING_COLUMNS), notes


HANDOFF_COLUMNS = ["layers", "image effect < 0.5 (depth)", "last-token effect ≥ 0.5 (depth)"]


def handoff_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """Each model's layer count and VAP hand-off depths (`countlens.analysis.depth.handoff`)."""
    rows, notes = {}, []
    for run in runs:
        vap = run.get("vap")
        row = {"layers": run.n_layers if run.n_layers is not None else math.nan}
        if vap is None:
            notes.append(missing(run, "vap", "hand-off"))
        else:
            h = depth.handoff(vap, run.n_layers)
            row |= {HANDOFF_COLUMNS[1]: h["image_below"], HANDOFF_COLUMNS[2]: h["last_above"]}
        rows[run.label] = row
    return _frame(rows, HANDOFF_COLUMNS), notes


def vap_curves(runs: list[StoredRun]) -> pd.DataFrame:
    """Every run's image-token and last-token VAP effect by layer and relative depth, one row per
    (model, layer): the hand-off figure's data."""
    parts = [depth.vap_curves(r.get("vap"), r.n_layers).assign(model=r.label) for r in runs if r.get("vap") is not None]
    columns = ["model", "layer", "depth", "image", "last"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


MAS_COLUMNS = ["MAS (all)", "MAS (correct)", "MAS (wrong)", "n (correct)", "n (wrong)"]


def mas_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """MAS per model for all, right and wrong answers, and the MAS code's 4-way share where stored."""
    columns = MAS_COLUMNS + [f"{name} share (MAS code)" for name in SETS]  # the code's sets, in its order

    def row_of(run: StoredRun, am) -> dict:
        mas = aggregate(am, by=None)
        row = {
            "MAS (all)": mas.loc["all", "mas"],
            "MAS (correct)": mas.loc["correct", "mas"],
            "MAS (wrong)": mas.loc["incorrect", "mas"],
            "n (correct)": mas.loc["correct", "n"],
            "n (wrong)": mas.loc["incorrect", "n"],
        }
        if "sets" in am:
            import torch

            shares = modality_shares(torch.tensor(am.sets.transpose("sample", "layer", "set").values))
            row |= {f"{name} share (MAS code)": shares[name] for name in SETS}
        return {k: float(v) for k, v in row.items()}

    rows, notes = _rows_of(runs, "attention_metrics", "MAS", row_of)
    return _frame(rows, columns), notes


def probes_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """AP@50 of the detection probes per tap (columns, in the first run's order of taps) per model;
    a run without the optional ``probes`` stage leaves its row empty, with a note."""
    rows, notes = _rows_of(
        runs, "probes", "probe AP", lambda run, ds: {str(t): float(v) for t, v in zip(ds.tap.values, ds.ap50.values)}
    )
    taps = list(dict.fromkeys(t for row in rows.values() for t in row))  # in the first run's order, then others'
    return _frame(rows, taps), notes


PLACEMENT_COLUMNS = ["model", "placement", "objects", "scenes", "mean effect", "effect low", "effect high"]
PLACEMENT_COLUMNS += ["missed", "objects in wrong scenes", "missed rate", "missed low", "missed high", "chance"]
_PLACEMENT_VARS = ["n_objects", "n_scenes", "mean_effect", "effect_low", "effect_high", "missed", "n_wrong_objects"]
_PLACEMENT_VARS += ["missed_rate", "missed_low", "missed_high", "chance_rate"]


def placement_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """Per (model, placement class) the objects' mean effect (logits, bootstrap CI over scenes) and the
    missed rate on the scenes the run answered wrong (Wilson CI), from each run's ``objects`` result
    (`run_misses`); "not run" / "not measured" rows, with a note, where a run has no such result."""
    rows, notes = [], []
    for run in runs:
        ds = run.get("objects")
        if ds is None:
            notes.append(missing(run, "objects", "object-placement"))
            rows.append({"model": run.label, "placement": "not run"})
            continue
        if "refused" in ds.attrs:
            notes.append(f"{run.label} measured no object effect ({run.path}): {ds.attrs['refused']}")
            rows.append({"model": run.label, "placement": "not measured"})
            continue
        table = run_misses(ds)
        for group in PLACEMENT_ROWS:
            values = table.sel(group=group)
            row = {"model": run.label, "placement": str(values["level"].item())}
            rows.append(row | {c: float(values[v]) for c, v in zip(PLACEMENT_COLUMNS[2:], _PLACEMENT_VARS)})
    return pd.DataFrame(rows, columns=PLACEMENT_COLUMNS), notes


FAITHFULNESS_COLUMNS = ["model", "ranking", "CPR", "CMD", f"smallest f ≥ {FAITHFUL} (fraction)"]
FAITHFULNESS_COLUMNS += [f"smallest f ≥ {FAITHFUL} (heads)"]


def faithfulness_table(runs: list[StoredRun]) -> tuple[pd.DataFrame, list[str]]:
    """CPR, CMD and the smallest circuit reaching `FAITHFUL` per (model, ranking); the random rankings
    as their mean (``random``), as the report shows them."""
    rows, notes = [], []
    for run in runs:
        ds = run.get("faithfulness")
        if ds is None:
            notes.append(missing(run, "faithfulness", "faithfulness"))
            continue
        smallest = smallest_faithful(ds, FAITHFUL)
        n_nodes = int(ds.attrs["n_nodes"])
        for name in (str(r) for r in ds.ranking.values):
            if name.startswith("random") and name != "random":
                continue
            fraction = float(smallest.sel(ranking=name))
            rows.append(
                {
                    "model": run.label,
                    "ranking": name,
                    "CPR": float(ds.cpr.sel(ranking=name)),
                    "CMD": float(ds.cmd.sel(ranking=name)),
                    FAITHFULNESS_COLUMNS[4]: fraction,
                    FAITHFULNESS_COLUMNS[5]: math.nan if math.isnan(fraction) else round(fraction * n_nodes),
                }
            )
    return pd.DataFrame(rows, columns=FAITHFULNESS_COLUMNS), notes


def class_table(runs: list[StoredRun], n_bins: int = depth.N_BINS) -> tuple[pd.DataFrame, list[str]]:
    """Heads of each class per relative-depth bin, one row per (model, bin)."""
    parts, notes = [], []
    for run in runs:
        if run.heads is None or run.n_layers is None:
            notes.append(f"{run.label} has no heads.csv ({run.path}): its head-class cells are empty")
            continue
        counts = depth.class_counts(run.heads, run.n_layers, n_bins).reset_index()
        parts.append(counts.assign(model=run.label))
    if not parts:
        return pd.DataFrame(), notes
    table = pd.concat(parts, ignore_index=True)
    return table[["model", "depth", *[c for c in table.columns if c not in ("model", "depth")]]], notes


def top_heads_table(runs: list[StoredRun], k: int = 3, n_bins: int = depth.N_BINS) -> tuple[pd.DataFrame, list[str]]:
    """Each model's ``k`` most important heads per relative-depth bin, one row per head."""
    parts, notes = [], []
    for run in runs:
        if run.heads is None or run.n_layers is None:
            notes.append(f"{run.label} has no heads.csv ({run.path}): its top-head cells are empty")
            continue
        parts.append(depth.top_heads(run.heads, run.n_layers, k, n_bins).assign(model=run.label))
    if not parts:
        return pd.DataFrame(), notes
    table = pd.concat(parts, ignore_index=True)
    return table[["model", *[c for c in table.columns if c != "model"]]], notes


def top_heads_grid(top: pd.DataFrame, n_bins: int = depth.N_BINS) -> pd.DataFrame:
    """`top_heads_table` as shown in compare.md: depth bins as rows, models as columns, each cell the
    bin's heads as ``L3H1 0.45 (class)`` in order of importance."""
    if top.empty:
        return pd.DataFrame()
    cells = top.groupby(["bin", "model"], sort=False).apply(
        lambda g: "; ".join(f"{h} {v:.2f} ({c})" for h, v, c in zip(g["head"], g["importance"], g["class"])),
        include_groups=False,
    )
    grid = cells.unstack("model").reindex(index=depth.bin_labels(n_bins), columns=list(dict.fromkeys(top["model"])))
    grid.index.name = "depth"
    return grid.fillna("")
