"""Task scenes: the organism's tasks (counting and two non-counting tasks) on one scene model.

Every sample is a pure function of ``(seed, task, index)``: its random generator is seeded with
that triple, so samples can be generated in any order, in any number of workers, and come out
identical. The organism is trained on seeds ≥ 1000 (`TRAIN_SEED_BASE`); evaluations use small
seeds, so held-out scenes are never training scenes.

Tasks (answers are single words: single tokens of the organism's tokenizer; real tokenizers write
"12" as two, see `countlens.model.answers`):

- ``count``: "how many circles are there in the image?" → "0" … "12". 70 % of scenes hold only
  the named shape (one colour or several); 30 % mix in 1–4 objects of other shapes, so the
  question's shape word matters. One scene in eight asks "how many objects …" for the total.
- ``color``: 1–3 objects of distinct shapes; "what color is the square?" → a colour word.
- ``shape``: 1–3 objects of distinct colours; "what shape is the red object?" → a shape word.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import TYPE_CHECKING

import numpy as np

from countlens.datasets import reasoning
from countlens.datasets.recipe import recorded
from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Scene, place_objects
from countlens.errors import CountlensError, InputError
from countlens.validate import require_choice, require_count, require_image_side, require_integer, require_seed

if TYPE_CHECKING:
    from PIL import Image

TASKS: tuple[str, ...] = ("count", "color", "shape")  # the organism's trained tasks
#: Reasoning tasks for the head overlap with counting (`countlens.datasets.reasoning`): not trained.
REASONING_TASKS: tuple[str, ...] = ("math", "spatial")
TRAIN_SEED_BASE = 1000
MAX_COUNT = 12
SIZE_RANGE = (12.0, 22.0)  # object sizes in px at 192 px (one 16-px patch ± a few px); scaled with the image
MIN_OBJECT_SIZE = 2.0  # px: smaller shapes may cover no pixel centre at some rotations


@dataclass(frozen=True)
class TaskSample:
    """One question about one scene, with its single-word answer."""

    scene: Scene
    question: str
    answer: str
    task: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    # The generator call that makes the sample again (`countlens.datasets.recipe`); empty if loaded.
    recipe: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def image(self) -> Image.Image:
        return self.scene.render()


def count_of(sample, where: str = "the sample") -> int:
    """The scene's true count n (``meta["count"]``, else its number of objects), refused below 1."""
    meta = getattr(sample, "meta", None) or {}
    n = meta.get("count", len(sample.scene.objects))
    if not isinstance(n, Integral) or n < 1:
        raise InputError(f"{where} counts {n!r}: the metric logit(n) − logit(n − 1) needs a count n ≥ 1")
    return int(n)


def fewer_answer(sample, n: int, where: str = "the sample", count: int | None = None) -> str:
    """The sample's answer with its count n replaced by ``count`` (None: n − 1, the answer had one
    object been missed). The answer must name n exactly once."""
    answer = getattr(sample, "answer", None)
    answer = answer if isinstance(answer, str) else ""
    pattern = rf"(?<!\d){n}(?!\d)"
    if len(re.findall(pattern, answer)) != 1:
        raise InputError(
            f"{where}'s answer {answer!r} does not name its count {n} (its meta's count, else its number of objects) "
            "exactly once, so the answer for one object fewer cannot be written; give counting samples "
            "whose answer is the object count (countingtricks, count_scenes, task_samples('count'))"
        )
    return re.sub(pattern, str(n - 1 if count is None else count), answer)


def without_objects(sample: TaskSample, indices, count: int | None = None, where: str = "the sample", **meta):
    """``sample`` drawn again without the objects at ``indices`` (`Scene.without`): its answer the
    sample's with its count n (`count_of`) replaced by ``count`` — None: n − 1, the answer had one
    object been missed, the reference answer of an object's effect however many objects are removed
    (`countlens.circuits.objects.effects`, `object_gradients`) — its meta the sample's with ``"count"``
    set to that count and ``meta`` added, its recipe empty (no generator call makes it)."""
    n = count_of(sample, where)
    count = n - 1 if count is None else count
    answer = fewer_answer(sample, n, where, count)
    scene = sample.scene.without(indices)
    return replace(sample, scene=scene, answer=answer, meta={**(sample.meta or {}), "count": count, **meta}, recipe={})


def sample_rng(seed: int, key: str, index: int) -> np.random.Generator:
    """The generator of one sample: a pure function of (seed, key, index), independent of order."""
    return np.random.default_rng([seed, zlib.crc32(key.encode()), index])


def object_sizes(image_size: int) -> tuple[float, float]:
    """The range of object sizes (px) in scenes of ``image_size``: `SIZE_RANGE` scaled from 192 px."""
    return SIZE_RANGE[0] * image_size / 192, SIZE_RANGE[1] * image_size / 192


