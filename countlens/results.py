"""Results on disk: labelled xarray objects saved as netCDF, with their provenance.

Every countlens result is an `xarray.DataArray` or `xarray.Dataset` whose dims are plain names —
``layer``, ``head``, ``group``, ``case``, ``sample``, ``count``, ``task``, ``tap``, ``k`` — and whose
coords label them (layer indices, head labels such as ``"L3H2"`` — `countlens.labels` —, case names
such as ``"1A"``), so ``result.sel(layer=3, case="1A")`` reads the same in every analysis. Provenance
travels in ``attrs``, built by `provenance` (model, architecture, countlens version, data set, seed,
date); attr values are only ``str``, ``int`` or ``float`` because netCDF attributes can hold nothing
else, so anything richer is stored as a JSON string. `save` and `load` round-trip one object
(DataArray or Dataset, its name, dims, coords, bool variables and attrs) through a netCDF4 file,
written atomically (`countlens.files.atomic_path`). A long sweep keeps one such file per finished
unit in a `countlens.sweep_store.SweepStore`, so a killed sweep resumes where it stopped.

    from countlens import results
    da.attrs.update(results.provenance("toy", "qwen2_vl", dataset={"n": 64}, seed=0))
    results.save(da, "runs/attn.nc"); da = results.load("runs/attn.nc")
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import ExitStack
from datetime import datetime, timezone
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from countlens.errors import CountlensError, InputError
from countlens.files import atomic_path, machine_errors
from countlens.validate import require_finite_tensor

__all__ = [
    "ResultError",
    "ResultNotFoundError",
    "SpecMismatchError",
    "load",
    "load_all",
    "provenance",
    "rebuild_samples",
    "recipe_of",
    "sample_recipes",
    "save",
    "save_all",
]

ENGINE = "netcdf4"
# Global attrs that mark a file as ours and say how to rebuild the object; reserved in user attrs.
KIND_ATTR = "countlens_result"
NAME_ATTR = "countlens_name"
# A DataArray is stored as the single variable of a Dataset under a name no user picks.
DATAARRAY_VAR = "__countlens_dataarray__"


class ResultError(CountlensError):
    """A result file or sweep directory that cannot be written or read as asked."""


class ResultNotFoundError(ResultError, FileNotFoundError):
    """A result file, or a sweep chunk, that does not exist."""


class SpecMismatchError(ResultError):
    """A sweep directory reopened with a spec other than the one it was started with."""


# --------------------------------------------------------------------------------------------
# provenance


def provenance(
    model: str,
    arch: str,
    dataset: dict | str | None = None,
    seed: int | None = None,
    samples: Any = None,
    **extra: Any,
) -> dict[str, str | int | float]:
    """Attrs recording where a result came from; every value is netCDF-safe (str, int or float).

    A dict ``dataset`` is stored as sorted JSON, so it can be compared and decoded with
    `json.loads`. ``None`` values (``dataset``, ``seed`` or an extra) are left out, since netCDF
    has no null. Extras that are not str/int/float (bools, lists, dicts) become JSON strings.
    ``samples`` (or pairs) add the data's ``data_recipe`` (`recipe_of`).
    """
    attrs: dict[str, str | int | float] = {
        "model": str(model),
        "arch": str(arch),
        "countlens_version": _countlens_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if dataset is not None:
        attrs["dataset"] = dataset if isinstance(dataset, str) else _to_json(dataset, "dataset")
    if seed is not None:
        attrs["seed"] = int(seed)
    if samples is not None:
        attrs["data_recipe"] = _to_json(recipe_of(samples), "data_recipe")
    for key, value in extra.items():
        if key in attrs:
            raise ResultError(f"provenance extra {key!r} would overwrite the standard attr; rename it")
        if value is not None:
            attrs[key] = _attr_value(value, key)
    return attrs


def recipe_of(samples) -> list[dict]:
    """The recipes of ``samples`` (or of pairs: their clean sides, whose recipe names both counts),
    folded: samples whose generator calls differ only in ``index`` form one entry with their indices
    as ``[first, last]`` runs, in order; loaded samples (no recipe) are counted as ``{"loaded": n}``.
    What `provenance` stores as a result's ``data_recipe``; `sample_recipes` unfolds it (one recipe a
    sample), `rebuild_samples` makes the samples again."""
    groups: dict[str, dict] = {}
    loaded = 0
    for s in samples:
        s = getattr(s, "clean", s)
        recipe = getattr(s, "recipe", None)
        if not recipe:
            loaded += 1
            continue
        rest = {k: v for k, v in recipe.items() if k != "index"}
        key = json.dumps(rest, sort_keys=True)
        runs = groups.setdefault(key, {**rest, "index": []})["index"]
        i = recipe.get("index")
        if runs and isinstance(i, int) and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [*groups.values(), *([{"loaded": loaded}] if loaded else [])]


#: The most samples a ``data_recipe`` may unfold to: a larger count is an edited file, not a data set.
MAX_UNFOLDED = 10_000_000


def sample_recipes(result) -> list[dict]:
    """The recipe of each sample (or pair) behind ``result``, unfolded from its ``data_recipe`` attr (the
    entries `recipe_of` folded): one dict per sample, entry by entry and each entry's samples in index
    order, each one `countlens.datasets.rebuild` makes again. A sample loaded from a data set has no
    recipe: it appears as ``{"loaded": 1}`` (which `rebuild` refuses, saying why).

    ``result``: a `xarray.Dataset` / `xarray.DataArray` carrying ``data_recipe`` (every result made from
    samples does), the path of a stored result (read with `load`), or `recipe_of`'s list itself. What is
    read is data and is checked: entries must be objects, index runs ``[first, last]`` pairs of
    integers; anything else is an `InputError` naming the entry. The recipes' own checks (generator,
    arguments, version) are `rebuild`'s (`countlens.datasets.recipe.check_recipe`)."""
    entries = _folded(result)
    out: list[dict] = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise InputError(f"data_recipe entry {k} is {entry!r:.80}, not an object; {_EDITED}")
        if "loaded" in entry:
            n = entry["loaded"]
            if set(entry) != {"loaded"} or not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InputError(f"data_recipe entry {k} ({entry!r:.80}) is no count of loaded samples; {_EDITED}")
            if len(out) + n > MAX_UNFOLDED:
                raise InputError(f"data_recipe unfolds to over {MAX_UNFOLDED:,} samples; {_EDITED}")
            out += [{"loaded": 1} for _ in range(n)]
        else:
            rest = {key: v for key, v in entry.items() if key != "index"}
            runs = _runs(entry.get("index"), k)
            if len(out) + sum(1 if a is None else b - a + 1 for a, b in runs) > MAX_UNFOLDED:  # counted first
                raise InputError(f"data_recipe unfolds to over {MAX_UNFOLDED:,} samples; {_EDITED}")
            for first, last in runs:
                out += [rest] if first is None else [{**rest, "index": i} for i in range(first, last + 1)]
    return out


