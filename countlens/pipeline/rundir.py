"""A discover run directory: its ``spec.json``, its stage results, and the runner that resumes them.

Layout: ``spec.json`` (what the run computes: its `DiscoverConfig`, model, arch and prompt),
``results/<stage>.nc`` (one per finished stage), ``results/sweeps/`` (the long sweeps' chunks), the
head table, ``figures/`` and ``report.md``. A directory belongs to one spec: rerunning with other
settings is refused, so a resumed run never mixes two runs' results.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import xarray as xr

from countlens import files, results
from countlens.analysis.runs import MEASURED
from countlens.datasets.prompts import PROMPTS
from countlens.errors import RunDirError
from countlens.pipeline.stages import REQUIRED, STAGES
from countlens.validate import require_count, require_finite_tensor

BY_NAME = {stage.name: stage for stage in STAGES}
#: Coordinates of a stage's result that increase strictly (the faithfulness curves' sizes).
INCREASING: dict[str, tuple[str, ...]] = {"faithfulness": ("size",), "edge_faithfulness": ("size",)}
#: What a report reads of spec.json besides the model and arch: the prompt it names, and the top-k
#: and Jaccard k its sections take.
REPORT_SPEC: tuple[str, ...] = ("prompt", "top_k", "jaccard_k")


def read_spec(run: str | Path) -> dict:
    """A run's ``spec.json``, checked for what reports read (model, arch)."""
    path = Path(run) / "spec.json"
    if not path.exists():
        raise RunDirError(f"{run} is not a countlens discover run (no spec.json); run `countlens discover --out {run}`")
    spec = files.read_json(
        path, f"restore it from a copy, or delete {run} and run `countlens discover --out {run}` again from the start"
    )
    missing = [k for k in ("model", "arch") if not isinstance(spec, dict) or k not in spec]
    if missing:
        raise RunDirError(
            f"{path} lacks {missing}: not written by `countlens discover`; give `countlens discover` another "
            f"--out, or delete {path} if {run} holds nothing else of yours"
        )
    return spec


def stored(path: Path, out: Path) -> xr.Dataset | xr.DataArray:
    """A stage's stored result, checked against what its stage declares it holds (`check_stored`); a
    damaged or foreign file is a `RunDirError` that names it and the fix."""
    fix = f"delete {path} and rerun `countlens discover --out {out}` (it resumes, recomputing only that stage)"
    try:
        value = results.load(path)
    except results.ResultError as err:
        raise RunDirError(f"{err}; {fix}") from None
    check_stored(path.stem, value, path, fix)
    return value


def check_stored(name: str, value, path: Path, fix: str) -> None:
    """Refuse a stored result of stage ``name`` that lacks a variable its stage declares, or holds it
    over other dims (a damaged file, or one another version or program wrote)."""
    stage = BY_NAME.get(name)
    if isinstance(value, xr.DataArray):
        value = value.to_dataset(name=value.name or name)
    # No variable at all: a stage that measured nothing on this model (``refused``); its readers say so.
    if stage is None or not stage.variables or value.attrs.get("refused") or not value.data_vars:
        return
    problems = [
        f"{var!r} is missing"
        if var not in value
        else f"{var!r} is over the dims {list(value[var].dims)}, not {list(dims)}"
        for var, dims in stage.variables.items()
        if var not in value or set(value[var].dims) != set(dims)
    ]
    if problems:
        raise RunDirError(f"{path}: {'; '.join(problems)}: not a {name} result countlens can read; {fix}")
    for var in MEASURED.get(name, ()):
        require_finite_tensor(value[var].values, f"{path}: {var!r}", RunDirError, fix=fix)
    for coord in INCREASING.get(name, ()):
        values = value[coord].values if coord in value.coords else None
        if values is not None and (values[1:] <= values[:-1]).any():
            raise RunDirError(
                f"{path}: its {coord} coordinate {list(values)} does not increase strictly, as a {name} result's "
                f"does (a curve's areas are taken in that order): it was edited; {fix}"
            )


