import numpy as np
import pytest

from countlens.datasets.scene import PALETTE, Obj, Scene, place_objects
from countlens.errors import CountlensError


def test_circle_mask_is_the_disc_of_pixel_centres():
    s = Scene(32, 32, (Obj("circle", "red", 16.0, 16.0, 10.0),))
    m = s.masks()[0]
    rr, cc = np.mgrid[0:32, 0:32]
    expected = (cc + 0.5 - 16) ** 2 + (rr + 0.5 - 16) ** 2 <= 25
    assert np.array_equal(m, expected)
    img = s.render_array()
    assert (img[m] == PALETTE["red"]).all() and (img[~m] == PALETTE["white"]).all()


def test_square_and_triangle_areas_and_rotation():
    sq = Scene(64, 64, (Obj("square", "blue", 32, 32, 20),)).masks()[0]
    assert sq.sum() == 400
    rot = Scene(64, 64, (Obj("square", "blue", 32, 32, 20, rotation=45),)).masks()[0]
    assert abs(int(rot.sum()) - 400) <= 0.06 * 400 and not np.array_equal(sq, rot)
    tri = Scene(64, 64, (Obj("triangle", "green", 32, 32, 40),)).masks()[0]
    area = 3 * np.sqrt(3) / 4 * 20**2  # equilateral triangle with circumradius 20
    assert abs(int(tri.sum()) - area) / area < 0.03
    rows = np.nonzero(tri.any(1))[0]
    # apex up: the top row is narrower than the bottom row
    assert tri[rows[0]].sum() < tri[rows[-1]].sum()


def test_boxes_are_tight():
    s = Scene(40, 40, (Obj("square", "red", 10, 10, 6), Obj("circle", "red", 30, 30, 8)))
    assert s.boxes()[0].tolist() == [7, 7, 13, 13]


def test_object_outside_the_image_is_an_error_not_a_clipped_drawing():
    with pytest.raises(CountlensError, match="does not fit"):
        Scene(32, 32, (Obj("circle", "red", 2.0, 16.0, 10.0),))


def test_bad_shape_and_colour_name_the_choices():
    with pytest.raises(CountlensError, match="circle"):
        Obj("hexagon", "red", 5, 5, 4)
    with pytest.raises(CountlensError, match="red"):
        Obj("circle", "chartreuse", 5, 5, 4)


def test_place_objects_is_deterministic_and_keeps_gaps():
    specs = [("circle", "red", 12.0)] * 10
    a = place_objects(np.random.default_rng(3), 128, 128, specs, gap=2)
    b = place_objects(np.random.default_rng(3), 128, 128, specs, gap=2)
    assert a == b and len(a) == 10
    for i, p in enumerate(a):
        for q in a[i + 1 :]:
            assert np.hypot(p.cx - q.cx, p.cy - q.cy) >= p.radius + q.radius + 2


def test_place_objects_raises_instead_of_a_shortfall():
    with pytest.raises(CountlensError, match="could not place"):
        place_objects(np.random.default_rng(0), 40, 40, [("circle", "red", 16.0)] * 12, max_tries=50)


@pytest.mark.parametrize("shape", ["square", "triangle"])
def test_polygon_outline_matches_the_rendered_mask(shape):
    from matplotlib.path import Path as MplPath

    from countlens.datasets.scene import polygon

    for rot in (0.0, 17.0, 90.0, 180.0, 243.5):
        o = Obj(shape, "red", 40.3, 37.8, 30.0, rot)
        mask = Scene(80, 80, (o,)).masks()[0]
        ys, xs = np.mgrid[0:80, 0:80] + 0.5
        pts = np.stack([xs.ravel(), ys.ravel()], 1)
        inside = MplPath(polygon(o)).contains_points(pts, radius=-1e-6).reshape(80, 80)
        inside_loose = MplPath(polygon(o)).contains_points(pts, radius=1e-6).reshape(80, 80)
        assert (mask | ~inside).all() and (~mask | inside_loose).all()
        x0, y0, x1, y1 = o.extent()
        rows, cols = np.nonzero(mask)
        assert x0 <= cols.min() + 0.5 and cols.max() + 0.5 <= x1 and y0 <= rows.min() + 0.5 and rows.max() + 0.5 <= y1


def test_rendering_from_footprints_equals_painting_whole_image_masks():
    """Independent reference: every object's inside-test over the whole image, painted in order."""
    from countlens.datasets.countingtricks import CASES, trick_sample
    from countlens.datasets.scene import PALETTE, _inside
    from countlens.datasets.tasks import task_sample

    scenes = [trick_sample(name, 3, i, image_size=192, patch_size=16).scene for name in CASES for i in (0, 7)]
    scenes += [task_sample(t, 5, i).scene for t in ("count", "color", "shape") for i in range(6)]
    for sc in scenes:
        ys = np.arange(sc.height, dtype=np.float64)[:, None] + 0.5
        xs = np.arange(sc.width, dtype=np.float64)[None, :] + 0.5
        full = [_inside(o, xs, ys) for o in sc.objects]
        want = np.empty((sc.height, sc.width, 3), dtype=np.uint8)
        want[:] = PALETTE[sc.background]
        for o, m in zip(sc.objects, full):
            want[m] = PALETTE[o.color]
        np.testing.assert_array_equal(sc.render_array(), want)
        np.testing.assert_array_equal(sc.masks(), np.array(full).reshape(len(full), sc.height, sc.width))
        for box, m in zip(sc.boxes(), full):
            rows, cols = np.nonzero(m)
            assert tuple(box) == (cols.min(), rows.min(), cols.max() + 1, rows.max() + 1)
