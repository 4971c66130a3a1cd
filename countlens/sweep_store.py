"""Resumable sweeps: `SweepStore`, a directory of finished chunks so a killed sweep resumes without
recomputing any, and `samples_digest`, which records the samples a stored result was computed on.

Each finished unit of a long sweep (a layer, a case, a shard's key) is `countlens.results.save`d as
its own netCDF chunk, written atomically (`countlens.files.atomic_path`); `SweepStore.todo` lists
what is left, and `SweepStore.assemble` joins the chunks into one result. The driver of long sweeps
(chunks, shards, resume) is `countlens.circuits.engine.sweep`; this module is its storage.

    from countlens.sweep_store import SweepStore
    store = SweepStore("runs/sweep", spec={"model": "toy", "keys": keys})
    for key in store.todo():
        store.write(key, compute(key))
    full = store.assemble("layer")
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xarray as xr

from countlens.files import TMP_SUFFIX, read_json, write_text, writer_id
from countlens.results import ResultError, ResultNotFoundError, SpecMismatchError, load, save

# A key becomes a file name: no separators, no leading dot (temp files start with one), bounded
# length so the temp name (".<key>.nc.<host>~<pid>-<hex>.tmp") stays under the usual 255-byte limit.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+,-]{0,199}")


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
                if not writer_alive(str(tmp)):
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


def writer_alive(name: str) -> bool:
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
    if host != writer_id().split("~")[0]:
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
