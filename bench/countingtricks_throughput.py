"""COUNTINGTRICKS throughput: images/s of generation alone vs generation + PNG export, side by side.

    .venv/bin/python bench/countingtricks_throughput.py     # writes bench/countingtricks_throughput.json

All 32 cases on the organism's grid (`ToyConfig().geometry`, 192 px, 16 px patches), ``n`` samples
per case. Measured in one run, interleaved (one of each, round-robin), each the median wall time over
``repeats``:

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
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from countlens.datasets.countingtricks import CASES, trick_sample
from countlens.datasets.export import export_countingtricks, sample_record
from countlens.toy.recipe import ToyConfig

from _timing import interleaved, measured  # noqa: E402  (bench/ is on sys.path when run as a script)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def main(n: int = 30, n_large: int = 90, repeats: int = 3, seed: int = 0) -> dict:
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
        with tempfile.TemporaryDirectory() as tmp:
            runs = {1: iter(range(10**6)), 2: iter(range(10**6))}

            def export(w):
                export_countingtricks(Path(tmp) / f"w{w}_{next(runs[w])}", cases, k, grid, seed, workers=w)

            def one_size():
                shutil.rmtree(tmp, ignore_errors=True)
                Path(tmp).mkdir(exist_ok=True)
                runs.update({1: iter(range(10**6)), 2: iter(range(10**6))})
                return interleaved({"generate": gen(k), "generate_render": gen_render(k),
                                    "generate_render_record": gen_render_record(k),
                                    "export_w1": lambda: export(1), "export_w2": lambda: export(2)}, repeats, warm=False)

            secs, load = measured(one_size)
            for name, t in secs.items():
                row[f"{name}_img_per_s"] = round(images / t, 1)
            row["export_w1_w2_identical"] = tree_digest(Path(tmp) / "w1_0") == tree_digest(Path(tmp) / "w2_0")
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
