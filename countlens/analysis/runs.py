"""Finished `countlens discover` runs read back from disk, and whether they ran the same protocol.

`read_run` reads what a run stored — ``spec.json``, ``results/<stage>.nc``, ``heads.csv`` — and runs
no model. It sits in `countlens.analysis`, below the pipeline that writes runs, so it reads the
files themselves (the layout is `countlens.pipeline.rundir`'s): a run is *finished* when it has a
``spec.json`` naming its model and architecture and a ``report.md`` (discover writes the report
last, after every stage). A finished run may still lack a stage's result (an optional stage such as
the probes, or one added to countlens after the run was made): `StoredRun.get` returns None for it,
and whoever reads it says so.

`protocol_differences` compares the runs' specs on `PROTOCOL`, the settings that decide what the model
is asked and how its answers are scored (the preset, the prompt, the COUNTINGTRICKS design, the
counts asked about, the sample sizes, the tasks, the seed …); the model, its architecture and the
settings that only size the work (batch size) or only shape an analysis (top_k, alpha) may differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import xarray as xr

from countlens import files, results
from countlens.analysis.heads import read_heads
from countlens.errors import ConfigError, RunDirError

#: The spec.json keys two runs must share to be compared side by side, and ``counts``: the distinct
#: true counts of the run's COUNTINGTRICKS samples (read from ``results/cases.nc``).
PROTOCOL: tuple[str, ...] = (
    "preset",
    "prompt",
    "prompt_template",
    "answer_form",
    "design",
    "counts",
    "evaluate",
    "parser",
    "max_new_tokens",
    "attention_at",
    "pair_kind",
    "tasks",
    "n_per_case",
    "n_pairs",
    "n_samples",
    "seed",
)

#: Variables of a stage's stored result that hold a measurement at every index: a NaN there is a
#: broken file, not "no value there" (±inf is refused for every variable by `countlens.results.load`).
#: Read by the report's run loader and by `compare`.
MEASURED: dict[str, tuple[str, ...]] = {
    "faithfulness": ("faithfulness", "cpr", "cmd"),
    "edge_faithfulness": ("faithfulness", "cpr", "cmd"),
}


@dataclass
class StoredRun:
    """One finished run as stored: its directory, ``spec.json``, its stage results by name and its head
    table (None where ``heads.csv`` is missing). ``label`` names it in tables (its model)."""

    path: Path
    spec: dict
    results: dict[str, xr.Dataset]
    heads: pd.DataFrame | None
    label: str = ""
    notes: list[str] = field(default_factory=list)

    def get(self, stage: str) -> xr.Dataset | None:
        """The stage's stored result, or None where the run has none."""
        return self.results.get(stage)

    @property
    def n_layers(self) -> int | None:
        """The model's decoder layers: those head patching swept (``heads``), else one past VAP's last."""
        if "heads" in self.results:
            return int(self.results["heads"].sizes["layer"])
        if "vap" in self.results:
            return int(self.results["vap"].layer.max()) + 1
        return None

    def protocol(self) -> dict:
        """The run's values of `PROTOCOL` (None for a key its spec lacks)."""
        values = {k: self.spec.get(k) for k in PROTOCOL if k != "counts"}
        cases = self.get("cases")
        values["counts"] = (
            sorted({int(c) for c in cases["count"].values if int(c) >= 0})
            if cases is not None and "count" in cases
            else None
        )
        return {k: values[k] for k in PROTOCOL}


def read_run(path: str | Path) -> StoredRun:
    """A finished run directory read back (module docstring); refuses a path that is not one, naming it."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory; give the --out directory of a `countlens discover` run")
    spec_file = path / "spec.json"
    if not spec_file.exists():
        raise RunDirError(
            f"{path} is not a countlens discover run (no spec.json); give the --out directory of a finished run"
        )
    spec = files.read_json(spec_file, f"restore it from a copy, or rerun `countlens discover --out {path}`")
    if not isinstance(spec, dict) or not {"model", "arch"} <= set(spec):
        raise RunDirError(f"{spec_file} does not name a model and arch: it was not written by `countlens discover`")
    if not (path / "report.md").exists():
        raise RunDirError(
            f"{path} is not a finished run (no report.md, which discover writes last); "
            f"rerun `countlens discover --out {path}` with its settings to finish it"
        )
    found = {p.stem: results.load(p) for p in sorted((path / "results").glob("*.nc"))}
    heads = None
    if (path / "heads.csv").exists():
        heads = read_heads(path)
    return StoredRun(path, spec, found, heads, label=model_label(spec["model"]))


def model_label(model) -> str:
    """A run's model as tables name it: a checkpoint directory or hub id by its last part
    (``/data/Qwen2.5-VL-7B-Instruct`` and ``Qwen/Qwen2.5-VL-7B-Instruct`` as ``Qwen2.5-VL-7B-Instruct``),
    so that labels stay short enough for a figure's panel titles; ``toy`` as it is."""
    return str(model).rstrip("/").rsplit("/", 1)[-1] or str(model)


def read_runs(paths: list[str | Path]) -> list[StoredRun]:
    """`read_run` of each path, labelled by model; two runs of one model are told apart by their folder."""
    if not paths:
        raise ConfigError("no runs given; give the directories of one or more `countlens discover` runs")
    runs = [read_run(p) for p in paths]
    resolved = [r.path.resolve() for r in runs]
    twice = sorted({str(p) for p in resolved if resolved.count(p) > 1})
    if twice:
        raise ConfigError(f"the run {twice[0]} is given more than once; give each run once")
    models = [r.label for r in runs]
    for r in runs:
        if models.count(r.label) > 1:
            r.label = f"{r.label} ({r.path.name})"
    if len({r.label for r in runs}) < len(runs):  # same model and same folder name under two parents
        for r in runs:
            r.label = f"{r.spec['model']} ({r.path})"
    return runs


def protocol_differences(runs: list[StoredRun]) -> dict[str, dict[str, object]]:
    """The `PROTOCOL` keys on which the runs differ, each with every run's value by label."""
    values = [r.protocol() for r in runs]
    out = {}
    for key in PROTOCOL:
        shown = [json.dumps(v, sort_keys=True) for v in (v[key] for v in values)]
        if len(set(shown)) > 1:
            out[key] = {r.label: v[key] for r, v in zip(runs, values)}
    return out


def describe_differences(diff: dict[str, dict[str, object]]) -> list[str]:
    """One line per differing key: ``prompt: toy = 'short', other = 'std'``."""
    return [f"{key}: " + ", ".join(f"{label} = {value!r}" for label, value in by.items()) for key, by in diff.items()]


def check_protocol(runs: list[StoredRun], allow_mixed: bool = False) -> dict[str, dict[str, object]]:
    """The runs' protocol differences; refused (a `ConfigError` naming each key and value) unless
    ``allow_mixed``, where they are returned for the comparison to state."""
    diff = protocol_differences(runs)
    if diff and not allow_mixed:
        raise ConfigError(
            "the runs differ in protocol, so their numbers are not comparable side by side: "
            + "; ".join(describe_differences(diff))
            + ". Compare runs made with the same settings, or pass --allow-mixed (allow_mixed=True) "
            "to compare them anyway, the differences stated in compare.md"
        )
    return diff
