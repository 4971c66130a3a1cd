"""The math and spatial tasks: every answer recomputed from the scene's objects alone (not from the
generator's own bookkeeping), spatial answers clear of the margin, and samples pure functions of
their seed on any image size."""

from __future__ import annotations

import re

import numpy as np
import pytest

from countlens.datasets.reasoning import margin
from countlens.datasets.tasks import task_sample, task_samples

SIZES = (32, 64, 192, 384)


def _count(scene, shape: str) -> int:
    return sum(o.shape == shape for o in scene.objects)


def _math_answer(question: str, scene) -> int:
    """The answer from the question's words and the objects drawn."""
    patterns = {
        r"how many (\w+)s and (\w+)s are there in total\?": lambda a, b: a + b,
        r"how many more (\w+)s than (\w+)s are there\?": lambda a, b: a - b,
        r"what is the number of (\w+)s times the number of (\w+)s\?": lambda a, b: a * b,
    }
    for pattern, op in patterns.items():
        m = re.fullmatch(pattern, question)
        if m:
            return op(_count(scene, m[1]), _count(scene, m[2]))
    m = re.fullmatch(r"how many (\w+)s would there be if (\d+) more were added\?", question)
    assert m, question
    return _count(scene, m[1]) + int(m[2])


@pytest.mark.parametrize("size", SIZES)
def test_math_answers_are_the_arithmetic_of_the_drawn_groups(size):
    samples = task_samples("math", 60, 4, image_size=size)
    assert {s.meta["op"] for s in samples} == {"sum", "difference", "product", "add"}
    for s in samples:
        assert s.task == "math" and s.answer == str(_math_answer(s.question, s.scene)), s.question
        assert int(s.answer) >= 1
        assert len({o.shape for o in s.scene.objects}) == 2  # exactly the two groups asked about
    assert any(len(s.answer) == 2 for s in samples)  # multi-digit answers (products, additions)


def _find(scene, name: str):
    """The one object called ``name`` ("red circle") or, for a bare shape, the one of that shape."""
    words = name.split()
    found = [o for o in scene.objects if [o.color, o.shape][-len(words) :] == words]
    assert len(found) == 1, (name, scene.objects)
    return found[0]


def _spatial_answer(question: str, scene, m: float) -> str:
    """The answer from the objects' centres; asserts that every object read is clear of the margin."""
    side = re.fullmatch(r"is the (\w+ \w+) (left|right) of the (\w+ \w+)\?", question)
    if side:
        x, ref = _find(scene, side[1]), _find(scene, side[3])
        dx = x.cx - ref.cx
        assert abs(dx) >= m
        return "yes" if (dx < 0) == (side[2] == "left") else "no"
    count = re.fullmatch(r"how many objects are (left|right) of the (\w+ \w+)\?", question)
    colour = re.fullmatch(r"what color is the object (left|right) of the (\w+)\?", question)
    match = count or colour
    assert match, question
    ref = _find(scene, match[2])
    dxs = [o.cx - ref.cx for o in scene.objects if o is not ref]
    assert all(abs(dx) >= m for dx in dxs)  # nobody sits on the fence
    on_side = [o for o in scene.objects if o is not ref and ((o.cx < ref.cx) == (match[1] == "left"))]
    if count:
        return str(len(on_side))
    assert len(on_side) == 1
    return on_side[0].color


@pytest.mark.parametrize("size", SIZES)
def test_spatial_answers_follow_from_the_centres_with_a_margin(size):
    samples = task_samples("spatial", 60, 5, image_size=size)
    kinds = {s.question.split()[0] + " " + s.question.split()[1] for s in samples}
    assert kinds == {"is the", "how many", "what color"}
    for s in samples:
        names = [(o.color, o.shape) for o in s.scene.objects]
        assert len(set(names)) == len(names) and 3 <= len(names) <= 5  # every object nameable
        assert s.answer == _spatial_answer(s.question, s.scene, margin(size)), s.question
    assert {"yes", "no"} <= {s.answer for s in samples}


@pytest.mark.parametrize("task", ["math", "spatial"])
def test_samples_are_pure_functions_of_seed_and_index_and_render(task):
    a = task_samples(task, 6, 9, image_size=64)
    b = [task_sample(task, 9, i, image_size=64) for i in reversed(range(6))][::-1]
    assert [(s.question, s.answer, s.scene) for s in a] == [(s.question, s.answer, s.scene) for s in b]
    assert [s.question for s in task_samples(task, 6, 10, image_size=64)] != [s.question for s in a]
    image = np.asarray(a[0].image)
    assert image.shape == (64, 64, 3) and (image != 255).any()


