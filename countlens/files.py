"""Files a crash never leaves half-written: atomic replacement through a writer-tagged temp file, and
the JSON and text state files of runs, fine-tunes and sweep stores.

`atomic_path` yields a temp path beside the target and renames it over the target only when the
write finished (`os.replace` in the same directory is atomic), so a reader sees the old file or the
new one. The temp's name records its writer (`writer_id`: host and process), so a sweep store
opened by one rank removes only the temps of writers that died
(`countlens.sweep_store.writer_alive`). `read_json` and `refuse_older_spec` read a run's own state
back and say what to delete or rerun when it cannot be used.

Outputs follow one order: every argument is checked, then the folder is claimed (`claim_directory`), then
written; an output that is one of the inputs is refused (`refuse_output_over_input`), and a rerun of other
settings is told which ones differ (`settings_changes`). A file library's failure that the machine caused
(netCDF's "NetCDF: HDF error" on a full disk) becomes the `OSError` behind it (`machine_error`), so it is
reported as the disk's fault, with the file's name, and not as a bug.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from countlens.errors import InputError, RunDirError

#: The suffix of every temp file `atomic_path` writes (its name also starts with a dot).
TMP_SUFFIX = ".tmp"


def writer_id() -> str:
    """Which process on which host writes a temp file (in its name), so that a store opened by one
    rank of a sharded sweep removes only the temps of writers that died."""
    host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"
    return f"{host}~{os.getpid()}"


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a fresh temp path beside ``path``; on success it replaces ``path``, on failure it goes.

    The temp file lives in the same directory so `os.replace` is a same-filesystem rename, which
    is atomic: readers see the old file or the new one, never a mix. Its name starts with a dot
    and ends in ``.tmp`` so stale ones (from a SIGKILL) are recognisable and never mistaken for
    results. The writer creates the file itself, so it gets the usual umask permissions.
    """
    tmp = path.with_name(f".{path.name}.{writer_id()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
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
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextmanager
def directory_lock(out: Path, name: str, what: str, elsewhere: str) -> Iterator[None]:
    """Hold ``out/name`` (an exclusive `fcntl.flock`) while a ``what`` writes ``out``: a second writer is
    refused, naming the lock and the process holding it, instead of both writing the same files. The
    operating system releases the lock when its process dies (killed, crashed), so a stale lock file
    blocks nothing and a killed run resumes; the file is removed on release. ``elsewhere``: the fix."""
    import fcntl

    lock = out / name
    while True:
        f = lock.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise InputError(
                f"{out} is being written by another {what} (process {holder}, lock {lock}); wait for it to "
                f"finish, or {elsewhere}. If no such process runs, the lock is stale (a filesystem without "
                f"flock): delete {lock} and run again"
            ) from None
        if os.path.exists(lock) and os.stat(lock).st_ino == os.fstat(f.fileno()).st_ino:
            break  # not a file another process removed between our open and our flock
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield
    finally:
        lock.unlink(missing_ok=True)
        f.close()


#: The file that marks a directory as one command's output (`claim_directory`).
OWNER = ".countlens-owner.json"


def claim_directory(out: Path, command: str, spec: dict) -> None:
    """Make ``out`` ``command``'s output, or refuse it: it must be missing, empty, or already this
    command's output with the same ``spec`` (an earlier or interrupted run of it, which is redone or
    resumed). Another command's folder, a checkpoint, or a run of other settings is never written into."""
    out = Path(out)
    marker = out / OWNER
    mine = {"command": command, "spec": spec}
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{out} is a file; give a directory for `{command}`")
    if marker.exists():
        saved = read_json(marker, f"delete {out} or choose another directory")
        if not isinstance(saved, dict) or saved.get("command") != command:
            other = saved.get("command") if isinstance(saved, dict) else None
            raise RunDirError(
                f"{out} holds the output of `{other}`, not of `{command}` ({marker}); choose another directory"
            )
        spec = json.loads(json.dumps(spec))
        if saved.get("spec") != spec:
            changes = settings_changes(saved.get("spec"), spec)
            raise RunDirError(
                f"{out} holds the output of `{command}` with other settings: {changes} (old → new; {marker}); "
                f"rerun with the old settings to redo it, choose another directory, or delete {out} to write it "
                "with the new ones"
            )
        return
    if out.exists() and any(out.iterdir()):
        listed = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise RunDirError(
            f"{out} is not empty ({listed} …) and is no output of `{command}`; give an empty or new directory "
            "— countlens writes only into its own outputs"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_text(marker, json.dumps(mine, indent=1))


def settings_changes(old, new, limit: int = 6) -> str:
    """The settings that differ between a saved spec ``old`` and a rerun's ``new``, as ``steps 400 → 5,
    seed 0 → 1`` (nested ones dotted: ``train.steps``; one a spec lacks as ``(none)``), at most ``limit``
    of them and how many more: what a refusal of "other settings" names."""
    flat_old, flat_new = _flatten(old), _flatten(new)
    missing = object()
    changed = [
        key for key in sorted({*flat_old, *flat_new}) if flat_old.get(key, missing) != flat_new.get(key, missing)
    ]
    if not changed:
        return "(none that differ)"

    def shown(value) -> str:
        text = "(none)" if value is missing else json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "…"

    words = [f"{key} {shown(flat_old.get(key, missing))} → {shown(flat_new.get(key, missing))}" for key in changed]
    more = len(words) - limit
    return ", ".join(words[:limit]) + (f" and {more} more" if more > 0 else "")


def _flatten(spec, prefix: str = "") -> dict:
    if not isinstance(spec, dict):
        return {prefix or "spec": spec}
    flat: dict = {}
    for key, value in spec.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(_flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return flat


def refuse_output_over_input(output, inputs: dict, what: str = "output") -> Path:
    """``output`` as a `Path`, or an `InputError` when it is one of ``inputs`` ({name: path}; None
    skipped): both resolved (links, ``..``, relative paths), so writing ``output`` would destroy an
    input before, or while, it is read. ``what``: the output's name in the message (``--out``)."""
    out = Path(output)
    for name, given in inputs.items():
        if given is None or not isinstance(given, (str, os.PathLike)):
            continue
        source = Path(given)
        same = out.resolve() == source.resolve()
        if not same and out.exists() and source.exists():
            same = os.path.samefile(out, source)  # a hard link, or another mount of the same file
        if same:
            raise InputError(
                f"{what} {output} is {name} {given}: writing it would overwrite its own input; give another "
                f"path for the {what}"
            )
    return out


#: errno values whose OS message a file library may carry in its own error's text.
_MACHINE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
#: Free bytes below which a library's write failure is taken for a full disk.
FULL_DISK_MARGIN = 16 * 2**20


def machine_error(err: BaseException, path: Path, needed: int = 0) -> OSError | None:
    """The `OSError` behind a file library's failure to write ``path``, with ``path`` as its file name, or
    None when it is not the machine's doing. netCDF4 reports a full disk as ``RuntimeError("NetCDF:
    HDF error")`` with no errno, and h5py as an `OSError` whose errno is None: the errno is read from
    the text where it is there (HDF5's ``errno = 28``, the OS's own words), else from the machine — the
    disk of ``path`` has less than ``needed`` bytes (plus `FULL_DISK_MARGIN`) free, or its folder cannot
    be written."""
    if isinstance(err, OSError) and err.errno is not None:
        return None  # the OS's own error: it names its cause already
    if not isinstance(err, (RuntimeError, OSError)):
        return None
    text = str(err)
    code = None
    found = re.search(r"errno\s*=\s*(\d+)", text)
    if found and int(found.group(1)) in _MACHINE_ERRNOS:
        code = int(found.group(1))
    for candidate in _MACHINE_ERRNOS:
        if code is None and os.strerror(candidate).lower() in text.lower():
            code = candidate
    if code is None and ("NetCDF" in text or "HDF" in text):
        folder = Path(path).parent
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if free is not None and free < needed + FULL_DISK_MARGIN:
            code = errno.ENOSPC
        elif not os.access(folder, os.W_OK | os.X_OK):
            code = errno.EACCES
    if code is None:
        return None
    return OSError(code, f"{os.strerror(code)} (the file library said: {' '.join(text.split())[:200]})", str(path))


@contextmanager
def machine_errors(path: Path, needed: int = 0) -> Iterator[None]:
    """Around a file library's write of ``path``: its failures that the machine caused (`machine_error`)
    are raised as that `OSError`, naming ``path``; anything else passes unchanged."""
    try:
        yield
    except (RuntimeError, OSError) as err:
        translated = machine_error(err, path, needed)
        if translated is None:
            raise
        raise translated from err