def load_run(out: str | Path) -> dict[str, xr.Dataset]:
    """Every stage result of a finished run directory, by stage name (every required stage of the
    registry, and the optional ones the run had), each checked against its stage's variables."""
    out = Path(out)
    spec = read_spec(out)
    found = {p.stem: stored(p, out) for p in sorted((out / "results").glob("*.nc"))}
    missing = [s for s in REQUIRED if s not in found]
    if missing:
        raise RunDirError(f"{out} misses stages {missing}; rerun `countlens discover --out {out}` to finish it")
    check_report_spec(spec, out)
    return found


def check_report_spec(spec: dict, out: Path) -> None:
    """Refuse a finished run's spec.json that lacks what its report reads (`REPORT_SPEC`), or holds it
    in another form: an edited file, or one an older countlens wrote."""
    path = out / "spec.json"
    missing = [k for k in REPORT_SPEC if k not in spec]
    fix = (
        "add it as the run used it (discover writes every setting there: restore the file from a copy), or rerun "
        "`countlens discover` into a new --out"
    )
    if missing:
        raise RunDirError(f"{path} lacks {missing}, which the report reads; {fix}")
    if spec["prompt"] not in PROMPTS:
        raise RunDirError(f"{path}: prompt {spec['prompt']!r} is no prompt style ({', '.join(PROMPTS)}); {fix}")
    for key in ("top_k", "jaccard_k"):
        require_count(spec[key], f"{path}: {key}", RunDirError)


def check_run_dir(out: str | Path) -> None:
    """Refuse, before a model loads, an ``--out`` no run can go into: a file, a folder that is not a
    countlens run (`_refuse_foreign`), or a run whose spec.json cannot be read."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output {out} is a file; give a directory")
    if (out / "spec.json").exists():
        read_spec(out)
    else:
        _refuse_foreign(out)


def _refuse_foreign(out: Path) -> None:
    """Refuse to start a run in a folder that holds anything but a run's spec being written by
    another rank: countlens never writes into, or reads results from, a folder it did not make."""
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name != "spec.json" and not p.name.startswith("."))
    if foreign and not (out / "spec.json").exists():  # a rank that started first may have written it
        shown = ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else "")
        raise RunDirError(
            f"{out} holds {shown} but no spec.json: it is not a countlens discover run; give a new or empty "
            "--out directory"
        )


class Stages:
    """Runs named stages once: a finished stage's result is loaded from disk instead of recomputed."""

    def __init__(self, out: Path, spec: dict, log: Callable[[str], None] = print):
        self.out, self.log = out, log
        self.dir = out / "results"
        spec = json.loads(json.dumps(spec))  # as spec.json reads back (a tuple is a list there)
        spec_file = out / "spec.json"
        if not spec_file.exists():
            _refuse_foreign(out)
            out.mkdir(parents=True, exist_ok=True)
            if not spec_file.exists():  # another rank may have written it meanwhile: then it is compared
                files.write_text(spec_file, json.dumps(spec, indent=1, sort_keys=True))  # atomic
        old = read_spec(out)
        files.refuse_older_spec(old, spec, spec_file, "rerun into a new --out directory")
        if old != spec:
            changed = sorted(k for k in {*old, *spec} if old.get(k) != spec.get(k))
            raise RunDirError(
                f"{out} holds a run with a different spec (it differs in {changed}: {spec_file}); "
                f"rerun with that run's settings to resume it, or give a new --out directory "
                f"(or delete {out} to start it over)"
            )
        self.dir.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, compute: Callable[[], xr.Dataset | xr.DataArray], save: bool = True):
        """The stage's stored result, else ``compute()`` (stored unless ``save=False``: the ranks
        of a sharded run other than 0 compute their share and leave the writing to rank 0)."""
        path = self.dir / f"{name}.nc"
        if path.exists():
            self.log(f"[{name}] done before: {path}")
            return stored(path, self.out)
        self.log(f"[{name}] running")
        value = compute()
        if save:
            results.save(value, path)
        return value
