"""Controlled count pairs for activation patching: two images that differ only in how many objects.

A pair draws one layout of max(clean, corrupt) objects; the clean image shows its first ``clean``
objects and the corrupt image its first ``corrupt``, so every object they share has the same shape,
colour, size and position, and the question is the same. Patching corrupt activations into the
clean run then moves only the count. Kinds:

- ``dots``: black dots (size 0.8 × the patch) — "how many dots …";
- ``shapes``: one shape per pair in mixed palette colours (the organism's counting distribution);
- ``polygons``: circles, squares and triangles mixed — "how many objects …";
- ``rendered``: ``shapes`` on a textured, noisy background (a stand-in for rendered, SynReal-like
  scenes); clean and corrupt share the texture, so the noise is not a difference between them.

``clean``/``corrupt`` fix one count pair (e.g. 3 → 5); left as None, pairs cycle by index through
every ordered pair of distinct counts in ``counts``. Every pair is a pure function of (seed, kind, index).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from countlens.datasets.prompts import PAIR_PROMPTS, answer_text, make_question
from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Scene, place_objects
from countlens.datasets.tasks import SIZE_RANGE, TaskSample, sample_rng
from countlens.errors import InputError, require_count
from countlens.geometry import Geometry

KINDS: tuple[str, ...] = ("dots", "shapes", "polygons", "rendered")
DEFAULT_COUNTS: tuple[int, ...] = tuple(range(1, 10))
TEXTURE_NOISE = 18.0


@dataclass(frozen=True)
class CountPair:
    """A clean and a corrupt sample whose shared objects are identical; both carry their gold answer."""

    clean: TaskSample
    corrupt: TaskSample
    kind: str
    index: int


def count_pair(
    seed: int,
    index: int,
    kind: str = "shapes",
    clean: int | None = None,
    corrupt: int | None = None,
    grid: Geometry | None = None,
    image_size: int | None = None,
    counts=DEFAULT_COUNTS,
    prompt: str = "std",
) -> CountPair:
    """The ``index``-th pair of ``kind`` under ``seed``."""
    if kind not in KINDS:
        raise InputError(f"unknown pair kind {kind!r}; use one of {KINDS}")
    if prompt not in PAIR_PROMPTS:
        raise InputError(f"prompt {prompt!r} is not a pair prompt; use one of {PAIR_PROMPTS}")
    if (clean is None) != (corrupt is None):
        raise InputError("give both clean= and corrupt= (a fixed count pair) or neither (all pairs of counts=)")
    if clean is None:
        options = list(permutations(sorted(set(int(c) for c in counts)), 2))
        if not options:
            raise InputError(f"counts={counts!r} needs at least two distinct values to form pairs")
        clean, corrupt = options[index % len(options)]
    if clean == corrupt or min(clean, corrupt) < 0:
        raise InputError(f"clean={clean} and corrupt={corrupt} must be distinct non-negative counts")
    size = grid.image_width if grid is not None else (image_size or 192)
    height = grid.image_height if grid is not None else size
    scale = min(size, height) / 192
    rng = sample_rng(seed, f"pairs/{kind}", index)
    m = max(clean, corrupt)
    if kind == "dots":
        p = grid.patch_size if grid is not None else 16
        specs = [("circle", "black", 0.8 * p)] * m
        asked = "dots"
    else:
        if kind == "polygons":
            shapes = [SHAPES[rng.integers(len(SHAPES))] for _ in range(m)]
            asked = "objects"
        else:
            asked = SHAPES[rng.integers(len(SHAPES))]
            shapes = [asked] * m
        specs = [(s, OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))], float(rng.uniform(*SIZE_RANGE) * scale))
                 for s in shapes]
    objs = place_objects(rng, size, height, specs)
    noise = TEXTURE_NOISE if kind == "rendered" else 0.0
    noise_seed = int(rng.integers(2**31))
    question, _ = make_question(prompt, asked, m, rng)

    def sample(n: int, role: str) -> TaskSample:
        meta = {"count": n, "kind": kind, "role": role, "shape": asked, "pair": index}
        scene = Scene(size, height, objs[:n], noise=noise, noise_seed=noise_seed)
        return TaskSample(scene, question, answer_text(prompt, asked, n), "count", meta)

    return CountPair(sample(clean, "clean"), sample(corrupt, "corrupt"), kind, index)


def count_pairs(n: int, clean: int | None = None, corrupt: int | None = None, kind: str = "shapes",
                grid: Geometry | None = None, seed: int = 0, **kw) -> list[CountPair]:
    """``n`` pairs (see `count_pair`); e.g. ``count_pairs(64, 3, 5, grid=vlm.geometry)``."""
    require_count(n, "count_pairs: n (the number of pairs)")
    return [count_pair(seed, i, kind, clean, corrupt, grid, **kw) for i in range(n)]
