"""COUNTINGTRICKS throughput: images/s of generation alone vs generation + PNG export, side by side.

    .venv/bin/python bench/countingtricks_throughput.py     # writes bench/countingtricks_throughput.json

All 32 cases on the organism's grid (`ToyConfig().geometry`, 192 px, 16 px patches), ``n`` samples
per case. Measured in one run, each the median wall time over ``repeats``:

- ``generate``: `trick_sample` only (scene layout; the image is not drawn — `TaskSample.image` is lazy);
- ``generate_render``: `trick_sample` + ``.image`` (the pixels);
- ``generate_render_record``: the above + `export.sample_record` (the manifest line, boxes from masks);
- ``export_w1`` / ``export_w2``: `export_countingtricks(tmp, cases, n, grid, seed, workers=W)`, which also
  encodes PNGs and writes them and the manifest into a temporary directory (W=2 forks a process pool,
  whose start-up is included).

Each export is done at two sizes (``n`` and ``n_large`` per case) to show the pool's start-up cost
amortising. The W=1 and W=2 directories are compared byte for byte (the exporter promises identity).
Other engineers may share the machine: ``others_load_cores`` is the CPU (in cores) other processes
used during a size's measurements, from /proc/stat; figures taken with it well above 0 are suspect.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from countlens.datasets.countingtricks import CASES, trick_sample
from countlens.datasets.export import export_countingtricks, sample_record
from countlens.toy.recipe import ToyConfig


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


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def main(n: int = 30, n_large: int = 120, repeats: int = 3, seed: int = 0) -> dict:
    grid = ToyConfig().geometry
    cases = list(CASES)
    assert len(cases) == 32

    def gen(k):
        return lambda: [trick_sample(c, seed, i, grid) for c in cases for i in range(k)]

    def gen_render(k):
        return lambda: [trick_sample(c, seed, i, grid).image for c in cases for i in range(k)]

    def gen_render_record(k):
        def run():
            for c in cases:
                for i in range(k):
                    s = trick_sample(c, seed, i, grid)
                    s.image
                    sample_record(s, "x.png")
        return run

    gen(1)()  # warm-up (imports, caches)
    result: dict = {
        "cases": len(cases), "grid": [grid.image_height, grid.image_width, grid.patch_size], "seed": seed,
        "repeats": repeats, "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "sizes": {},
    }
    for k in (n, n_large):
        images = len(cases) * k
        row: dict = {"n_per_case": k, "images": images}
        load = Load().__enter__()
        for name, fn in (("generate", gen(k)), ("generate_render", gen_render(k)),
                         ("generate_render_record", gen_render_record(k))):
            row[f"{name}_img_per_s"] = round(images / median_time(fn, repeats), 1)
        digests = {}
        with tempfile.TemporaryDirectory() as tmp:
            for w in (1, 2):
                runs = iter(range(repeats))

                def export(w=w):
                    out = Path(tmp) / f"w{w}_{next(runs)}"
                    export_countingtricks(out, cases, k, grid, seed, workers=w)

                row[f"export_w{w}_img_per_s"] = round(images / median_time(export, repeats), 1)
                digests[w] = tree_digest(Path(tmp) / f"w{w}_0")
        row["export_w1_w2_identical"] = digests[1] == digests[2]
        load.__exit__()
        row["others_load_cores"] = load.others
        g = row["generate_render_img_per_s"]
        row["ratio_export_w1_vs_generate_render"] = round(row["export_w1_img_per_s"] / g, 3)
        row["ratio_export_w2_vs_generate_render"] = round(row["export_w2_img_per_s"] / g, 3)
        row["ratio_export_w1_vs_generate"] = round(row["export_w1_img_per_s"] / row["generate_img_per_s"], 3)
        row["speedup_w2_vs_w1"] = round(row["export_w2_img_per_s"] / row["export_w1_img_per_s"], 3)
        result["sizes"][str(k)] = row
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
