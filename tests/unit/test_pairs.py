"""Count pairs: same layout for shared objects, different counts, every ordered pair covered."""

from __future__ import annotations

import numpy as np
import pytest

from countlens.datasets.pairs import KINDS, count_pair, count_pairs, count_scene, count_scenes
from countlens.errors import InputError
from countlens.model.geometry import Geometry

GRID = Geometry.square(192, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_pairs_share_layout_and_differ_in_count(kind):
    for p in count_pairs(6, 3, 5, kind=kind, grid=GRID, seed=2):
        a, b = p.clean, p.corrupt
        assert (a.meta["count"], b.meta["count"]) == (3, 5) and a.question == b.question
        assert a.answer.endswith(": 3") and b.answer.endswith(": 5")  # Pstd answers: "circle: 3"
        assert b.scene.objects[:3] == a.scene.objects
        # Pixels differ only where the corrupt image's extra objects are drawn.
        diff = (a.scene.render_array() != b.scene.render_array()).any(-1)
        extra = b.scene.masks()[3:].any(0)
        assert diff.any() and not (diff & ~extra).any()


def test_all_ordered_pairs_cycle_and_pairs_are_pure():
    pairs = count_pairs(12, kind="shapes", grid=GRID, counts=(2, 3, 4), seed=0)
    got = [(p.clean.meta["count"], p.corrupt.meta["count"]) for p in pairs]
    assert sorted(set(got)) == [(2, 3), (2, 4), (3, 2), (3, 4), (4, 2), (4, 3)] and len(got) == 12
    again = count_pair(0, 7, "shapes", grid=GRID, counts=(2, 3, 4), order="stratified")  # count_pairs' order
    assert np.array_equal(again.corrupt.scene.render_array(), pairs[7].corrupt.scene.render_array())


def test_rendered_pairs_are_textured():
    img = count_pair(0, 0, "rendered", 2, 4, grid=GRID).clean.scene.render_array()
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 100


def test_bad_pair_arguments():
    with pytest.raises(InputError, match="unknown pair kind"):
        count_pair(0, 0, "photos")
    with pytest.raises(InputError, match="both clean= and corrupt="):
        count_pair(0, 0, clean=3)
    with pytest.raises(InputError, match="distinct"):
        count_pair(0, 0, clean=3, corrupt=3)
    with pytest.raises(InputError, match="not a pair prompt"):
        count_pair(0, 0, prompt="conflict")


def test_a_mix_interleaves_each_kinds_own_sequence():
    mix = count_pairs(6, kind="dots+polygons", grid=GRID, seed=4, order="cycle")
    dots = count_pairs(3, kind="dots", grid=GRID, seed=4, order="cycle")
    polygons = count_pairs(3, kind="polygons", grid=GRID, seed=4, order="cycle")
    for i, p in enumerate(mix):
        own = (dots if i % 2 == 0 else polygons)[i // 2]
        assert p.kind == own.kind and p.index == i
        assert p.clean.scene == own.clean.scene and p.corrupt.scene == own.corrupt.scene
    with pytest.raises(InputError, match="unknown pair kind 'dots\\+lines'"):
        count_pair(0, 0, "dots+lines")


def test_count_scenes_cycle_their_counts_per_kind_and_are_pure():
    scenes = count_scenes(20, "dots+rendered", GRID, seed=1, counts=range(1, 11))
    for kind in ("dots", "rendered"):
        own = [s for s in scenes if s.meta["kind"] == kind]
        assert [s.meta["count"] for s in own] == list(range(1, 11))
        assert all(len(s.scene.objects) == s.meta["count"] for s in own)
    again = count_scenes(20, "dots+rendered", GRID, seed=1, counts=range(1, 11))
    assert [s.scene for s in again] == [s.scene for s in scenes]
    assert count_scenes(2, "dots", GRID, seed=2)[0].scene != count_scenes(2, "dots", GRID, seed=1)[0].scene
    with pytest.raises(InputError, match="counts"):
        count_scene(0, 0, "dots", counts=())