def rebuild_samples(result) -> list:
    """The samples (or pairs) behind ``result`` made again from their recipes, in `sample_recipes`' order:
    ``result`` as there. Every recipe is checked (`countlens.datasets.recipe.check_recipe`) before any
    sample is made; samples loaded from a data set (no recipe) are refused, with their count."""
    from countlens.datasets.recipe import check_recipe, rebuild

    recipes = sample_recipes(result)
    loaded = sum(1 for r in recipes if set(r) == {"loaded"})
    if loaded:
        raise InputError(
            f"{loaded} of the {len(recipes)} samples behind this result were loaded from a data set and have no "
            "recipe: load that data set again (sample_recipes(result) gives the recipes of the others)"
        )
    for recipe in recipes:
        check_recipe(recipe)
    return [rebuild(recipe) for recipe in recipes]


_EDITED = "a data_recipe is written by countlens (recipe_of): the file was edited, or written by another program"


def _folded(result) -> list:
    """The folded entries of ``result``'s ``data_recipe`` (a result, a stored result's path, or the list)."""
    if isinstance(result, list):
        return result
    if isinstance(result, (str, os.PathLike)):
        result = load(result)
    if not isinstance(result, (xr.DataArray, xr.Dataset)):
        raise InputError(
            f"give a result (a Dataset or DataArray), the path of a stored one, or recipe_of's list; "
            f"got {type(result).__name__} {result!r:.80}"
        )
    text = result.attrs.get("data_recipe")
    if text is None:
        raise InputError(
            "this result carries no data_recipe attr: it was made without its samples (provenance(..., "
            "samples=...) records them); rebuild from the samples' own .recipe instead"
        )
    try:
        entries = json.loads(text) if isinstance(text, str) else None
    except ValueError as err:
        raise InputError(f"the data_recipe attr is not JSON ({err}); {_EDITED}") from None
    if not isinstance(entries, list):
        raise InputError(f"the data_recipe attr is {text!r:.80}, not a JSON list of recipes; {_EDITED}")
    return entries


