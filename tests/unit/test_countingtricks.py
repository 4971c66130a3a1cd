"""COUNTINGTRICKS: exact positions on two grids, labels equal drawn objects, adjacency really touches."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import ndimage

from countlens.datasets.contact import boundary_gap, facing_rotation, pixel_joined, shared_edge
from countlens.datasets.countingtricks import CASES, capacity, countingtricks, trick_sample
from countlens.datasets.export import export_countingtricks
from countlens.datasets.scene import Obj
from countlens.errors import CountlensError, InputError
from countlens.model.geometry import Geometry

# The organism's grid, a 14 px ViT's, and the MAS paper's 384 px / 27 px (14 whole cells and a 6 px partial one).
GRIDS = [Geometry.square(192, 16), Geometry.square(224, 14), Geometry.data_grid(384, 27)]
N = 12  # samples per case and grid: every count 3..12 once and two more


def samples(name: str, grid: Geometry):
    return [trick_sample(name, 0, i, grid) for i in range(N)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.image_width}-{g.patch_size}px")
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.anchor])
def test_lattice_centres_sit_where_the_case_says(name, grid):
    c, p = CASES[name], grid.patch_size
    on_x = {"center": 0.5, "vline": 0.0, "hline": 0.5, "cross": 0.0}[c.anchor]
    on_y = {"center": 0.5, "vline": 0.5, "hline": 0.0, "cross": 0.0}[c.anchor]
    for s in samples(name, grid):
        assert len(s.scene.objects) == s.meta["count"]
        assert s.answer == f"{s.meta['shape'].removesuffix('s')}: {s.meta['count']}"  # Pstd format
        for o in s.scene.objects:
            # Offset of the centre from its anchor, in patches: exactly 0 without jitter.
            dx = (o.cx / p - on_x) - round(o.cx / p - on_x)
            dy = (o.cy / p - on_y) - round(o.cy / p - on_y)
            limit = c.jitter + 1e-12
            assert abs(dx) <= limit and abs(dy) <= limit, (o, c)
            if c.jitter == 0:
                assert dx == 0 and dy == 0
            assert c.size[0] * p - 1e-9 <= o.size <= c.size[1] * p + 1e-9
            # Anchors belong to whole cells: never the centre of a partial last cell.
            rows, cols = grid.patch_grid
            assert o.cx - dx * p <= cols * p and o.cy - dy * p <= rows * p
        # Counting connected components of the drawn image gives the label.
        ink = (s.scene.render_array() != 255).any(-1)
        assert ndimage.label(ink, structure=np.ones((3, 3)))[1] == s.meta["count"]


def test_jitter_cases_actually_jitter():
    offs = [o.cx % 16 for s in samples("1C", GRIDS[0]) for o in s.scene.objects]
    assert np.std(offs) > 0.5


def _touch_px(a_mask: np.ndarray, b_mask: np.ndarray) -> float:
    """Smallest distance between pixel centres of two masks, minus one pixel (0 = adjacent pixels)."""
    pa, pb = np.argwhere(a_mask), np.argwhere(b_mask)
    d = np.sqrt(((pa[:, None, :] - pb[None, :, :]) ** 2).sum(-1)).min()
    return max(0.0, d - 1.0)


@pytest.mark.matrix
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.image_width}-{g.patch_size}px")
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.layout])
def test_adjacency_cases_touch(name, grid):
    c = CASES[name]
    for s in samples(name, grid)[::3]:
        objs = s.scene.objects
        assert len(objs) == s.meta["count"]
        masks = s.scene.masks()
        gaps = np.array(
            [[boundary_gap(a, b) if i != j else np.inf for j, b in enumerate(objs)] for i, a in enumerate(objs)]
        )
        # No two objects overlap, and every object has a neighbour exactly gap_px away.
        assert gaps.min() >= c.gap_px - 1e-6
        nearest = gaps.min(axis=1)
        assert np.allclose(nearest, c.gap_px, atol=1e-6), (name, nearest)
        for i, j in zip(*np.nonzero(np.isclose(gaps, c.gap_px, atol=1e-6))):
            if i < j:
                # In pixels, too: neighbouring masks within 1 px of each other (2 px where a sharp
                # triangle vertex is the contact and its tip pixel is not drawn).
                sharp = "triangle" in (objs[i].shape, objs[j].shape)
                assert _touch_px(masks[i], masks[j]) <= (2.0 if sharp else 1.0) + c.gap_px, (name, objs[i], objs[j])


def test_capacity_cuts_default_counts_and_rejects_explicit_overflow():
    small = Geometry.square(192, 16)
    assert capacity("8A", small) == 4  # 64-px objects, p/2 apart, on a 12x12 grid
    counts = {s.meta["count"] for s in (trick_sample("8A", 0, i, small) for i in range(6))}
    assert counts == {3, 4}
    with pytest.raises(InputError, match="8A fits at most 4"):
        trick_sample("8A", 0, 0, small, counts=[3, 5])
    with pytest.raises(CountlensError, match="fits only"):
        trick_sample("8A", 0, 0, image_size=112, patch_size=16)


def test_counts_and_shapes_are_balanced_and_samples_pure():
    data = countingtricks(["4A"], n_per_case=60, image_size=192, patch_size=16, seed=3)
    counts = np.bincount([s.meta["count"] for s in data])
    assert set(counts[3:13]) == {6}
    assert {s.meta["shape"] for s in data} == {"circle", "square", "triangle"}
    again = trick_sample("4A", 3, 17, image_size=192, patch_size=16)
    assert np.array_equal(again.scene.render_array(), data[17].scene.render_array())


def test_conflict_prompt_keeps_the_image_and_records_a_near_distractor():
    std = trick_sample("1A", 0, 5, image_size=192, patch_size=16)
    con = trick_sample("1A", 0, 5, image_size=192, patch_size=16, prompt="conflict")
    assert std.scene == con.scene
    assert abs(con.meta["distractor"] - con.meta["count"]) in (1, 2)
    assert str(con.meta["distractor"]) in con.question


def test_bad_input_names_the_thing():
    with pytest.raises(InputError, match="unknown COUNTINGTRICKS case '16A'"):
        countingtricks(["16A"], grid=GRIDS[0])
    with pytest.raises(InputError, match="unknown shape 'hexagon'"):
        trick_sample("1A", 0, 0, GRIDS[0], shapes=("hexagon",))
    with pytest.raises(InputError, match="grid="):
        trick_sample("1A", 0, 0)


def test_export_is_byte_identical_for_any_worker_count(tmp_path):
    kw = dict(cases=["1D", "9A", "14B"], n=6, grid=GRIDS[1], seed=1)
    m1 = export_countingtricks(tmp_path / "a", workers=1, **kw)
    m2 = export_countingtricks(tmp_path / "b", workers=2, **kw)
    assert m1.read_bytes() == m2.read_bytes()
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.png"))
    assert len(files) == 18
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


def test_export_rejects_a_file_and_writes_nothing_for_bad_counts(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        export_countingtricks(tmp_path / "f", cases=["1A"], n=1, grid=GRIDS[0])
    with pytest.raises(InputError, match="fits at most"):
        export_countingtricks(tmp_path / "new", cases=["1A", "8A"], n=1, grid=GRIDS[0], counts=[12])
    assert not (tmp_path / "new").exists()


def test_ring_neighbours_touch_for_every_shape():
    from countlens.datasets.arrangements import ring

    for shape in ("circle", "square", "triangle"):
        members = ring(shape, 7, 16.0, 0.0)
        from countlens.datasets.scene import Obj

        objs = [Obj(s, "red", x + 100, y + 100, 16.0, r) for s, r, x, y in members]
        for a, b in zip(objs, objs[1:] + objs[:1]):
            assert math.isclose(boundary_gap(a, b), 0.0, abs_tol=1e-6)


def test_export_refuses_a_non_empty_directory_and_overwrite_replaces_only_its_own_files(tmp_path):
    grid = GRIDS[0]
    export_countingtricks(tmp_path, ["1A", "9A"], 5, grid, seed=0, workers=1)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="export with other settings"):
        export_countingtricks(tmp_path, ["1A"], 2, grid, seed=0, workers=1)
    assert len(list(tmp_path.rglob("*.png"))) == 10  # the refused call changed nothing
    with pytest.raises(InputError, match="not empty"):  # a folder with no export of countlens's in it
        export_countingtricks(tmp_path / "images", ["1A"], 2, grid, seed=0, workers=1)
    manifest = export_countingtricks(tmp_path, ["1A"], 2, grid, seed=0, workers=1, overwrite=True)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png"))
    assert files == ["images/1A/1A_00000.png", "images/1A/1A_00001.png"]
    assert len(manifest.read_text().splitlines()) == 2 and (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "images" / "9A").exists()


def test_an_interrupted_export_resumes_to_the_files_of_an_uninterrupted_one(tmp_path):
    """Ctrl-C (here: at the 4th image) leaves a partial manifest; the same call again writes the
    rest, byte for byte the export an uninterrupted call makes, and a finished export is kept."""
    grid, args = GRIDS[0], (["1A", "9A"], 3)

    def stop_at_4(k: int) -> None:
        if k == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_countingtricks(tmp_path / "a", *args, grid, seed=1, workers=1, progress=stop_at_4)
    assert not (tmp_path / "a" / "manifest.jsonl").exists()
    with open(tmp_path / "a" / "manifest.jsonl.partial", "a") as f:
        f.write('{"file": "images/9A/9A_0')  # a line cut short by the interruption
    export_countingtricks(tmp_path / "a", *args, grid, seed=1, workers=1)
    export_countingtricks(tmp_path / "b", *args, grid, seed=1, workers=2)

    def files(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(tmp_path / "a") == files(tmp_path / "b") and len(files(tmp_path / "a")) == 8  # 6 PNGs, manifest, spec
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    export_countingtricks(tmp_path / "a", *args, grid, seed=1, workers=1)  # finished: left as it is
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == before


def test_exported_palette_pngs_load_as_the_exact_rgb_pixels(tmp_path):
    import json

    from PIL import Image

    export_countingtricks(tmp_path, ["1B", "9A", "14A"], 3, GRIDS[1], seed=2, workers=1, color=("red", "blue"))
    for line in (tmp_path / "manifest.jsonl").read_text().splitlines():
        rec = json.loads(line)
        with Image.open(tmp_path / rec["file"]) as im:
            assert im.mode == "P"  # 8-bit palette
            rgb = np.asarray(im.convert("RGB"))
        index = int(rec["file"].rsplit("_", 1)[1].split(".")[0])
        want = trick_sample(rec["case"], 2, index, GRIDS[1], color=("red", "blue")).scene.render_array()
        np.testing.assert_array_equal(rgb, want)


def test_generating_and_exporting_loads_no_torch(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from countlens.datasets import countingtricks; "
        "from countlens.datasets.export import export_countingtricks; from countlens.model.geometry import Geometry; "
        f"export_countingtricks({str(tmp_path)!r}, ['1A', '9A'], 2, Geometry.data_grid(384, 27), workers=1); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert len(list(tmp_path.rglob("*.png"))) == 4


def test_footprints_are_shared_read_only():
    s = trick_sample("1A", 0, 0, GRIDS[0])
    again = trick_sample("1A", 0, 0, GRIDS[0])
    m = s.scene.footprints[0][2]
    assert again.scene.footprints[0][2] is m  # one placement, drawn once
    with pytest.raises(ValueError):
        m[0, 0] = True
    assert s.scene.masks()[0].flags.writeable  # what callers get is theirs


def _touching_polygon_pairs(scene):
    objs, masks = scene.objects, scene.masks()
    for a in range(len(objs)):
        for b in range(a + 1, len(objs)):
            if abs(boundary_gap(objs[a], objs[b])) < 1e-6 and "circle" not in (objs[a].shape, objs[b].shape):
                yield objs[a], objs[b], masks[a], masks[b]


@pytest.mark.parametrize("grid", GRIDS[::2], ids=lambda g: f"{g.image_width}-{g.patch_size}px")
@pytest.mark.parametrize("name", ["9A", "10A", "11A"])
def test_touching_polygons_in_lines_share_an_edge_that_shows(name, grid):
    seen = 0
    for i in range(30):  # counts 3..12 under each shape
        s = trick_sample(name, 0, i, grid)
        for a, b, ma, mb in _touching_polygon_pairs(s.scene):
            seen += 1
            assert shared_edge(a, b) >= 0.5 * grid.patch_size, (name, i, a, b)
            assert pixel_joined(ma, mb, 4), (name, i, a, b)
    assert seen > 50


def test_cluster_polygons_each_share_an_edge_with_a_neighbour():
    for i in range(30):
        s = trick_sample("13A", 0, i, GRIDS[0])
        objs = s.scene.objects
        if objs[0].shape == "circle":
            continue
        for k, o in enumerate(objs):
            assert max(shared_edge(o, other) for j, other in enumerate(objs) if j != k) >= 1.0, (i, o)


def test_contact_helpers_on_hand_made_pairs():
    up = Obj("triangle", "red", 0.0, 0.0, 16.0)
    assert shared_edge(Obj("square", "red", 0, 0, 10), Obj("square", "red", 10, 3, 10)) == pytest.approx(7.0)
    assert shared_edge(up, Obj("circle", "red", 20, 0, 16)) == 0.0
    assert shared_edge(Obj("square", "red", 0, 0, 10), Obj("square", "red", 10, 10, 10)) == 0.0  # corners only
    rot, shared = facing_rotation("triangle", 0.0, "triangle", 16.0, 0.0)
    assert rot == 60.0 and shared == pytest.approx(2 / 3 * 8 * math.sqrt(3))  # down beside up: 2/3 of an edge
    assert facing_rotation("square", 0.0, "square", 16.0, 45.0) == (0.0, 0.0)  # diagonal: corners only
    a = np.zeros((5, 5), dtype=bool)
    a[2, 2] = True
    diagonal, beside = np.zeros_like(a), np.zeros_like(a)
    diagonal[3, 3], beside[2, 3] = True, True
    assert pixel_joined(a, beside, 4) and not pixel_joined(a, diagonal, 4) and pixel_joined(a, diagonal, 8)
    assert not pixel_joined(a, np.zeros_like(a), 8)


def test_a_lattice_sample_at_mistral_3s_native_size_stays_small():
    """Mistral 3's processor keeps 1540 px images (`countlens plan` at its native size): 110 × 110 patches
    of 14 px, ~12,000 anchors. A (k, k) table of anchor distances held 1.2 GB per case (the plan was
    killed for memory); a sample must cost a few MB, and place its objects as at any size."""
    import tracemalloc

    grid = Geometry.square(1540, 14)
    tracemalloc.start()
    try:
        s = trick_sample("1A", 0, 0, grid)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(s.scene.objects) == s.meta["count"]
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"
