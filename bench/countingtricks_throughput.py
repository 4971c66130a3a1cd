"""COUNTINGTRICKS throughput: side by side with the MAS paper's generator on its grid, the PNG
encodings, and generation vs export on the organism's grid.

    # writes bench/countingtricks_throughput.json
    .venv/bin/python bench/countingtricks_throughput.py [--reference DIR]

**paper_grid**. The reference generator's own work: its 18 circle cases (1A–4A, 1B–4B,
2C–4C, 2D–4D, 5A–8A) × 100 images at its grid, 384 px / 27 px (14 whole cells and a 6 px partial
one), counts 1–10, PNGs and labels written. Both run as whole processes pinned to one core
(``images_per_s_per_core``), one thread each for the numeric libraries, interleaved (countlens,
reference, countlens, …), each into a fresh directory; medians over ``repeats`` and the median of
the per-pair ratios. Twice: into tmpfs (``/dev/shm``: the generators' own cost) and into the temp
directory on disk, where file creation on this shared machine's ext4 adds 0.1–1.4 s of kernel time
to either side's run at random (seen with ``/usr/bin/time``), so that row's pairs scatter widely.
countlens draws counts 1–10 cut to what each case fits (6A and 7A: 9, 8A: 4; it refuses to label
more objects than it drew), and writes its manifest. countlens runs as a user's script would call
it, `export_countingtricks` in a ``python -c`` process (`PAPER_WORK`). The reference is the paper's
public ``vlm-count-eval/synthetic_data/generate.py`` (repository
leduy99/-CVPRW26-Modality-Attention-Share), not part of countlens: give a local copy's folder with
``--reference``; it runs unmodified beside a ``config.yml`` of the work above. Without it only
countlens is timed.

**png**: bytes and encode time per image of the same 180 paper-grid scenes under countlens's
palette writer (`countlens.datasets.png`), PIL's palette PNG at zlib level 1 (the export's previous
format) and PIL's RGB PNG at its default level 6 (the one before).

**organism_grid**: all 32 cases on `ToyConfig().geometry` (192 px, 16 px patches), ``n`` samples per
case, in this process, interleaved (one of each, round-robin), each the median wall time over
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

import argparse
import hashlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _timing import interleaved, measured  # noqa: E402  (bench/ is on sys.path when run as a script)

PAPER_CASES = (
    "1A",
    "2A",
    "3A",
    "4A",
    "1B",
    "2B",
    "3B",
    "4B",
    "2C",
    "3C",
    "4C",
    "2D",
    "3D",
    "4D",
    "5A",
    "6A",
    "7A",
    "8A",
)
PAPER_SIZE, PAPER_PATCH, PAPER_N, PAPER_COUNTS = 384, 27, 100, range(1, 11)
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


# countlens's side of the comparison, as a user's script would call it (run as ``python -c``, so the
# process imports what the work needs and nothing of this bench).
PAPER_WORK = f"""
import sys
from pathlib import Path
from countlens.datasets.countingtricks import capacity
from countlens.datasets.export import export_countingtricks
from countlens.model.geometry import Geometry

grid = Geometry.data_grid({PAPER_SIZE}, {PAPER_PATCH})
by_cap = {{}}
for c in {PAPER_CASES!r}:
    by_cap.setdefault(min({max(PAPER_COUNTS)}, capacity(c, grid)), []).append(c)
for cap, cases in by_cap.items():
    export_countingtricks(Path(sys.argv[1]) / f"counts_to_{{cap}}", cases, {PAPER_N}, grid, seed=0, workers=1,
                          shapes="circle", counts=range({PAPER_COUNTS[0]}, cap + 1))
"""


def _reference_config() -> str:
    """The reference's config.yml for the work above: its own defaults, one model, 100 per case."""
    lines = [
        "defaults:",
        f"  image_size: {PAPER_SIZE}",
        f"  patch_size: {PAPER_PATCH}",
        f"  images_per_case: {PAPER_N}",
        f"  count_range: [{PAPER_COUNTS[0]}, {PAPER_COUNTS[-1]}]",
        "  seed: 42",
        "  draw_grid: false",
        "  min_radius_factor: 0.3",
        "  max_radius_factor: 1.2",
        "  cases:",
    ]
    large = {"5A": "large_25", "6A": "large_30", "7A": "large_35", "8A": "large_40"}
    for c in PAPER_CASES:
        size = large.get(c) or ("fixed" if c[1] in "AC" else "varied")
        lines.append(f'    "{c}": {{name: "{c}", size: "{size}", placement: "p"}}')
    lines += [
        "models:",
        "  angga-27:",
        f"    image_size: {PAPER_SIZE}",
        f"    patch_size: {PAPER_PATCH}",
        f"    images_per_case: {PAPER_N}",
        '    description: "384x27"',
        "output:",
        '  base_path: "out"',
    ]
    return "\n".join(lines) + "\n"


def _pinned_run(argv: list[str], cwd: Path) -> float:
    # Earlier runs' writes still in the page cache would be flushed during this one: flush them first.
    os.sync()
    time.sleep(0.5)
    t = time.perf_counter()
    subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **ONE_THREAD},
        check=True,
        capture_output=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    return time.perf_counter() - t


