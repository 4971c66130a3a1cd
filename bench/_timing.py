"""Timing for the bench scripts: medians of interleaved runs, and how busy the machine was meanwhile.

The machine is shared, so every figure records ``others_load_cores`` (CPU used by other processes
while it was measured) and measurements wait for, and retry until, a quiet machine.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


class Load:
    """CPU used by *other* processes while a block runs, in cores (0 = the machine was ours alone):
    the machine's busy time from /proc/stat minus this process's (and its children's) CPU time."""

    def __enter__(self):
        self.t, self.busy, self.own = time.perf_counter(), self._busy(), self._own()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t
        self.others = round(max(0.0, (self._busy() - self.busy) - (self._own() - self.own)) / wall, 2)

    @staticmethod
    def _busy() -> float:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def interleaved(fns: dict, repeats: int, warm: bool = True) -> dict:
    """Median seconds of each callable, run round-robin after one warm-up each."""
    for fn in fns.values() if warm else ():
        fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def wait_quiet(max_wait: float = 120.0, limit: float = 0.2) -> None:
    """Wait (up to ``max_wait`` s) for a 2 s window in which other processes use < ``limit`` cores."""
    end = time.time() + max_wait
    while time.time() < end:
        with Load() as load:
            time.sleep(2.0)
        if load.others < limit:
            return


def measured(fn, tries: int = 3, limit: float = 0.25):
    """``fn()`` under `Load`, after waiting for quiet; retried while other processes were busy.
    Returns (result, load) of the try with the least outside load."""
    best = None
    for _ in range(tries):
        wait_quiet()
        with Load() as load:
            result = fn()
        if best is None or load.others < best[1].others:
            best = (result, load)
        if load.others < limit:
            break
    return best
