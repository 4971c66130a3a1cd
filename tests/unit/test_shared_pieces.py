"""Shared pieces, one implementation each: Wilson's interval (`countlens.intervals.wilson`, scipy's),
the scene without some objects (`Scene.without`, `countlens.datasets.tasks.without_objects`) and the
labels of every node and edge (`countlens.labels`)."""

from __future__ import annotations

import math

import pytest

from countlens.errors import InputError
from countlens.intervals import wilson


def _closed_form(hits: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's interval written out, as countlens computed it before scipy's took its place."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@pytest.mark.parametrize(("hits", "n"), [(0, 1), (1, 1), (0, 6), (2, 6), (6, 6), (45, 50), (0, 1024), (965, 1024)])
def test_wilson_is_the_closed_form(hits, n):
    assert wilson(hits, n) == pytest.approx(_closed_form(hits, n), abs=1e-12)


def test_wilson_keeps_the_shipped_figures_and_takes_a_level():
    # planted.json's fresh accuracy_ci95 (top-half: 965 of 1024) and object_placement.json's 6 of 50.
    assert [round(x, 4) for x in wilson(965, 1024)] == [0.9264, 0.9551]
    assert [round(x, 4) for x in wilson(6, 50)] == [0.0562, 0.238]
    z90 = 1.6448536269514722
    assert wilson(2, 6, level=0.9) == pytest.approx(_closed_form(2, 6, z90), abs=1e-12)


@pytest.mark.parametrize(
    ("hits", "n", "level", "match"),
    [
        (1, 0, 0.95, "n .* ≥ 1"),
        (7, 6, 0.95, "exceeds n=6"),
        (-1, 6, 0.95, "hits"),
        (1.5, 6, 0.95, "hits"),
        (1, 6, 1.0, "level"),
    ],
)
def test_wilson_refuses_what_is_no_rate(hits, n, level, match):
    with pytest.raises(InputError, match=match):
        wilson(hits, n, level)


def _scene():
    from countlens.datasets.scene import Obj, Scene

    objs = tuple(Obj("circle", c, 20 + 30 * k, 40, 16) for k, c in enumerate(("red", "green", "blue")))
    return Scene(128, 96, objs, noise=3.0, noise_seed=5)


def test_scene_without_keeps_the_rest_in_order_on_the_same_background():
    scene = _scene()
    out = scene.without([2, 0])
    assert out.objects == (scene.objects[1],) and (out.width, out.height, out.noise_seed) == (128, 96, 5)
    assert out.without([]) == out and scene.without(1).objects == scene.without([1]).objects
    assert scene.without(range(3)).objects == () and len(scene.objects) == 3  # the scene itself unchanged
    assert out.masks().shape == (1, 96, 128)  # the footprints are the reduced scene's, not the cached full ones
    from dataclasses import replace

    assert (out.render_array() == replace(scene, objects=out.objects).render_array()).all()


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        ([3], "index 3 is not one of this scene's: the scene has 3 objects \\(indices 0..2\\)"),
        ([-1], "index -1"),
        ([1.0], "index 1.0"),
        ([True], "index True"),
        ([1, 1], "object 1 is given more than once; the scene has 3 objects .* give each index once"),
        ("01", "takes object indices, e.g. \\[0, 2\\]"),
        (None, "takes object indices"),
    ],
)
def test_scene_without_refuses_indices_it_does_not_have(indices, match):
    with pytest.raises(InputError, match=match):
        _scene().without(indices)


def test_without_objects_answers_for_one_fewer_or_the_count_given():
    from countlens.datasets.tasks import TaskSample, without_objects

    scene = _scene()
    sample = TaskSample(scene, "how many circles?", "circle: 3", "count", {"count": 3, "case": "1A"}, {"f": "x"})
    one = without_objects(sample, [0])
    assert (one.answer, one.meta, one.recipe, one.task) == ("circle: 2", {"count": 2, "case": "1A"}, {}, "count")
    assert len(one.scene.objects) == 2 and one.question == sample.question
    bg = without_objects(sample, range(3), reference="background")  # the reference answer: still n − 1
    assert bg.answer == "circle: 2" and bg.meta["reference"] == "background" and bg.scene.objects == ()
    top = without_objects(sample, [1], count=1, top=[True, False])
    assert top.answer == "circle: 1" and top.meta == {"count": 1, "case": "1A", "top": [True, False]}
    with pytest.raises(InputError, match="does not name its count 3"):
        without_objects(TaskSample(scene, "q", "three", "count", {"count": 3}), [0])
    with pytest.raises(InputError, match="the scene has 3 objects"):
        without_objects(sample, [5])


def test_every_label_function_round_trips_through_its_parser():
    from countlens import labels as lb

    assert lb.head_key(lb.head_label((3, 2))) == (3, 2) and lb.head_label((3, 2)) == "L3H2"
    assert lb.expert_key(lb.expert_label((1, 0))) == (1, 0) and lb.expert_label((1, 0)) == "L1E0"
    assert lb.feature_keys(lb.feature_label((1, 17))) == ((1, 17),) and lb.feature_label((1, 17)) == "L1F17"
    assert lb.mlp_key(lb.mlp_label(1)) == 1 and lb.mlp_label(1) == "MLP1"
    assert lb.mlp_key("L1MLP") == 1 == lb.mlp_key(1)  # the toy's former spelling, kept in a shipped planted.json
    edge = lb.edge_label(lb.head_label((0, 2)), lb.mlp_in_label(1))
    assert edge == "L0H2→MLP1.in" and lb.edge_key(edge) == ("L0H2", "MLP1.in")
    assert lb.edge_key(lb.edge_label(lb.input_label("image"), lb.kv_label((0, 1), "v"))) == ("IN.image", "L0K1.v")
    assert (lb.query_label((3, 2)), lb.kv_label((0, 1), "k"), lb.attn_in_label(1)) == ("L3H2.q", "L0K1.k", "L1.attn")
    for bad in ("MLP", "L1H2", "MLP-1", -1, True, 1.0):
        with pytest.raises(InputError, match="e.g. 'MLP1'"):
            lb.mlp_key(bad)
    for bad in ("L0H2", "→MLP1.in", "L0H2→", "a→b→c", None):
        with pytest.raises(InputError, match="upstream→receiver"):
            lb.edge_key(bad)
    with pytest.raises(InputError, match="'k' .* or 'v'"):
        lb.kv_label((0, 1), "q")


def test_sites_and_the_toy_write_the_labels_of_labels_py():
    from countlens.circuits.sites import AttnIn, Embed, Expert, HeadZ, K, Logits, MlpIn, MlpOut, Q, V
    from countlens.toy.edge_forward import EdgeSpace
    from countlens.toy.planted import PlantedNode

    labels = [s.label for s in (HeadZ(3, 2), Expert(1, 0), MlpOut(1), MlpIn(1), Q(3, 2), K(0, 1), V(0, 1))]
    assert labels == ["L3H2", "L1E0", "MLP1", "MLP1.in", "L3H2.q", "L0K1.k", "L0K1.v"]
    assert (AttnIn(1).label, Embed("image").label, Logits(2).label) == ("L1.attn", "IN.image", "logits")
    assert PlantedNode(1, None).label == "MLP1" and PlantedNode(0, 2).label == "L0H2"  # the circuits' spelling
    space = EdgeSpace(2, 2, 1)
    assert {"IN.image→L0K0.k", "L0H1→MLP1.in", "MLP1→logits"} <= set(space.edges)
    assert space.nodes[:4] == ["IN.image", "IN.text", "L0H0", "L0H1"] and space.receivers[-2:] == ["MLP1.in", "logits"]
