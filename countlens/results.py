"""Results on disk: labelled xarray objects saved as netCDF, and resumable sweeps of them.

Every countlens result is an `xarray.DataArray` or `xarray.Dataset` whose dims are plain names —
``layer``, ``head``, ``group``, ``case``, ``sample``, ``count``, ``task``, ``tap``, ``k`` — and whose
coords label them (layer indices, head labels such as ``"L3H2"``, case names such as ``"1A"``), so
``result.sel(layer=3, case="1A")`` reads the same in every analysis. Provenance travels in
``attrs``, built by `provenance` (model, architecture, countlens version, data set, seed, date);
attr values are only ``str``, ``int`` or ``float`` because netCDF attributes can hold nothing
else, so anything richer is stored as a JSON string. `save` and `load` round-trip one object
(DataArray or Dataset, its name, dims, coords, bool variables and attrs) through a netCDF4 file,
written atomically. `SweepStore` keeps one netCDF chunk per finished unit of a long sweep, so a
killed sweep resumes where it stopped and `SweepStore.assemble` joins the chunks into one result.

    from countlens import results
    da.attrs.update(results.provenance("toy", "qwen2_vl", dataset={"n": 64}, seed=0))
    results.save(da, "runs/attn.nc"); da = results.load("runs/attn.nc")

    store = results.SweepStore("runs/sweep", spec={"model": "toy", "keys": keys})
    for key in store.todo():
        store.write(key, compute(key))
    full = store.assemble("layer")
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from countlens.errors import CountlensError, InputError, RunDirError

__all__ = [
    "ResultError",
    "ResultNotFoundError",
    "SpecMismatchError",
    "SweepStore",
    "load",
    "provenance",
    "samples_digest",
    "save",
    "write_text",
]

ENGINE = "netcdf4"
# Global attrs that mark a file as ours and say how to rebuild the object; reserved in user attrs.
KIND_ATTR = "countlens_result"
NAME_ATTR = "countlens_name"
# A DataArray is stored as the single variable of a Dataset under a name no user picks.
DATAARRAY_VAR = "__countlens_dataarray__"
TMP_SUFFIX = ".tmp"
# A key becomes a file name: no separators, no leading dot (temp files start with one), bounded
# length so the temp name (".<key>.nc.<host>~<pid>-<hex>.tmp") stays under the usual 255-byte limit.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+,-]{0,199}")


class ResultError(CountlensError):
    """A result file or sweep directory that cannot be written or read as asked."""


class ResultNotFoundError(ResultError, FileNotFoundError):
    """A result file, or a sweep chunk, that does not exist."""


class SpecMismatchError(ResultError):
    """A sweep directory reopened with a spec other than the one it was started with."""


def top_sites(da: xr.DataArray, k: int | None = None, absolute: bool = False) -> list[tuple[int, int, float]]:
    """The ``k`` largest (layer, head) cells of ``da`` (all with None; by |value| with ``absolute``),
    largest first and ties in (layer, head) order: (layer, head, value), the value's sign kept; NaN
    cells (no head there) left out."""
    flat = da.stack(site=("layer", "head"))
    values = flat.values
    order = np.argsort(-(np.abs(values) if absolute else values), kind="stable")
    order = order[~np.isnan(values[order])][:k]  # NaN: a slot beyond a layer's own heads, no site
    return [(int(flat.site.values[i][0]), int(flat.site.values[i][1]), float(values[i])) for i in order]


_HEAD_LABEL = re.compile(r"L(\d+)H(\d+)")


def head_label(head: tuple[int, int]) -> str:
    """The label results, tables and reports give head (layer, head): ``"L3H2"``."""
    return f"L{head[0]}H{head[1]}"


def is_head_pair(head) -> bool:
    """Whether ``head`` is (layer, head) as two integers: a tuple, a list or a numpy row."""
    return (
        not isinstance(head, (str, bytes))
        and np.ndim(head) == 1
        and len(head) == 2
        and all(isinstance(x, Integral) and not isinstance(x, (bool, np.bool_)) for x in head)
    )


def head_key(head) -> tuple[int, int]:
    """A head as (layer, head) from either spelling countlens uses: a pair of integers, or the label
    of its tables (``"L3H2"``, `head_label`). Anything else is an `InputError` naming both forms."""
    if isinstance(head, str):
        match = _HEAD_LABEL.fullmatch(head.strip())
        if match:
            return int(match[1]), int(match[2])
    elif is_head_pair(head):
        return int(head[0]), int(head[1])
    raise InputError(f"head {head!r}: give (layer, head) as two integers, e.g. (3, 2), or its label, e.g. 'L3H2'")


_EXPERT_LABEL = re.compile(r"L(\d+)E(\d+)")


def expert_label(expert: tuple[int, int]) -> str:
    """The label results give expert (layer, expert): ``"L1E0"`` (`ablate_experts`' ``experts`` attr)."""
    return f"L{expert[0]}E{expert[1]}"


def expert_key(expert) -> tuple[int, int]:
    """An expert as (layer, expert) from either spelling countlens uses: a pair of integers, or its
    label (``"L1E0"``, `expert_label`). Anything else — ``(1, 1.7)``, ``"expert 0"`` — is an
    `InputError` naming both forms: a float is never rounded to an expert it may not mean."""
    if isinstance(expert, str):
        match = _EXPERT_LABEL.fullmatch(expert.strip())
        if match:
            return int(match[1]), int(match[2])
    elif is_head_pair(expert):  # two integers, the same test as a head's
        return int(expert[0]), int(expert[1])
    raise InputError(f"expert {expert!r}: give (layer, expert) as two integers, e.g. (1, 0), or its label, e.g. 'L1E0'")


# --------------------------------------------------------------------------------------------
# provenance


def provenance(
    model: str, arch: str, dataset: dict | str | None = None, seed: int | None = None, **extra: Any
) -> dict[str, str | int | float]:
    """Attrs recording where a result came from; every value is netCDF-safe (str, int or float).

    A dict ``dataset`` is stored as sorted JSON, so it can be compared and decoded with
    `json.loads`. ``None`` values (``dataset``, ``seed`` or an extra) are left out, since netCDF
    has no null. Extras that are not str/int/float (bools, lists, dicts) become JSON strings.
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
    for key, value in extra.items():
        if key in attrs:
            raise ResultError(f"provenance extra {key!r} would overwrite the standard attr; rename it")
        if value is not None:
            attrs[key] = _attr_value(value, key)
    return attrs


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
    dataset = _to_dataset(obj)
    _check_attrs(dataset)
    _prepare_parent(path)
    with _atomic_path(path) as tmp:
        _write_netcdf(dataset, tmp)
    return path


def load(path: str | os.PathLike) -> xr.DataArray | xr.Dataset:
    """Read a result written by `save`, as the DataArray or Dataset that was saved."""
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
    return _from_dataset(dataset.drop_encoding(), path)


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


def _write_netcdf(dataset: xr.Dataset, path: Path) -> None:
    dataset.to_netcdf(path, engine=ENGINE)


@contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """Yield a fresh temp path beside ``path``; on success it replaces ``path``, on failure it goes.

    The temp file lives in the same directory so `os.replace` is a same-filesystem rename, which
    is atomic: readers see the old file or the new one, never a mix. Its name starts with a dot
    and ends in ``.tmp`` so stale ones (from a SIGKILL) are recognisable and never mistaken for
    results. The writer creates the file itself, so it gets the usual umask permissions.
    """
    tmp = path.with_name(f".{path.name}.{_writer_id()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:  # includes KeyboardInterrupt: never leave the temp behind
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync(path: Path) -> None:
    # Without it a power loss after the rename can leave an empty file under the final name.
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, and not needed for safety
    # against a killed process (only against power loss), so failures are ignored.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def refuse_older_spec(saved: dict, spec: dict, source: Path, fix: str) -> None:
    """Refuse a saved spec (a run's or a fine-tune's) that lacks fields of today's ``spec``: an older
    countlens wrote it, and what it ran with in those fields is unknown. ``fix``: what to do instead."""
    lacking = sorted(set(spec) - set(saved))
    if lacking:
        raise RunDirError(f"{source} lacks {lacking}: it was written by an older countlens; {fix}")


def read_json(path: Path, fix: str):
    """The JSON in ``path`` (a run's own state file), or a `RunDirError` naming it and ``fix`` (what
    to delete or rerun) when it cannot be read or parsed: an edited or truncated file."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise RunDirError(f"{path} cannot be read as JSON ({err}); {fix}") from None


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the new one, never half."""
    with _atomic_path(path) as tmp:
        tmp.write_text(text)


# --------------------------------------------------------------------------------------------
# resumable sweeps


def samples_digest(samples: Iterable) -> str:
    """Which samples a stored result was computed on: a hash of each one's question, answer and
    scene layout (or image file, or id, for loaded benchmarks), in order. Stores keep it in their spec,
    so a rerun on other samples is refused instead of resumed."""
    import hashlib

    h = hashlib.sha256()
    for s in samples:
        where = getattr(s, "scene", None) or getattr(s, "image_path", None) or getattr(s, "id", None)
        h.update(f"{s.question}|{s.answer}|{where!r}".encode())
    return h.hexdigest()[:16]


class SweepStore:
    """A directory of finished sweep chunks, so a killed sweep resumes without recomputing any.

    Layout: ``spec.json`` (what the sweep computes), ``chunks/<key>.nc`` (one `save`d result per
    finished key, written atomically) and ``order.txt`` (keys in the order first written,
    append-only). A chunk exists exactly when its key is finished, so after a crash `todo` lists
    just the unfinished keys. If ``spec`` has a ``"keys"`` list, that is the sweep's plan:
    `todo` and `assemble` default to it. Opening a store deletes the temp files a killed writer
    left. The ranks of a sharded sweep (`countlens.distributed`) write one store together, each
    its own keys: temp names carry the writer's host and pid, so a rank's open spares the temps of
    live ones, and a line of ``order.txt`` lost to a concurrent rewrite is recovered from the
    chunk's age.
    """

    def __init__(self, path: str | os.PathLike, spec: dict) -> None:
        self.path = Path(path)
        self.spec = _normalise_spec(spec)
        if self.path.exists() and not self.path.is_dir():
            raise ResultError(f"sweep directory {self.path} is a file; choose a directory path")
        self.chunks.mkdir(parents=True, exist_ok=True)
        self._check_spec()
        self._remove_temp_files()
        self._order = self._reconcile_order()

    @property
    def chunks(self) -> Path:
        return self.path / "chunks"

    @property
    def _spec_file(self) -> Path:
        return self.path / "spec.json"

    @property
    def _order_file(self) -> Path:
        return self.path / "order.txt"

    def __repr__(self) -> str:
        return f"SweepStore({str(self.path)!r}, {len(self.done())} chunks done)"

    def done(self) -> set[str]:
        """Keys whose chunk is on disk."""
        return {p.stem for p in self.chunks.glob("*.nc") if not p.name.startswith(".")}

    def todo(self, keys: Iterable[str] | None = None) -> list[str]:
        """The keys (default: the spec's ``"keys"``) not finished yet, in the given order."""
        keys = self._keys_or_plan(keys, "todo")
        done = self.done()
        return [key for key in dict.fromkeys(keys) if key not in done]  # dict: dedupe, keep order

    def write(self, key: str, obj: xr.DataArray | xr.Dataset) -> Path:
        """Save one finished chunk; rewriting a key replaces its chunk and keeps its place."""
        path = save(obj, self._chunk_path(key))
        if key not in self._order:
            # After the chunk is in place: a crash in between leaves a chunk missing from
            # order.txt, which reopening repairs, never an entry without its chunk.
            with open(self._order_file, "a") as f:
                f.write(key + "\n")
            self._order.append(key)
        return path

    def read(self, key: str) -> xr.DataArray | xr.Dataset:
        path = self._chunk_path(key)
        if not path.exists():
            raise ResultNotFoundError(
                f"sweep {self.path} has no chunk {key!r} ({len(self.done())} done); "
                f"compute it and store.write({key!r}, result) first"
            )
        return load(path)

    def assemble(self, dim: str, keys: Iterable[str] | None = None) -> xr.DataArray | xr.Dataset:
        """Concatenate chunks along ``dim``: the given keys, else the spec's ``"keys"``, else every
        finished chunk in the order first written.

        ``dim`` may be a dim the chunks already have (each chunk a slice of it) or a new one.
        Other dims must carry identical coords in every chunk; attrs are the first chunk's.
        """
        if keys is None and "keys" not in self.spec:
            keys = self._written_order()
        keys = self._keys_or_plan(keys, "assemble")
        if not keys:
            raise ResultError(f"sweep {self.path} has no chunks to assemble; write some first")
        missing = [key for key in keys if key not in self.done()]
        if missing:
            raise ResultError(
                f"sweep {self.path} is missing {len(missing)} of {len(keys)} chunks "
                f"({_preview(missing)}); compute store.todo(keys) first"
            )
        # data_vars=None: concatenate variables that have `dim` (or all, if `dim` is new) and keep
        # the rest once; join="exact": chunks whose other coords differ are an error, not NaNs.
        return xr.concat(
            [self.read(key) for key in keys],
            dim=dim,
            data_vars=None,
            coords="different",
            compat="equals",
            join="exact",
            combine_attrs="override",
        )

    def _keys_or_plan(self, keys: Iterable[str] | None, caller: str) -> list[str]:
        if keys is None:
            if "keys" not in self.spec:
                raise ResultError(
                    f"store.{caller}() needs keys: pass them, or start the sweep with a spec holding a 'keys' list"
                )
            keys = self.spec["keys"]
        if isinstance(keys, str):
            raise ResultError(f"store.{caller} takes a list of keys, got the single str {keys!r}")
        keys = list(keys)
        for key in keys:
            _check_key(key)
        return keys

    def _chunk_path(self, key: str) -> Path:
        return self.chunks / f"{_check_key(key)}.nc"

    def _check_spec(self) -> None:
        if not self._spec_file.exists():
            write_text(self._spec_file, json.dumps(self.spec, sort_keys=True, indent=2) + "\n")
            return
        stored = read_json(self._spec_file, f"delete {self.path} to compute this sweep again")
        if stored != self.spec:
            raise SpecMismatchError(
                f"sweep directory {self.path} was started with spec {json.dumps(stored, sort_keys=True)}, "
                f"not {json.dumps(self.spec, sort_keys=True)} (differing: {_spec_diff(stored, self.spec)}). "
                f"Fix: use a new directory for the new spec, or reopen with the same spec to resume"
            )
        if "keys" in stored:
            for key in stored["keys"]:
                _check_key(key)

    def _remove_temp_files(self) -> None:
        # A temp file is a write a killed process never finished; its chunk counts as not done.
        # Ranks of a sharded sweep share the store: keep the temps of writers still alive.
        for directory in (self.path, self.chunks):
            for tmp in directory.glob(f".*{TMP_SUFFIX}"):
                if not _writer_alive(str(tmp)):
                    tmp.unlink(missing_ok=True)

    def _written_order(self) -> list[str]:
        """Finished keys in first-written order: order.txt, then any chunk it missed, by age."""
        done = self.done()
        listed = [key for key in dict.fromkeys(_read_lines(self._order_file)) if key in done]
        unlisted = sorted(done - set(listed), key=lambda key: (self._chunk_path(key).stat().st_mtime, key))
        return listed + unlisted

    def _reconcile_order(self) -> list[str]:
        # A kill can cut order.txt mid-line or between a chunk's rename and its line; rewrite it
        # whole so later appends start on a fresh line.
        order = self._written_order()
        text = "".join(key + "\n" for key in order)
        current = self._order_file.read_text() if self._order_file.exists() else ""
        if text != current:
            write_text(self._order_file, text)
        return order


def _writer_id() -> str:
    """Which process on which host writes a temp file (in its name), so that a store opened by one
    rank of a sharded sweep removes only the temps of writers that died."""
    host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"
    return f"{host}~{os.getpid()}"


def _writer_alive(name: str) -> bool:
    """Whether the writer a temp file's name (or path) records is a live process (on this host; a
    writer on another host is assumed alive, since it cannot be checked from here)."""
    m = re.search(r"\.([A-Za-z0-9]+)~([0-9]+)-[0-9a-f]+" + re.escape(TMP_SUFFIX) + "$", name)
    if m is None:
        raise ResultError(
            f"{name} is a temp file whose name lacks its writer's <host>~<pid>: it was written "
            "by an older countlens; delete it (an unfinished write: no finished chunk is lost) and "
            "reopen the store"
        )
    host, pid = m.group(1), int(m.group(2))
    if host != _writer_id().split("~")[0]:
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _normalise_spec(spec: dict) -> dict:
    # Through JSON and back, so the spec compares equal to what spec.json will hold (tuples become
    # lists) and anything JSON cannot hold is refused now rather than at reopen.
    if not isinstance(spec, dict):
        raise ResultError(f"SweepStore spec must be a dict, got {type(spec).__name__}")
    try:
        spec = json.loads(json.dumps(spec, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ResultError(
            f"SweepStore spec is not JSON-serialisable ({e}); use str/int/float/bool/list/dict values"
        ) from e
    if "keys" in spec and not isinstance(spec["keys"], list):
        raise ResultError(f"spec 'keys' must be a list of chunk keys, got {spec['keys']!r}")
    return spec


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ResultError(
            f"sweep key {key!r} is not a safe file name; use 1-200 characters from letters, digits and "
            f"_ . = + , - (not starting with '.' or '-'), e.g. 'layer=3' or 'case_1A'"
        )
    return key


def _read_lines(path: Path) -> list[str]:
    """Complete lines of ``path``; a last line without its newline was cut by a crash: dropped."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [line for line in lines[:-1] if line]


def _spec_diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, ...) != new.get(k, ...))
    return ", ".join(repr(k) for k in keys)


def _preview(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … {len(keys) - limit} more" if len(keys) > limit else "")
