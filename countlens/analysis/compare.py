"""Many runs side by side: `compare_runs` (``countlens compare RUN [RUN …] --out DIR``).

Each paper's main result is a comparison across models, and `countlens discover` runs one model.
`compare_runs` reads the stored results of finished runs (`countlens.analysis.runs.read_run`: no
model is loaded) and writes, into ``out``:

- ``compare.md``: the runs, the protocol they share (or, with ``allow_mixed``, how they differ),
  notes on the results some run lacks, and the tables and figures below;
- ``compare.html``: compare.md as one self-contained page, its figures embedded
  (`countlens.html_page`: it loads nothing, and opens anywhere);
- one CSV per table (full precision; `countlens.analysis.compare_tables` defines each), and LaTeX
  (booktabs) for the two accuracy tables: ``accuracy`` (Table 5's layout, a row per model, a column
  per case, the family means), ``counting`` (accuracy, number-avoidance r, Digit-in-Conflict),
  ``handoff`` and ``vap_curves`` (the VAP hand-off on relative depth, `countlens.analysis.depth`),
  ``head_classes`` and ``top_heads`` (heads on relative depth), ``faithfulness``, ``mas`` (with the
  MAS code's 4-way share where run), ``probes`` (AP@50 per tap, where run), ``placement`` (per model
  and placement class, the objects' mean effect and missed rate from the ``objects`` stage; "not run"
  where a run lacks it) and ``protocol`` (every run's protocol values);
- ``figures/handoff.png`` (every model's image-token and last-token curves over depth ∈ [0, 1]) and
  ``figures/head_classes.png`` (classes per depth bin, a panel per model).

Runs that differ in protocol (`countlens.analysis.runs.PROTOCOL`) are refused unless ``allow_mixed``.
A run lacking a stage's result leaves its cells empty, with a note; a path that is not a finished run
is refused, naming it, and so is a stored result that lacks a variable the tables read or holds NaN
where a number is measured (`countlens.analysis.compare_tables.check_reads`). Nothing is written
before every run has been read and checked.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from countlens.analysis import compare_tables as ct
from countlens.analysis import depth
from countlens.analysis.figures.depth import plot_depth_classes, plot_handoff
from countlens.analysis.runs import PROTOCOL, StoredRun, check_protocol, describe_differences, read_runs
from countlens.analysis.tables import finite_markdown, to_latex, to_markdown
from countlens.errors import ConfigError
from countlens.html_page import standalone_page


def compare_runs(
    runs: list[str | Path], out: str | Path, allow_mixed: bool = False, k: int = 3, n_bins: int = depth.N_BINS
) -> Path:
    """Compare finished discover runs (module docstring) into ``out``; returns the path of compare.md.
    ``k``: top heads per relative-depth bin; ``n_bins``: relative-depth bins of the head tables."""
    out = Path(out)
    stored = read_runs(list(runs))
    for r in stored:
        if out.resolve() == r.path.resolve():
            raise ConfigError(f"--out {out} is the run {r.path}; give another directory (a run is never written into)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    differences = check_protocol(stored, allow_mixed)
    ct.check_reads(stored)  # every result the tables read, before anything is written

    tables: dict[str, pd.DataFrame] = {}
    notes: list[str] = []
    for name, (table, table_notes) in {
        "accuracy": ct.accuracy_table(stored),
        "counting": ct.counting_table(stored),
        "handoff": ct.handoff_table(stored),
        "head_classes": ct.class_table(stored, n_bins),
        "top_heads": ct.top_heads_table(stored, k, n_bins),
        "faithfulness": ct.faithfulness_table(stored),
        "mas": ct.mas_table(stored),
        "probes": ct.probes_table(stored),
        "placement": ct.placement_table(stored),
    }.items():
        tables[name] = table
        notes += [n for n in table_notes if n not in notes]
    tables["vap_curves"] = ct.vap_curves(stored)
    tables["protocol"] = pd.DataFrame({r.label: r.protocol() for r in stored}).rename_axis("setting")

    out.mkdir(parents=True, exist_ok=True)
    figures = out / "figures"
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=name not in ("head_classes", "top_heads", "faithfulness", "placement"))
    for name in ("accuracy", "counting"):
        (out / f"{name}.tex").write_text(to_latex(tables[name], digits=2, bold_best=False))
    drawn = {}
    if not tables["vap_curves"].empty:
        drawn["handoff"] = plot_handoff(tables["vap_curves"], figures / "handoff.png")
    if not tables["head_classes"].empty:
        drawn["head_classes"] = plot_depth_classes(tables["head_classes"], figures / "head_classes.png")
    text = _markdown(stored, tables, notes, differences, drawn, out, k, n_bins)
    path = out / "compare.md"
    path.write_text(text)
    title = f"countlens compare: {', '.join(r.label for r in stored)}"
    (out / "compare.html").write_text(standalone_page(title, text, out, "compare.html"), encoding="utf-8")
    return path


def _runs_table(stored: list[StoredRun]) -> str:
    rows = [
        {
            "model": r.label,
            "arch": r.spec["arch"],
            "layers": r.n_layers if r.n_layers is not None else "–",
            "stages": len(r.results),
            "run": str(r.path),
        }
        for r in stored
    ]
    return finite_markdown(pd.DataFrame(rows), index=False)


def _protocol_text(stored: list[StoredRun], differences: dict) -> str:
    if differences:
        lines = "\n".join(f"- {line}" for line in describe_differences(differences))
        return (
            "**The runs differ in protocol** (compared with `--allow-mixed`): their numbers are not measured "
            f"on the same questions, read them with care.\n\n{lines}\n"
        )
    shared = stored[0].protocol()
    shown = ", ".join(f"{k} = `{shared[k] if shared[k] not in (None, '') else 'none'}`" for k in PROTOCOL)
    return f"The runs share one protocol: {shown}.\n"


def _figure(drawn: dict, name: str, out: Path, alt: str) -> str:
    return f"![{alt}]({drawn[name].relative_to(out).as_posix()})\n" if name in drawn else ""


def _table_md(table: pd.DataFrame, digits: int, index: bool = True) -> str:
    if table.empty:
        return "_No run has this result._\n"
    return to_markdown(table if index else table.set_index(table.columns[0]), digits)


def _markdown(stored, tables, notes, differences, drawn, out: Path, k: int, n_bins: int) -> str:
    acc = tables["accuracy"]
    position = [c for c in acc.columns if not str(c).startswith("mean (")]
    means = acc[[c for c in acc.columns if str(c).startswith("mean (")]]
    parts = [
        f"# countlens compare: {len(stored)} run{'s' if len(stored) > 1 else ''}\n",
        _runs_table(stored) + "\n",
        "## Protocol\n",
        _protocol_text(stored, differences),
    ]
    if notes:
        parts += ["**Missing results** (their cells are empty):\n", "\n".join(f"- {n}" for n in notes) + "\n"]
    parts += [
        "## 1. COUNTINGTRICKS accuracy\n",
        "Family means (macro over the cases each run has) and the mean over all cases; per case in "
        "`accuracy.csv` / `.tex` (Table 5's cases, a row per model).\n",
        _table_md(means, 2),
        "\nPer case:\n",
        _table_md(acc[position], 2),
        "\n## 2. Number avoidance and Digit-in-Conflict\n",
        "Accuracy over all COUNTINGTRICKS samples; r: Pearson r between the true count and its accuracy; "
        "DiC: accuracy without and with a distractor digit in the prompt, its drop, and the share of "
        "answers that repeat the distractor.\n",
        _table_md(tables["counting"], 2),
        "\n## 3. The VAP hand-off on relative depth\n",
        "Depth = layer / (layers − 1), the embeddings at 0. The image-token effect falls below 0.5 after the "
        "last point where it is at least 0.5; the last-token effect first reaches 0.5 — both read between "
        "layers by linear interpolation (`countlens.analysis.depth`); – where a curve never crosses.\n",
        _table_md(_whole(tables["handoff"], ["layers"]), 2),
        _figure(drawn, "handoff", out, "VAP effect over relative depth"),
        f"\n## 4. Head classes by relative depth ({n_bins} bins)\n",
        _table_md(tables["head_classes"], 0, index=False),
        _figure(drawn, "head_classes", out, "head classes by relative depth"),
        f"\n## 5. Top {k} heads per relative-depth bin\n",
        "By importance (|head-patching effect|), with the class.\n",
        finite_markdown(tables["top_heads"].pipe(ct.top_heads_grid, n_bins)) + "\n"
        if not tables["top_heads"].empty
        else "_No run has a head table._\n",
        "\n## 6. Faithfulness\n",
        f"CPR and CMD of each ranking's circuits and the smallest circuit reaching f ≥ {ct.FAITHFUL} "
        "(`random`: the mean of the random rankings).\n",
        _table_md(tables["faithfulness"], 3, index=False)
        if tables["faithfulness"].empty
        else _faithfulness_md(tables["faithfulness"]),
        "\n## 7. Modality attention share (MAS)\n",
        "The answer position's attention share on image tokens, mean over layers and samples.\n",
        _table_md(_whole(tables["mas"], ["n (correct)", "n (wrong)"]), 3),
        "\n## 8. Detection probes\n",
        "AP@50 of the MAS paper's code's detection probes on each tap (the optional `probes` stage: "
        "`--preset counting-to-four`, or `--voc DIR`).\n",
        _table_md(tables["probes"], 3),
        "\n## 9. Which objects does the model count?\n",
        "Per placement class on the ViT patch grid: each object's exact effect on the count answer (logits; "
        "its image tokens at the input patched from the scene without it: the `objects` stage), mean with a "
        "95 % bootstrap interval over scenes; the missed rate: of the class's objects in the scenes the run "
        "answered wrong, the share that carry the least effect of their scene (Wilson interval), beside the "
        "share were that object drawn at random among its scene's objects (chance).\n",
        _placement_md(tables["placement"]),
    ]
    return "\n".join(parts)


def _placement_md(table: pd.DataFrame) -> str:
    """`placement_table` as compare.md shows it: a row per model and placement, value [interval]."""
    if table.empty:
        return "_No run has this result._\n"

    def interval(value, low, high) -> str:
        return "–" if pd.isna(value) else f"{value:.2f} [{low:.2f}, {high:.2f}]"

    rows = {}
    for _, r in table.iterrows():
        measured = not pd.isna(r["objects"])
        rows[f"{r['model']} / {r['placement']}"] = {
            "objects": str(int(r["objects"])) if measured else "–",
            "mean effect [95 % CI]": interval(r["mean effect"], r["effect low"], r["effect high"]),
            "missed / in wrong scenes": f"{int(r['missed'])}/{int(r['objects in wrong scenes'])}" if measured else "–",
            "missed rate [95 % CI]": interval(r["missed rate"], r["missed low"], r["missed high"]),
            "chance": "–" if pd.isna(r["chance"]) else f"{r['chance']:.2f}",
        }
    return finite_markdown(pd.DataFrame.from_dict(rows, orient="index").rename_axis("model / placement")) + "\n"


def _faithfulness_md(table: pd.DataFrame) -> str:
    shown = table.assign(run=table["model"] + " / " + table["ranking"]).set_index("run")
    shown = _whole(shown.drop(columns=["model", "ranking"]), [ct.FAITHFULNESS_COLUMNS[5]])
    return to_markdown(shown.rename_axis("model / ranking"), 3)


def _whole(table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``columns`` shown as whole numbers (counts), "–" where empty."""
    shown = table.copy()
    for c in columns:
        shown[c] = [("–" if pd.isna(v) else str(int(v))) for v in shown[c]]
    return shown
