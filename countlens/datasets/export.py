"""Write COUNTINGTRICKS to disk: one PNG per sample plus a JSONL manifest of every object's geometry.

Samples are pure functions of (seed, case, index), so workers can generate them in any order; the
pool returns them in (case, index) order and PNG encoding is deterministic, so the files and the
manifest are byte-identical for any number of workers. ``export.json`` (what the export holds: its
cases, n, grid, seed and options) is written first; the manifest grows under a temporary name,
one line per finished image, and is renamed into place at the end: a directory with
``manifest.jsonl`` is complete. An interrupted export resumes: the same call (or command) again
keeps the images its partial manifest lists and writes the rest; a finished one is left as it is.
An export goes into an empty (or new) directory, or one holding the same export; ``overwrite=True``
first removes a previous export's own files there (its images, manifest and ``export.json``,
nothing else), so a folder never mixes two exports.

One process owns an export while it writes (`owned`: a lock on ``out/.export.lock``): a second
export into the same folder is refused rather than appending to the same manifest, the pool's
workers end with their parent (a SIGTERM would otherwise leave them running), and a manifest that
does not list each image once, on disk, is refused instead of kept as finished.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path

from countlens.datasets.countingtricks import CASES, DESIGNS, case, resolve_counts, trick_sample
from countlens.datasets.paper_generator import REFERENCE_CASES, case_params, check_capacity, reference_sample
from countlens.datasets.png import indexed_png
from countlens.datasets.scene import PALETTE, Obj
from countlens.datasets.tasks import TaskSample
from countlens.errors import InputError
from countlens.files import directory_lock
from countlens.model.geometry import Geometry
from countlens.validate import require_count, require_distinct, require_seed

_OBJ_FIELDS = tuple(f.name for f in fields(Obj))  # the manifest's object keys (asdict deep-copies: slow)


def sample_record(s: TaskSample, file: str | None = None) -> dict:
    """A JSON-ready description of a sample: question, answer, case parameters, objects and boxes."""
    boxes = s.scene.boxes().tolist() if s.scene.objects else []
    objects = [{f: getattr(o, f) for f in _OBJ_FIELDS} | {"box": b} for o, b in zip(s.scene.objects, boxes)]
    rec = {
        "file": file,
        "question": s.question,
        "answer": s.answer,
        **s.meta,
        "objects": objects,
        "image_size": [s.scene.height, s.scene.width],
        "case_params": _case_params(s.meta),
    }
    return rec


def _case_params(meta: dict) -> dict:
    if meta.get("design") == "paper-code":
        return case_params(meta["case"])
    return CASES[meta["case"]].params


def _sample(name: str, seed: int, index: int, grid: Geometry, kw: dict) -> TaskSample:
    """One sample of the export's design: countlens's (`trick_sample`) or the paper code's (`reference_sample`)."""
    options = dict(kw)
    if options.pop("design", "countlens") == "paper-code":
        return reference_sample(name, seed, index, grid, **options)
    return trick_sample(name, seed, index, grid, **options)


def _png(s: TaskSample) -> bytes:
    """A flat-colour scene as a palette PNG of 1–4 bits a pixel (`png.indexed_png`;
    ``Image.open(f).convert("RGB")`` gives back its exact pixels), a textured one as RGB; zlib level 1."""
    if s.scene.noise == 0:
        idx, names = s.scene.render_indexed()
        return indexed_png(idx, [PALETTE[name] for name in names])
    buf = io.BytesIO()
    s.image.save(buf, format="PNG", optimize=False, compress_level=1)
    return buf.getvalue()


def _job(args: tuple) -> tuple[dict, bytes | None]:
    name, seed, index, grid, kw, write_png = args
    s = _sample(name, seed, index, grid, kw)
    file = f"images/{name}/{name}_{index:05d}.png"
    return sample_record(s, file), (_png(s) if write_png else None)


_OWN_IMAGE = re.compile(r"images/[0-9]+[A-Z]/[0-9]+[A-Z]_[0-9]{5}\.png")


SPEC = "export.json"
PARTIAL = "manifest.jsonl.partial"