@recorded
def task_sample(
    task: str,
    seed: int,
    index: int,
    image_size: int = 192,
    size_range: tuple[float, float] | None = None,
    max_count: int = MAX_COUNT,
) -> TaskSample:
    """The ``index``-th sample of ``task`` under ``seed``."""
    require_choice(task, "task", TASKS + REASONING_TASKS, CountlensError)
    require_integer(index, "index", low=0)
    require_image_side(image_size, "image_size")
    require_seed(seed)
    scaled = size_range is None
    if scaled:
        size_range = object_sizes(image_size)
    if not MIN_OBJECT_SIZE <= size_range[0] <= size_range[1]:
        why = (
            f"the default sizes scale from {SIZE_RANGE[0]:g} px at 192 px, so give image_size ≥ "
            f"{math.ceil(MIN_OBJECT_SIZE * 192 / SIZE_RANGE[0])}"
            if scaled
            else f"give size_range from {MIN_OBJECT_SIZE:g} px up, smallest first"
        )
        raise InputError(
            f"objects of {size_range[0]:.2g}–{size_range[1]:.2g} px at image_size {image_size}: {why} "
            "(smaller shapes may cover no pixel)"
        )
    rng = sample_rng(seed, task, index)
    if task in REASONING_TASKS:
        make = reasoning.math_sample if task == "math" else reasoning.spatial_sample
        scene, question, answer, meta = make(rng, image_size, size_range)
        return TaskSample(scene, question, answer, task, meta)
    make = {"count": _count, "color": _color, "shape": _shape}[task]
    return make(rng, image_size, size_range, max_count)


def task_samples(task: str, n: int, seed: int, start: int = 0, **kw) -> list[TaskSample]:
    """Samples ``start`` … ``start + n − 1`` of ``task`` under ``seed`` (see `task_sample`)."""
    require_count(n, "task_samples: n")
    require_choice(task, "task", TASKS + REASONING_TASKS, CountlensError)
    require_integer(start, "start", low=0)
    return [task_sample(task, seed, i, **kw) for i in range(start, start + n)]


def scene_kind(sample: TaskSample) -> str:
    """A counting sample's kind of scene: the named shape alone, the total, or the named shape among
    others ("" for the other tasks). The kinds differ in difficulty, so evaluations report them apart."""
    if sample.task != "count":
        return ""
    if sample.meta["shape"] == "any":
        return "total (how many objects)"
    return "named shape among other shapes" if sample.meta["mixed"] else "one shape only"


def _plural(shape: str) -> str:
    return shape + "s"


def _count(rng, image_size, size_range, max_count) -> TaskSample:
    n = int(rng.integers(0, max_count + 1))
    target = SHAPES[rng.integers(len(SHAPES))]
    mixed = bool(rng.random() < 0.3)
    ask_total = bool(rng.random() < 0.125)
    colors = OBJECT_COLORS if rng.random() < 0.5 else (OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))],)
    shapes = [target] * n
    if mixed:
        others = [s for s in SHAPES if s != target]
        n_other = int(rng.integers(1, 5))
        if ask_total:
            n_other = min(n_other, max_count - n)
        shapes += [others[rng.integers(len(others))] for _ in range(n_other)]
    order = rng.permutation(len(shapes))
    specs = [(shapes[i], colors[rng.integers(len(colors))], float(rng.uniform(*size_range))) for i in order]
    objs = place_objects(rng, image_size, image_size, specs)
    if ask_total:
        question, answer = "how many objects are there in the image?", str(len(objs))
    else:
        question, answer = f"how many {_plural(target)} are there in the image?", str(n)
    meta = {"count": int(answer), "shape": "any" if ask_total else target, "mixed": mixed}
    return TaskSample(Scene(image_size, image_size, objs), question, answer, "count", meta)


def _color(rng, image_size, size_range, max_count) -> TaskSample:
    """What colour is the <shape>? Objects of distinct shapes, random colours."""
    return _attribute_question(rng, image_size, size_range, ask="color")


def _shape(rng, image_size, size_range, max_count) -> TaskSample:
    """What shape is the <colour> object? Objects of distinct colours, random shapes."""
    return _attribute_question(rng, image_size, size_range, ask="shape")


def _attribute_question(rng, image_size, size_range, ask: str) -> TaskSample:
    # The named attribute is distinct across the scene's 1–3 objects, so the question has one answer.
    named, asked = (SHAPES, OBJECT_COLORS) if ask == "color" else (OBJECT_COLORS, SHAPES)
    k = int(rng.integers(1, len(SHAPES) + 1))
    names = [named[i] for i in rng.permutation(len(named))[:k]]
    answers = [asked[rng.integers(len(asked))] for _ in names]
    shapes, colors = (names, answers) if ask == "color" else (answers, names)
    specs = [(s, c, float(rng.uniform(*size_range))) for s, c in zip(shapes, colors)]
    objs = place_objects(rng, image_size, image_size, specs)
    q = int(rng.integers(k))
    if ask == "color":
        question, meta = f"what color is the {names[q]}?", {"shape": names[q], "n_objects": k}
    else:
        question, meta = f"what shape is the {names[q]} object?", {"color": names[q], "n_objects": k}
    return TaskSample(Scene(image_size, image_size, objs), question, answers[q], ask, meta)


#: How many samples `count_task_sample` draws at most (each count 0 … 12 comes about once in 13).
SCENE_SEARCH = 2000


def count_task_sample(count: int, seed: int) -> TaskSample:
    """The first sample of ``task_samples("count", ·, seed)`` whose answer is ``count`` (the scene
    ``countlens features graph --count`` draws); samples are pure functions of (seed, index), so the
    choice is reproducible."""
    require_integer(count, "count", low=0)
    require_seed(seed)
    for index in range(SCENE_SEARCH):
        sample = task_sample("count", seed, index)
        if sample.meta["count"] == count:
            return sample
    raise InputError(f"no scene of {count} objects among the first {SCENE_SEARCH} of seed {seed}: try another seed")