def paper_grid(reference: Path | None, repeats: int, where: str | None) -> dict:
    images = len(PAPER_CASES) * PAPER_N
    row: dict = {
        "cases": list(PAPER_CASES),
        "image_size": PAPER_SIZE,
        "patch_size": PAPER_PATCH,
        "n_per_case": PAPER_N,
        "images": images,
        "cores": 1,
        "repeats": repeats,
    }
    me = [sys.executable, "-c", PAPER_WORK]
    row["written_to"] = where or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        root = Path(tmp)

        def ours(k: int) -> float:
            return _pinned_run([*me, str(root / f"countlens_{k}")], root)

        def theirs(k: int) -> float:
            run = root / f"reference_{k}"
            run.mkdir()
            shutil.copy(reference / "generate.py", run / "generate.py")
            (run / "config.yml").write_text(_reference_config())
            return _pinned_run([sys.executable, "generate.py"], run)

        def both():
            ours(-1)  # warm-up: the OS file cache as on a second call
            if reference is not None:
                theirs(-1)
            t_ours, t_ref = [], []
            for k in range(repeats):
                t_ours.append(ours(k))
                if reference is not None:
                    t_ref.append(theirs(k))
            return t_ours, t_ref

        (t_ours, t_ref), load = measured(both)
        pngs = lambda d: sorted(d.rglob("*.png"))  # noqa: E731
        row["countlens_pngs"] = len(pngs(root / "countlens_0"))
        row["countlens_runs_identical"] = tree_digest(root / "countlens_0") == tree_digest(
            root / f"countlens_{repeats - 1}"
        )
        row["countlens_s"] = round(statistics.median(t_ours), 3)
        row["countlens_images_per_s_per_core"] = round(images / statistics.median(t_ours), 1)
        row["countlens_png_bytes_mean"] = round(statistics.mean(p.stat().st_size for p in pngs(root / "countlens_0")))
        if reference is not None:
            ref_pngs = pngs(root / "reference_0")
            row["reference_pngs"] = len(ref_pngs)
            row["reference_s"] = round(statistics.median(t_ref), 3)
            row["reference_images_per_s_per_core"] = round(images / statistics.median(t_ref), 1)
            row["reference_png_bytes_mean"] = round(statistics.mean(p.stat().st_size for p in ref_pngs))
            row["speedup_median_of_pairs"] = round(statistics.median(r / o for o, r in zip(t_ours, t_ref)), 2)
            row["speedup_pairs_min_max"] = [
                round(min(r / o for o, r in zip(t_ours, t_ref)), 2),
                round(max(r / o for o, r in zip(t_ours, t_ref)), 2),
            ]
        else:
            row["reference"] = "not run: give --reference DIR (a local copy of the paper's synthetic_data/)"
    row["others_load_cores"] = load.others
    return row


def png_encodings(n_scenes: int = 180) -> dict:
    """Bytes and encode µs per image: countlens's writer vs PIL palette level 1 vs PIL RGB level 6."""
    import numpy as np
    from PIL import Image

    from countlens.datasets.countingtricks import trick_sample
    from countlens.datasets.png import indexed_png
    from countlens.datasets.scene import PALETTE
    from countlens.model.geometry import Geometry

    grid = Geometry.data_grid(PAPER_SIZE, PAPER_PATCH)
    scenes = [
        trick_sample(PAPER_CASES[i % len(PAPER_CASES)], 0, i, grid, shapes="circle", counts=[1, 2, 3, 4]).scene
        for i in range(n_scenes)
    ]
    indexed = [s.render_indexed() for s in scenes]
    rgb = [s.render_array() for s in scenes]

    def pil(image, **kw) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG", **kw)
        return buf.getvalue()

    def pil_palette(idx, names):
        image = Image.fromarray(idx, mode="P")
        image.putpalette([c for n in names for c in PALETTE[n]])
        return pil(image, compress_level=1)

    encoders = {
        "countlens_palette": lambda k: indexed_png(indexed[k][0], [PALETTE[n] for n in indexed[k][1]]),
        "pil_palette_level1": lambda k: pil_palette(*indexed[k]),
        "pil_rgb_level6": lambda k: pil(Image.fromarray(rgb[k], mode="RGB")),
    }
    out: dict = {"scenes": n_scenes, "image_size": PAPER_SIZE}
    for name, enc in encoders.items():
        data = [enc(k) for k in range(n_scenes)]
        assert all(
            np.array_equal(np.asarray(Image.open(io.BytesIO(d)).convert("RGB")), rgb[k]) for k, d in enumerate(data)
        )
        secs = interleaved({name: lambda: [enc(k) for k in range(n_scenes)]}, 3)[name]
        out[name] = {"bytes_mean": round(statistics.mean(map(len, data))), "encode_us": round(secs / n_scenes * 1e6, 1)}
    return out


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def organism_grid(n: int = 30, n_large: int = 90, repeats: int = 3, seed: int = 0) -> dict:
    from countlens.datasets.countingtricks import CASES, trick_sample
    from countlens.datasets.export import export_countingtricks, sample_record
    from countlens.toy.recipe import ToyConfig

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
                    _ = s.image  # renders the scene: the cost being timed
                    sample_record(s, "x.png")

        return run

    gen(1)()  # warm-up (imports, caches)
    result: dict = {
        "cases": len(cases),
        "grid": [grid.image_height, grid.image_width, grid.patch_size],
        "seed": seed,
        "repeats": repeats,
        "sizes": {},
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
                return interleaved(
                    {
                        "generate": gen(k),
                        "generate_render": gen_render(k),
                        "generate_render_record": gen_render_record(k),
                        "export_w1": lambda: export(1),
                        "export_w2": lambda: export(2),
                    },
                    repeats,
                    warm=False,
                )

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
    return result


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", type=Path, help="folder holding the paper's generate.py")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.reference is not None and not (args.reference / "generate.py").is_file():
        ap.error(f"--reference {args.reference} holds no generate.py")
    result = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": version("numpy"),
        "pillow": version("pillow"),
        "paper_grid": {
            "tmpfs": paper_grid(args.reference, args.repeats, "/dev/shm"),
            "disk": paper_grid(args.reference, args.repeats, None),
        },
        "png": png_encodings(),
        "organism_grid": organism_grid(),
    }
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
