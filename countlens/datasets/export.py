"""Write COUNTINGTRICKS to disk: one PNG per sample plus a JSONL manifest of every object's geometry.

Samples are pure functions of (seed, case, index), so workers can generate them in any order; the
pool returns them in (case, index) order and PNG encoding is deterministic, so the files and the
manifest are byte-identical for any number of workers. The manifest is written last, to a temporary
name renamed into place: a directory with ``manifest.jsonl`` is complete. An export goes into an
empty (or new) directory; ``overwrite=True`` first removes a previous export's own files there
(its images and manifest, nothing else), so a folder never mixes two exports.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path

from countlens.datasets.countingtricks import CASES, case, resolve_counts, trick_sample
from countlens.datasets.png import indexed_png
from countlens.datasets.scene import PALETTE, Obj
from countlens.datasets.tasks import TaskSample
from countlens.errors import InputError
from countlens.geometry import Geometry

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
        "case_params": CASES[s.meta["case"]].params,
    }
    return rec


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
    s = trick_sample(name, seed, index, grid, **kw)
    file = f"images/{name}/{name}_{index:05d}.png"
    return sample_record(s, file), (_png(s) if write_png else None)


_OWN_IMAGE = re.compile(r"images/[0-9]+[A-Z]/[0-9]+[A-Z]_[0-9]{5}\.png")


def _make_room(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty ``out``; with ``overwrite``, remove a previous export's own files first."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise InputError(
            f"output {out} is not empty; give a new or empty directory, or overwrite=True "
            "(--overwrite) to replace the COUNTINGTRICKS export there"
        )
    own = [p for p in out.rglob("*.png") if _OWN_IMAGE.fullmatch(p.relative_to(out).as_posix())]
    for p in own + [out / "manifest.jsonl", out / "manifest.jsonl.partial"]:
        p.unlink(missing_ok=True)
    for d in sorted((p for p in (out / "images").glob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()


def generate(
    cases: list[str], n: int, grid: Geometry, seed: int, workers: int = 1, write_png: bool = True, **kw
) -> Iterator[tuple[dict, bytes | None]]:
    """(record, png bytes) for every (case, index), in order, from ``workers`` processes."""
    jobs = [(name, seed, i, grid, kw, write_png) for name in cases for i in range(n)]
    if workers <= 1:
        yield from map(_job, jobs)
        return
    from concurrent.futures import ProcessPoolExecutor  # here: multiprocessing costs a one-worker run 20 ms

    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(_job, jobs, chunksize=max(1, min(64, len(jobs) // (4 * workers))))


def export_countingtricks(
    out: str | Path,
    cases: list[str] | None = None,
    n: int = 1000,
    grid: Geometry | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
    **kw,
) -> Path:
    """Write ``n`` samples of each case under ``out``; returns the manifest's path."""
    out = Path(out)
    names = list(CASES) if cases is None else [case(c).name for c in cases]
    if grid is None:
        raise InputError("give grid= (e.g. vlm.geometry or Geometry.square(192, 16))")
    if n < 1:
        raise InputError(f"n must be ≥ 1, got {n}")
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out} is a file; give a directory")
    # Check every case's counts and the sample options before writing anything.
    for name in names:
        resolve_counts(name, grid, kw.get("counts"))
    trick_sample(names[0], seed, 0, grid, **kw)
    _make_room(out, overwrite)
    workers = workers or os.cpu_count() or 1
    for name in names:
        (out / "images" / name).mkdir(parents=True, exist_ok=True)
    tmp = out / "manifest.jsonl.partial"
    with tmp.open("w") as f:
        for k, (rec, png) in enumerate(generate(names, n, grid, seed, workers, **kw)):
            (out / rec["file"]).write_bytes(png)
            f.write(json.dumps(rec) + "\n")
            if progress is not None:
                progress(k + 1)
    manifest = out / "manifest.jsonl"
    os.replace(tmp, manifest)
    return manifest
