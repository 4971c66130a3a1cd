"""Controlled count pairs for activation patching (two images that differ only in how many objects),
and single counting scenes of the same kinds for fine-tuning and evaluation.

A pair draws one layout of max(clean, corrupt) objects; the clean image shows its first ``clean``
objects and the corrupt image its first ``corrupt``, so every object they share has the same shape,
colour, size and position, and the question is the same. Patching corrupt activations into the
clean run then moves only the count. Kinds:

- ``dots``: black dots (size 0.8 × the patch) — "how many dots …";
- ``shapes``: one shape per pair in mixed palette colours (the organism's counting distribution);
- ``polygons``: circles, squares and triangles mixed — "how many objects …";
- ``rendered``: ``shapes`` on a textured, noisy background (a stand-in for rendered, SynReal-like
  scenes); clean and corrupt share the texture, so the noise is not a difference between them.

Kinds mix with '+': ``dots+polygons`` (the Counting Circuits SynDot and SynPoly data) alternates
by index: item i is item i // 2 of its own kind. ``clean``/``corrupt`` fix one count pair (e.g.
3 → 5); left as None, pairs cycle by index through every ordered pair of distinct counts in
``counts``. Every pair and scene is a pure function of (seed, kind, index).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from countlens.datasets.prompts import PAIR_PROMPTS, answer_text, make_question
from countlens.datasets.recipe import recorded
from countlens.datasets.scene import OBJECT_COLORS, SHAPES, Scene, place_objects
from countlens.datasets.tasks import SIZE_RANGE, TaskSample, sample_rng
from countlens.errors import InputError
from countlens.model.geometry import Geometry
from countlens.validate import require_count, require_image_side, require_integer, require_seed, require_sequence

KINDS: tuple[str, ...] = ("dots", "shapes", "polygons", "rendered")
DEFAULT_COUNTS: tuple[int, ...] = tuple(range(1, 10))
#: Single scenes' counts: the Counting Circuits synthetic data covers 1–10.
SCENE_COUNTS: tuple[int, ...] = tuple(range(1, 11))
TEXTURE_NOISE = 18.0


@dataclass(frozen=True)
class CountPair:
    """A clean and a corrupt sample whose shared objects are identical; both carry their gold answer."""

    clean: TaskSample
    corrupt: TaskSample
    kind: str
    index: int


def check_kind(kind: str) -> tuple[str, ...]:
    """The single kinds of ``kind`` ("dots+polygons" → ("dots", "polygons")); raises on an unknown one."""
    parts = tuple(kind.split("+")) if isinstance(kind, str) else ()
    if not parts or any(k not in KINDS for k in parts):
        raise InputError(
            f"unknown pair kind {kind!r}; use one of {KINDS}, or several joined by '+' "
            "(e.g. 'dots+polygons': they alternate by index)"
        )
    return parts


def _check_draw(seed, index, grid, image_size) -> None:
    """The arguments every single draw takes, refused by name before anything is drawn."""
    require_seed(seed)
    require_integer(index, "index", low=0)
    if grid is not None and not isinstance(grid, Geometry):
        raise InputError(f"grid must be a Geometry (vlm.geometry), got {type(grid).__name__}")
    if image_size is not None:
        require_image_side(image_size, "image_size")


def _kind(kind: str, index: int) -> tuple[str, int]:
    """Item ``index`` of ``kind`` as (single kind, index among that kind's items): a mix interleaves
    its kinds' own sequences, so each kind still cycles through every count."""
    parts = check_kind(kind)
    return parts[index % len(parts)], index // len(parts)


def _draw(rng, kind: str, m: int, grid: Geometry | None, image_size: int | None, prompt: str):
    """One layout of ``m`` objects of ``kind``: (scene maker, the asked noun, the question)."""
    size = grid.image_width if grid is not None else (image_size or 192)
    height = grid.image_height if grid is not None else size
    scale = min(size, height) / 192
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
        specs = [
            (s, OBJECT_COLORS[rng.integers(len(OBJECT_COLORS))], float(rng.uniform(*SIZE_RANGE) * scale))
            for s in shapes
        ]
    objs = place_objects(rng, size, height, specs)
    noise = TEXTURE_NOISE if kind == "rendered" else 0.0
    noise_seed = int(rng.integers(2**31))
    question, _ = make_question(prompt, asked, m, rng)

    def scene(n: int) -> Scene:
        return Scene(size, height, objs[:n], noise=noise, noise_seed=noise_seed)

    return scene, asked, question


def _check_prompt(prompt: str) -> None:
    if prompt not in PAIR_PROMPTS:
        raise InputError(f"prompt {prompt!r} is not a pair prompt; use one of {PAIR_PROMPTS}")


@recorded
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
    _check_draw(seed, index, grid, image_size)
    kind, own = _kind(kind, index)
    _check_prompt(prompt)
    if (clean is None) != (corrupt is None):
        raise InputError("give both clean= and corrupt= (a fixed count pair) or neither (all pairs of counts=)")
    if clean is None:
        counts = require_sequence(counts, "counts", example="range(1, 10)")
        options = list(permutations(sorted(set(require_integer(c, "each of counts", low=0) for c in counts)), 2))
        if not options:
            raise InputError(f"counts={counts!r} needs at least two distinct values to form pairs")
        clean, corrupt = options[own % len(options)]
    require_integer(clean, "clean")
    require_integer(corrupt, "corrupt")
    if clean == corrupt or min(clean, corrupt) < 0:
        raise InputError(f"clean={clean} and corrupt={corrupt} must be distinct non-negative counts")
    rng = sample_rng(seed, f"pairs/{kind}", own)
    scene, asked, question = _draw(rng, kind, max(clean, corrupt), grid, image_size, prompt)

    def sample(n: int, role: str) -> TaskSample:
        meta = {"count": n, "kind": kind, "role": role, "shape": asked, "pair": index}
        return TaskSample(scene(n), question, answer_text(prompt, asked, n), "count", meta)

    return CountPair(sample(clean, "clean"), sample(corrupt, "corrupt"), kind, index)


@recorded
def count_scene(
    seed: int,
    index: int,
    kind: str = "dots",
    grid: Geometry | None = None,
    image_size: int | None = None,
    counts=SCENE_COUNTS,
    prompt: str = "std",
) -> TaskSample:
    """The ``index``-th single counting scene of ``kind`` (the counts cycle by index): fine-tuning
    data (SynDot = "dots", SynPoly = "polygons") and the rendered evaluation set ("rendered")."""
    _check_draw(seed, index, grid, image_size)
    kind, own = _kind(kind, index)
    _check_prompt(prompt)
    counts = sorted(
        set(
            require_integer(c, "each of counts", low=0)
            for c in require_sequence(counts, "counts", example="range(1, 10)")
        )
    )
    if not counts or counts[0] < 0:
        raise InputError(f"counts={counts!r}: give at least one non-negative count")
    n = counts[own % len(counts)]
    scene, asked, question = _draw(sample_rng(seed, f"scenes/{kind}", own), kind, n, grid, image_size, prompt)
    meta = {"count": n, "kind": kind, "shape": asked}
    return TaskSample(scene(n), question, answer_text(prompt, asked, n), "count", meta)


def count_scenes(n: int, kind: str = "dots", grid: Geometry | None = None, seed: int = 0, **kw) -> list[TaskSample]:
    """``n`` scenes (see `count_scene`); e.g. ``count_scenes(8000, "dots+polygons", vlm.geometry)``."""
    require_count(n, "count_scenes: n (the number of scenes)")
    require_seed(seed)
    return [count_scene(seed, i, kind, grid, **kw) for i in range(n)]


def count_pairs(
    n: int,
    clean: int | None = None,
    corrupt: int | None = None,
    kind: str = "shapes",
    grid: Geometry | None = None,
    seed: int = 0,
    **kw,
) -> list[CountPair]:
    """``n`` pairs (see `count_pair`); e.g. ``count_pairs(64, 3, 5, grid=vlm.geometry)``."""
    require_count(n, "count_pairs: n (the number of pairs)")
    require_seed(seed)
    return [count_pair(seed, i, kind, clean, corrupt, grid, **kw) for i in range(n)]