def _remove_own(out: Path) -> None:
    """Remove a previous export's own files from ``out`` (its images, manifests and spec), nothing else."""
    if not out.is_dir():
        return
    own = [p for p in out.rglob("*.png") if _OWN_IMAGE.fullmatch(p.relative_to(out).as_posix())]
    for p in own + [out / "manifest.jsonl", out / PARTIAL, out / SPEC]:
        p.unlink(missing_ok=True)
    for d in sorted((p for p in (out / "images").glob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()


def _export_spec(names: list[str], n: int, grid: Geometry, seed: int, kw: dict) -> dict:
    """What ``export.json`` records: the cases, n, grid and seed, and every option of `trick_sample`
    with its default filled in and a single shape or colour written as a one-item list, so that the
    same export asked for in other words (from the API or the command line) is the same spec."""
    import inspect

    maker = reference_sample if kw.get("design") == "paper-code" else trick_sample
    options = {
        p.name: p.default
        for p in inspect.signature(maker).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is not p.empty
    }
    options.update(kw)
    for key in ("shapes", "color"):
        if isinstance(options.get(key), str):
            options[key] = (options[key],)
    # ``dropped`` only where set: an export.json written before the field existed still matches its spec.
    grid_fields = {k: v for k, v in asdict(grid).items() if k != "dropped" or v}
    spec = {"cases": names, "n": n, "grid": grid_fields, "seed": seed, **options}
    return json.loads(json.dumps(spec, default=str))


def _saved_spec(out: Path) -> dict | None:
    """The ``export.json`` of an export in ``out``, or None when there is none (or it is unreadable:
    then the folder is treated as foreign, and only ``overwrite`` replaces it)."""
    try:
        return json.loads((out / SPEC).read_text())
    except (OSError, ValueError):
        return None


def _finished_lines(partial: Path) -> int:
    """How many records an interrupted export's partial manifest holds whole; the file is cut
    after them (a line cut short by the interruption is dropped and rewritten)."""
    if not partial.exists():
        return 0
    data = partial.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    lines = keep.count(b"\n")
    if len(keep) != len(data):
        partial.write_bytes(keep)
    return lines


def generate(
    cases: list[str],
    n: int,
    grid: Geometry,
    seed: int,
    workers: int = 1,
    write_png: bool = True,
    start: int = 0,
    **kw,
) -> Iterator[tuple[dict, bytes | None]]:
    """(record, png bytes) for every (case, index), in order, from ``workers`` processes; from the
    ``start``-th (case-major order) on."""
    jobs = [(name, seed, i, grid, kw, write_png) for name in cases for i in range(n)][start:]
    workers = min(workers, len(jobs))  # never more processes than images left
    if workers <= 1:
        yield from map(_job, jobs)
        return
    from concurrent.futures import ProcessPoolExecutor  # here: multiprocessing costs a one-worker run 20 ms

    with ProcessPoolExecutor(max_workers=workers, initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
        yield from pool.map(_job, jobs, chunksize=max(1, min(64, len(jobs) // (4 * workers))))


def _die_with_parent(parent: int) -> None:
    """A pool worker's first act: end when the export's process ends. A SIGTERM (or SIGKILL) ends the
    parent without shutting its pool down, and the workers, waiting on the pool's queue, would live
    on. Linux's PR_SET_PDEATHSIG sends them SIGTERM at once; elsewhere a daemon thread watches the
    parent's pid."""
    import ctypes
    import signal
    import sys
    import threading
    import time

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="countlens-parent-watch").start()


def check_export(
    out: str | Path,
    cases: list[str] | str | None,
    n: int,
    grid: Geometry | None,
    seed: int,
    workers: int | None = None,
    overwrite: bool = False,
    **kw,
) -> tuple[list[str], dict]:
    """Refuse an export that cannot be written, before anything is: every argument, every case's
    counts, the sample options, and what ``out`` holds. Returns the case names and the export's spec
    (what ``export.json`` records)."""
    out = Path(out)
    if isinstance(cases, str):
        cases = [cases]
    design = kw.get("design", "countlens")
    if design not in DESIGNS:
        raise InputError(f"unknown design {design!r}; use one of {DESIGNS}")
    if design == "paper-code":
        names = list(REFERENCE_CASES) if cases is None else [str(c).upper() for c in cases]
        bad = [c for c in names if c not in REFERENCE_CASES]
        if bad:
            raise InputError(f"cases {bad} are not among the paper code's 18 cases {list(REFERENCE_CASES)}")
    else:
        names = list(CASES) if cases is None else [case(c).name for c in cases]
    if not names:
        raise InputError("no cases given; name some (e.g. ['1A', '9B']) or give None for all 32")
    require_distinct(names, "cases")
    if grid is None:
        raise InputError("give grid= (e.g. vlm.geometry or Geometry.square(192, 16))")
    require_count(n, "n")
    require_seed(seed)
    if workers is not None:
        require_count(workers, "workers")
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out} is a file; give a directory")
    for name in names if design == "countlens" else ():
        resolve_counts(name, grid, kw.get("counts"))
    if design == "paper-code":  # cases the grid cannot hold refused, those it holds short of 10 said
        check_capacity(names, grid)
    try:
        _sample(names[0], seed, 0, grid, kw)
    except TypeError as err:  # an option the design's sample function does not take
        raise InputError(f"export options {sorted(kw)}: {err}") from None
    spec = _export_spec(names, n, grid, seed, kw)
    saved = _saved_spec(out) if out.is_dir() else None
    if saved is not None and saved != spec and not overwrite:
        raise InputError(
            f"output {out} holds a COUNTINGTRICKS export with other settings ({out / SPEC}); give a new "
            "directory, the same settings (to resume or keep it), or overwrite=True (--overwrite) to replace it"
        )
    if saved is None and out.is_dir() and any(p.name != LOCK for p in out.iterdir()) and not overwrite:
        raise InputError(
            f"output {out} is not empty; give a new or empty directory, or overwrite=True "
            "(--overwrite) to replace the COUNTINGTRICKS export there"
        )
    return names, spec


def export_countingtricks(
    out: str | Path,
    cases: list[str] | str | None = None,
    n: int = 1000,
    grid: Geometry | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    **kw,
) -> Path:
    """Write ``n`` samples of each case under ``out`` (resuming an interrupted export of the same
    settings there); returns the manifest's path. ``log`` hears whether a finished export was kept
    or an interrupted one resumed."""
    out = Path(out)
    names, spec = check_export(out, cases, n, grid, seed, workers, overwrite, **kw)
    say = log or (lambda _: None)
    out.mkdir(parents=True, exist_ok=True)
    with owned(out):  # what the directory holds is read under the lock: another export may have just finished
        return _write(out, names, n, grid, seed, workers, progress, overwrite, say, spec, kw)


def _write(out, names, n, grid, seed, workers, progress, overwrite, say, spec, kw) -> Path:
    """`export_countingtricks`'s writing, by the process that holds ``out``'s lock."""
    manifest, partial = out / "manifest.jsonl", out / PARTIAL
    saved = _saved_spec(out)
    if saved == spec and manifest.exists():
        try:
            _check_manifest(out, manifest, len(names) * n)
        except InputError:
            if not overwrite:
                raise
            _remove_own(out)  # a damaged export of these settings, written afresh
            saved = None
        else:
            say(f"{out} holds this export, finished: kept as it is")
            if progress is not None:
                progress(len(names) * n)
            return manifest
    if saved != spec:
        if overwrite:
            _remove_own(out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"{SPEC}.tmp"
        tmp.write_text(json.dumps(spec, indent=1) + "\n")
        os.replace(tmp, out / SPEC)
    done = _finished_lines(partial)
    if done:
        say(f"{out}: resuming an interrupted export at image {done + 1} of {len(names) * n}")
    if progress is not None:
        progress(done)
    workers = workers or os.cpu_count() or 1
    for name in names:
        (out / "images" / name).mkdir(parents=True, exist_ok=True)
    with partial.open("a") as f:
        # A record is written after its image: a listed image is whole.
        for k, (rec, png) in enumerate(generate(names, n, grid, seed, workers, start=done, **kw), start=done):
            (out / rec["file"]).write_bytes(png)
            f.write(json.dumps(rec) + "\n")
            if progress is not None:
                progress(k + 1)
    _check_manifest(out, partial, len(names) * n)
    os.replace(partial, manifest)
    return manifest


LOCK = ".export.lock"


def owned(out: Path):
    """Hold ``out``'s export lock while writing (`countlens.files.directory_lock`): a second export into
    ``out`` is refused, naming the process that holds it."""
    return directory_lock(out, LOCK, "export", "export into another directory")


def _check_manifest(out: Path, manifest: Path, expected: int) -> None:
    """Refuse a manifest that does not list each of the export's images once, each on disk: what two
    writers into one directory (or a hand edit) leave; the next run must not call it finished."""
    files = [json.loads(line)["file"] for line in manifest.read_text().splitlines() if line.strip()]
    missing = [f for f in files if not (out / f).is_file()]
    if len(files) != expected or len(set(files)) != len(files) or missing:
        why = f"{len(files)} records ({len(set(files))} distinct images) for the export's {expected} images" + (
            f", {len(missing)} of them not on disk (e.g. {missing[0]})" if missing else ""
        )
        raise InputError(
            f"{manifest} lists {why}: the export is damaged (two exports wrote into one directory?); run it again "
            "with overwrite=True (--overwrite) to write it afresh"
        )