def _runs(index, k: int) -> list[tuple]:
    """The ``[first, last]`` runs of entry ``k``'s index, checked (``[None, None]``: one sample without one)."""
    ok = isinstance(index, list) and all(
        isinstance(run, list)
        and len(run) == 2
        and (
            run == [None, None]
            or all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in run)
            and run[0] <= run[1]
        )
        for run in index
    )
    if not ok:
        raise InputError(f"data_recipe entry {k}'s index {index!r:.80} is no list of [first, last] runs; {_EDITED}")
    return [tuple(run) for run in index]


def _countlens_version() -> str:
    # Looked up per call, not at import, so importing countlens stays free of metadata scans.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("countlens")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _attr_value(value: Any, key: str) -> str | int | float:
    if isinstance(value, (bool, np.bool_)):  # bool is an int to Python but would load back as 1
        return json.dumps(bool(value))
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        return float(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return _to_json(value, key)


def _to_json(value: Any, key: str) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ResultError(
            f"provenance value {key!r} = {value!r} is not JSON-serialisable ({e}); pass str/int/float/list/dict values"
        ) from e


# --------------------------------------------------------------------------------------------
# save / load


def save(obj: xr.DataArray | xr.Dataset, path: str | os.PathLike) -> Path:
    """Write ``obj`` to the netCDF file ``path`` atomically; return the path.

    The file appears complete or not at all: it is written to a temp file beside ``path`` and
    renamed over it, so a crash never leaves a half-written result. Parent directories are
    created. Attr values must be str, int or float (see `provenance`).
    """
    path = Path(path)
    dataset = _to_save(obj, path)
    _prepare_parent(path)
    with atomic_path(path) as tmp:
        _write(dataset, tmp, path)
    return path


def save_all(results: Mapping[str, xr.DataArray | xr.Dataset], directory: str | os.PathLike) -> dict[str, Path]:
    """Save several results at once, ``directory/<name>.nc`` each; all or nothing. All are checked
    first, then each is written to a temp file beside its name, and only when every one is written are
    they renamed into place: a bad one, or a full disk, leaves ``directory`` as it was (a folder it
    created included). ``load_all`` reads them back."""
    if not isinstance(results, Mapping) or not results:
        raise ResultError("save_all takes a non-empty mapping {name: result}, e.g. {'vap': vap, 'heads': heads}")
    directory = Path(directory)
    datasets = {}
    for name, obj in results.items():
        if not isinstance(name, str) or not name or name.startswith(".") or set(name) & set("/\\"):
            raise ResultError(f"result name {name!r} is no file name: use letters, digits, '-', '_' or '.'")
        if not isinstance(obj, (xr.DataArray, xr.Dataset)):
            raise ResultError(f"result {name!r} is a {type(obj).__name__}, not an xarray DataArray or Dataset")
        datasets[name] = _to_save(obj, directory / f"{name}.nc")
        if (directory / f"{name}.nc").is_dir():
            raise ResultError(f"cannot save {name!r} to {directory / f'{name}.nc'}: it is a directory; remove it")
    made = _missing_folders(directory)
    paths = {name: directory / f"{name}.nc" for name in datasets}
    try:
        _prepare_parent(directory / "result.nc")
        with ExitStack() as stack:  # every temp renamed over its name on success, all removed on failure
            temps = {name: stack.enter_context(atomic_path(path)) for name, path in paths.items()}
            for name, dataset in datasets.items():
                _write(dataset, temps[name], paths[name])
    except BaseException:
        for folder in made:  # the folders this call created, deepest first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return paths


def _to_save(obj: xr.DataArray | xr.Dataset, path: Path) -> xr.Dataset:
    """``obj`` as the Dataset `save` writes to ``path``, its attrs and numbers checked first."""
    dataset = _to_dataset(obj)
    _check_attrs(dataset)
    _check_finite(dataset, path, SAVE_FIX)
    return dataset


def _missing_folders(directory: Path) -> list[Path]:
    """``directory`` and its parents that do not exist yet, deepest first (what `save_all` would create)."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing


def load_all(directory: str | os.PathLike) -> dict[str, xr.DataArray | xr.Dataset]:
    """Every result `save_all` (or `save`) wrote into ``directory``, by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ResultNotFoundError(f"no results at {directory}: it is not a directory")
    return {path.stem: load(path) for path in sorted(directory.glob("*.nc"))}


def load(path: str | os.PathLike) -> xr.DataArray | xr.Dataset:
    """Read a result written by `save`, as the DataArray or Dataset that was saved. Its numbers are
    checked at the door: a ±inf anywhere is a `ResultError` naming the file and the variable (NaN,
    "no value there", is read as it is)."""
    path = Path(path)
    if path.is_dir():
        hint = " (a sweep directory: open it with SweepStore(path, spec))" if (path / "spec.json").exists() else ""
        raise ResultError(f"{path} is a directory{hint}, not a countlens result file")
    if not path.exists():
        raise ResultNotFoundError(f"no result file at {path}; check the path, or run the step that saves it")
    try:
        dataset = xr.load_dataset(path, engine=ENGINE)  # load_: read into memory and close the file
    except (OSError, ValueError) as e:
        raise ResultError(
            f"{path} is not a netCDF file ({e}); countlens results are saved with countlens.results.save"
        ) from e
    _check_finite(dataset, path)
    return _from_dataset(dataset.drop_encoding(), path)


#: What to do with a file that holds ±inf (`save` writes none, so another program wrote or edited it).
READ_FIX = "countlens saves none: the file was edited or written by another program; delete it and compute it again"
SAVE_FIX = "results are read back as scores and rankings: replace ±inf by NaN (no value) or a finite bound"


def _check_finite(dataset: xr.Dataset, path: Path, fix: str = READ_FIX) -> None:
    """Refuse ±inf in a result, on save and on read: results are read back as scores, rankings and
    weights, where an inf ranks first whatever it means. NaN stays legal (no value there: a layer's
    absent head)."""
    for name, variable in dataset.variables.items():
        shown = "the result" if name == DATAARRAY_VAR else f"variable {name!r}"
        require_finite_tensor(variable.values, f"{path}: {shown}", ResultError, nan=True, fix=fix)


def _to_dataset(obj: xr.DataArray | xr.Dataset) -> xr.Dataset:
    # Encoding inherited from a file the object was loaded from (chunk sizes, source) may not fit
    # the object any more; dropping it lets xarray derive a fresh one from the contents.
    if isinstance(obj, xr.DataArray):
        dataset = obj.drop_encoding().to_dataset(name=DATAARRAY_VAR)
        dataset.attrs = {KIND_ATTR: "DataArray", NAME_ATTR: _encode_name(obj.name)}
        return dataset
    if isinstance(obj, xr.Dataset):
        reserved = {KIND_ATTR, NAME_ATTR} & set(obj.attrs)
        if reserved:
            raise ResultError(f"Dataset attrs {sorted(reserved)} are reserved by countlens.results; rename them")
        dataset = obj.drop_encoding()
        dataset.attrs = {**obj.attrs, KIND_ATTR: "Dataset"}
        return dataset
    raise ResultError(f"save takes an xarray DataArray or Dataset, got {type(obj).__name__}")


def _from_dataset(dataset: xr.Dataset, path: Path) -> xr.DataArray | xr.Dataset:
    attrs = dict(dataset.attrs)
    kind = attrs.pop(KIND_ATTR, None)
    if kind == "Dataset":
        dataset.attrs = attrs
        return dataset
    if kind == "DataArray" and DATAARRAY_VAR in dataset.data_vars:
        array = dataset[DATAARRAY_VAR]
        array.name = _decode_name(attrs.get(NAME_ATTR, "null"), path)
        return array
    raise ResultError(
        f"{path} is a netCDF file but not a countlens result (no {KIND_ATTR!r} attr); "
        f"open it with xarray.open_dataset, or write results with countlens.results.save"
    )


def _decode_name(value: Any, path: Path) -> Any:
    """The DataArray's name from the JSON `save` wrote in its attr, or a `ResultError` naming the file
    and the attr when that was edited into something else."""
    try:
        return json.loads(value)
    except (TypeError, ValueError) as err:
        raise ResultError(
            f"{path}: its attr {NAME_ATTR!r} is {value!r}, not the JSON `save` writes there ({err}); it was "
            f"edited: set it to a JSON string such as '\"effect\"' (or 'null'), or save the result again"
        ) from None


def _encode_name(name: Any) -> str:
    try:
        return json.dumps(name)
    except TypeError as e:
        raise ResultError(f"DataArray name {name!r} cannot be saved; use a str name (or None)") from e


def _check_attrs(dataset: xr.Dataset) -> None:
    """Refuse attrs netCDF would store lossily (bools load as ints, one-item lists as scalars)."""
    owners = [("the result", dataset.attrs)]
    owners += [(f"variable {name!r}", var.attrs) for name, var in dataset.variables.items()]
    for owner, attrs in owners:
        for key, value in attrs.items():
            if not isinstance(key, str):
                raise ResultError(f"attr name {key!r} of {owner} is not a str; netCDF attr names are strings")
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (str, int, float, np.number)):
                raise ResultError(
                    f"attr {key!r} of {owner} is {value!r} ({type(value).__name__}); netCDF attrs must be "
                    f"str, int or float. Fix: store json.dumps(value), or build attrs with provenance()"
                )


