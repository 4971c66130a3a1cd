from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from countlens.datasets.scene import SHAPES
from countlens.datasets.tasks import TASKS, task_sample, task_samples
from countlens.errors import CountlensError


def test_count_answer_is_the_number_of_objects_drawn_of_the_named_shape():
    for s in task_samples("count", 200, seed=5):
        shape = s.meta["shape"]
        n = sum(1 for o in s.scene.objects if shape == "any" or o.shape == shape)
        assert s.answer == str(n) and 0 <= n <= 12
        assert s.question.startswith("how many")


def test_color_and_shape_answers_match_the_scene():
    for s in task_samples("color", 50, seed=5):
        (obj,) = [o for o in s.scene.objects if o.shape == s.meta["shape"]]
        assert s.answer == obj.color
    for s in task_samples("shape", 50, seed=5):
        (obj,) = [o for o in s.scene.objects if o.color == s.meta["color"]]
        assert s.answer == obj.shape and s.answer in SHAPES


def test_samples_are_pure_functions_of_seed_task_index():
    forward = [task_sample("count", 7, i).scene.render_array() for i in range(20)]
    with ThreadPoolExecutor(4) as pool:
        backward = list(pool.map(lambda i: task_sample("count", 7, i).scene.render_array(), reversed(range(20))))
    assert all(np.array_equal(a, b) for a, b in zip(forward, reversed(backward)))
    assert not np.array_equal(forward[0], task_sample("count", 8, 0).scene.render_array())


def test_all_counts_occur():
    counts = {s.meta["count"] for s in task_samples("count", 400, seed=0)}
    assert counts == set(range(13))


def test_unknown_task():
    with pytest.raises(CountlensError, match="count"):
        task_sample("sing", 0, 0)
    assert set(TASKS) == {"count", "color", "shape"}