def test_a_local_copy_stands_in_for_the_procedural_task(tmp_path, loaded):
    """--spatial ROOT: the ablation's spatial samples are CLEVR's questions (its first n_samples)."""
    import json

    from PIL import Image

    from countlens.errors import ConfigError
    from countlens.pipeline.config import DiscoverConfig
    from countlens.pipeline.inputs import stage_inputs

    root = tmp_path / "CLEVR_v1.0"
    (root / "questions").mkdir(parents=True)
    (root / "images" / "val").mkdir(parents=True)
    questions = [
        {
            "question": f"Is the cube left of {i} spheres?",
            "answer": "yes",
            "image_index": i,
            "image_filename": f"{i}.png",
            "program": [{"function": "relate", "value_inputs": ["left"]}],
        }
        for i in range(3)
    ]
    (root / "questions" / "CLEVR_val_questions.json").write_text(json.dumps({"questions": questions}))
    for i in range(3):
        Image.new("RGB", (20, 20)).save(root / "images" / "val" / f"{i}.png")
    config = DiscoverConfig(n_samples=2, tasks=("count", "spatial"), spatial=str(root))
    data = stage_inputs(loaded("toy"), config, "short")["tasks"]()
    assert [s.question for s in data["spatial"]] == ["Is the cube left of 0 spheres?", "Is the cube left of 1 spheres?"]
    assert len(data["count"]) == 2 and data["count"][0].task == "count"
    with pytest.raises(ConfigError, match="add 'math' to tasks"):
        DiscoverConfig(math=str(root))
    with pytest.raises(ConfigError, match="no such file or directory"):
        DiscoverConfig(tasks=("count", "spatial"), spatial=str(tmp_path / "nowhere"))


def test_a_multiple_choice_question_is_scored_over_its_own_choices(loaded):
    """MathVista-style questions: candidate scoring reads each question's options, not the task's
    pooled answers (real Qwen vocabulary: multi-token options)."""
    import io

    from PIL import Image

    from countlens.analysis.evaluate import score
    from countlens.datasets.loaders import QuestionSample

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    samples = [
        QuestionSample(
            None, buf.getvalue(), "Which value is shown?", "12.5", "math", "fixture", "0", ("3", "12.5", "40")
        ),
        QuestionSample(None, buf.getvalue(), "What is the colour?", "red", "math", "fixture", "1", ("red", "blue")),
    ]
    ds = score(loaded("qwen2_5_vl"), samples)
    assert ds.attrs["method"] == "candidate scoring" and list(ds.n_candidates.values) == [3, 2]
    assert ds.pred.values[0] in ("3", "12.5", "40") and ds.pred.values[1] in ("red", "blue")


def test_options_stay_with_their_question(loaded, tmp_path):
    """Single-token options are still scored as options (not over the whole vocabulary); a free-form
    question's candidates never include another question's options; bad options are refused."""
    import io

    from PIL import Image

    from countlens.analysis.evaluate import candidate_sets, score
    from countlens.datasets.loaders import LoaderError, QuestionSample

    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    image = buf.getvalue()
    picked = QuestionSample(None, image, "how many circles are there?", "3", "math", "f", "0", ("2", "3"))
    free = [QuestionSample(None, image, "how many?", a, "math", "f", str(i)) for i, a in enumerate(("4", "5"))]
    ds = score(loaded("toy"), [picked])
    assert ds.attrs["method"] == "candidate scoring" and ds.pred.values[0] in ("2", "3")
    sets = candidate_sets([picked, *free], None)
    assert sets[0] == {"2": -1, "3": -1} and set(sets[1]) == set(sets[2]) == {"4", "5"}
    for choices, match in ((("3",), "at least two"), ("23", "tuple of strings"), (("2", "4"), "holding the answer")):
        with pytest.raises(LoaderError, match=match):
            QuestionSample(None, image, "q?", "3", "math", "f", "x", choices)
    with pytest.raises(LoaderError, match="answer '' must be a non-empty string"):
        QuestionSample(None, image, "q?", "", "math", "f", "x")
