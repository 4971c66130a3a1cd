"""Reasoning tasks beside counting: arithmetic over groups of objects, and CLEVR-style spatial relations.

Counting Circuits compares the heads that matter for counting with those that matter for math and
for spatial reasoning (Jaccard of the top heads of each task). The paper's tasks are real
benchmarks; these are countlens's procedural stand-ins, with exact answers that a test can check
from the scene alone, each sample a pure function of (seed, task, index) on any image size:

- ``math``: two groups of shapes, A and B (a and b objects, 1 … 6 each), and one operation read
  from them: the sum ("how many circles and squares are there in total?" → a + b), the difference
  ("how many more circles than squares are there?", a > b → a − b), the product ("what is the number
  of circles times the number of squares?" → a·b, two digits from 10 on) or an addition of k
  ("how many circles would there be if 7 more were added?" → a + k).
- ``spatial``: three to five objects of distinct (colour, shape), of different sizes, and one
  relation between them: left / right of ("is the red circle left of the blue square?" → yes / no),
  the colour of the only object right (left) of a uniquely-shaped one, or how many objects are left
  (right) of one. "X is left of Y" means X's centre lies at least `margin` px left of Y's; a scene
  where any object the question reads sits within the margin of the reference is drawn again, so
  no answer hangs on a few pixels.
"""

from __future__ import annotations

from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Obj, Scene, place_objects
from countlens.errors import CountlensError

MATH_OPS: tuple[str, ...] = ("sum", "difference", "product", "add")
SPATIAL_KINDS: tuple[str, ...] = ("side", "colour", "count")
MAX_GROUP = 6  # objects per group in a math scene
REDRAWS = 200  # scenes a spatial question may draw before it gives up (never reached in tests)


def margin(image_size: int) -> float:
    """The least horizontal distance (px) between two centres that a spatial relation reads: an
    eighth of a 192-px image's 24 px, scaled with the image."""
    return 12.0 * image_size / 192


def _plural(shape: str) -> str:
    return shape + "s"


def math_sample(rng, image_size: int, size_range: tuple[float, float]) -> tuple:
    """(scene, question, answer, meta) of one arithmetic question over two groups of shapes."""
    op = MATH_OPS[rng.integers(len(MATH_OPS))]
    first, second = (SHAPES[i] for i in rng.permutation(len(SHAPES))[:2])
    if op == "difference":  # more of the first group, so the answer is a count (≥ 1)
        b = int(rng.integers(1, MAX_GROUP))
        a = int(rng.integers(b + 1, MAX_GROUP + 1))
    else:
        a, b = (int(x) for x in rng.integers(1, MAX_GROUP + 1, size=2))
    k = int(rng.integers(1, 10))
    colors = [OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))] for _ in range(a + b)]
    shapes = [first] * a + [second] * b
    order = rng.permutation(len(shapes))
    specs = [(shapes[i], colors[i], float(rng.uniform(*size_range))) for i in order]
    objects = place_objects(rng, image_size, image_size, specs)
    A, B = _plural(first), _plural(second)
    question, answer = {
        "sum": (f"how many {A} and {B} are there in total?", a + b),
        "difference": (f"how many more {A} than {B} are there?", a - b),
        "product": (f"what is the number of {A} times the number of {B}?", a * b),
        "add": (f"how many {A} would there be if {k} more were added?", a + k),
    }[op]
    meta = {"op": op, "shapes": [first, second], "counts": [a, b], "k": k if op == "add" else None}
    return Scene(image_size, image_size, objects), question, str(answer), meta


def _name(o: Obj) -> str:
    return f"{o.color} {o.shape}"


def spatial_sample(rng, image_size: int, size_range: tuple[float, float]) -> tuple:
    """(scene, question, answer, meta) of one relation question; scenes are redrawn (from the same
    generator) until every object the question reads is clear of the reference by `margin`."""
    kind = SPATIAL_KINDS[rng.integers(len(SPATIAL_KINDS))]
    side = ("left", "right")[rng.integers(2)]
    m = margin(image_size)
    for _ in range(REDRAWS):
        n = int(rng.integers(3, 6))
        pairs = [(color, shape) for color in OBJECT_COLORS for shape in SHAPES]
        chosen = [pairs[i] for i in rng.permutation(len(pairs))[:n]]  # distinct (colour, shape)
        specs = [(shape, color, float(rng.uniform(*size_range))) for color, shape in chosen]
        objects = place_objects(rng, image_size, image_size, specs)
        ref = objects[rng.integers(n)]
        others = [o for o in objects if o is not ref]
        sign = -1 if side == "left" else 1  # "left of ref": cx below ref.cx
        beyond = [o for o in others if sign * (o.cx - ref.cx) >= m]
        if kind == "side":
            other = others[rng.integers(len(others))]
            if abs(other.cx - ref.cx) < m:
                continue
            answer = "yes" if other in beyond else "no"
            question = f"is the {_name(other)} {side} of the {_name(ref)}?"
            meta = {"relation": side, "subject": _name(other), "reference": _name(ref)}
            return Scene(image_size, image_size, objects), question, answer, meta
        if any(abs(o.cx - ref.cx) < m for o in others):
            continue  # some object is neither clearly left nor clearly right of the reference
        if kind == "count":
            question = f"how many objects are {side} of the {_name(ref)}?"
            meta = {"relation": side, "reference": _name(ref), "count": len(beyond)}
            return Scene(image_size, image_size, objects), question, str(len(beyond)), meta
        # colour: the reference named by its shape alone (so it must be the only one of its shape),
        # and exactly one object on the asked side.
        if sum(o.shape == ref.shape for o in objects) != 1 or len(beyond) != 1:
            continue
        question = f"what color is the object {side} of the {ref.shape}?"
        meta = {"relation": side, "reference": ref.shape, "subject": _name(beyond[0])}
        return Scene(image_size, image_size, objects), question, beyond[0].color, meta
    raise CountlensError(
        f"no {kind!r} spatial scene with every object {m:.1f} px clear of the reference in {REDRAWS} draws "
        f"at image_size {image_size}; use a larger image"
    )
