"""An export directory is owned by one process: a second export into it is refused while the first
writes, the pool's workers end with their parent, and a manifest that does not list each image once
is refused instead of kept as "finished"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from countlens.datasets.export import LOCK, export_countingtricks, owned
from countlens.errors import InputError
from countlens.model.geometry import Geometry

GRID = Geometry.square(96, 16)


def test_a_second_export_into_a_held_directory_is_refused_naming_the_lock(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with owned(out):  # another export writing there (a second open of the lock file is another owner)
        with pytest.raises(InputError, match=rf"another export \(process {os.getpid()}, lock .*{LOCK}\).*delete"):
            export_countingtricks(out, ["1A"], 2, GRID, workers=1)
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # the refused run wrote nothing
    assert not (out / LOCK).exists()  # released and removed
    (out / LOCK).write_text("12345\n")  # a stale lock file whose process is gone: no flock held
    manifest = export_countingtricks(out, ["1A"], 2, GRID, workers=1)
    assert len(manifest.read_text().splitlines()) == 2 and not (out / LOCK).exists()


def test_a_manifest_that_lists_an_image_twice_is_not_kept_as_finished(tmp_path):
    manifest = export_countingtricks(tmp_path, ["1A"], 2, GRID, workers=1)
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join([*lines, lines[0]]) + "\n")  # what two writers appending leave
    with pytest.raises(InputError, match=r"lists 3 records \(2 distinct images\) for the export's 2 images"):
        export_countingtricks(tmp_path, ["1A"], 2, GRID, workers=1)
    export_countingtricks(tmp_path, ["1A"], 2, GRID, workers=1, overwrite=True)  # the fix the message names
    assert len(manifest.read_text().splitlines()) == 2 and json.loads(lines[0])["file"].endswith("1A_00000.png")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc (Linux)")
def test_the_pool_workers_end_when_their_export_is_terminated(tmp_path):
    """SIGTERM ends the export's process without shutting its pool down: its two workers end too."""
    code = (
        "from countlens.datasets.export import export_countingtricks\n"
        "from countlens.model.geometry import Geometry\n"
        f"export_countingtricks({str(tmp_path / 'out')!r}, ['1A', '9A'], 400, Geometry.square(96, 16), workers=2)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        partial = tmp_path / "out" / "manifest.jsonl.partial"
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [c for c in _children(proc.pid) if _alive(c)]
        assert len(workers) >= 2, workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)]
    finally:
        if proc.poll() is None:
            proc.kill()