def _prepare_parent(path: Path) -> None:
    parent = path.parent
    if path.is_dir():
        raise ResultError(f"cannot save to {path}: it is a directory; give a file path such as {path / 'result.nc'}")
    if parent.exists() and not parent.is_dir():
        raise ResultError(
            f"cannot save to {path}: its parent {parent} is a file, not a directory; choose a path inside a directory"
        )
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ResultError(f"cannot save to {path}: a parent of it is a file, not a directory ({e})") from e
    except OSError as e:  # read-only or virtual file systems (/proc), no permission
        raise ResultError(
            f"cannot save to {path}: its directory {parent} cannot be created ({e}); choose a path you can write to"
        ) from e
    if not os.access(parent, os.W_OK):
        raise ResultError(f"cannot save to {path}: {parent} is not writable; choose a path you can write to")


def _write(dataset: xr.Dataset, tmp: Path, path: Path) -> None:
    """Write ``dataset`` to ``tmp``, the temp file of ``path``. The netCDF library reports a full disk as
    ``RuntimeError("NetCDF: HDF error")``: it is raised as the `OSError` behind it, naming ``path``
    (`countlens.files.machine_errors`), so the command line reports the disk, not a bug; values netCDF
    cannot hold (mixed Python objects) are a `ResultError` naming ``path``."""
    with machine_errors(path, dataset.nbytes):
        try:
            _write_netcdf(dataset, tmp)
        except (ValueError, TypeError) as err:
            raise ResultError(
                f"cannot save to {path}: netCDF cannot hold its values ({err}); give its variables and coords "
                "numbers, bools or strings (store anything richer as a JSON string)"
            ) from err


def _write_netcdf(dataset: xr.Dataset, tmp: Path) -> None:
    dataset.to_netcdf(tmp, engine=ENGINE)
