"""COUNTINGTRICKS as the MAS paper's public generator writes it (``design="paper-code"``).

The paper's repository (leduy99/-CVPRW26-Modality-Attention-Share, ``vlm-count-eval/synthetic_data/
generate.py`` and ``config.yml``) draws a benchmark that differs from countlens's reconstruction
(`countlens.datasets.countingtricks`), and this module re-implements its rules in countlens's own
code, from their description, on any patch grid (p = patch size, S = image side; the paper's grid is
384 px / 27 px):

- **18 circle cases**: 1A–4A, 1B–4B, 2C–4C, 2D–4D, 5A–8A (no adjacency cases). Base radius
  R = p // 2 (13 px). Cells (i, j) with 1 ≤ i, j ≤ S // p − 2 (the outer ring excluded); a cell's
  "centre" is (p·i + R, p·j + R). Position 1 keeps the centre, 2 moves x onto the grid line p·i,
  3 moves y onto p·j, 4 moves both (a grid corner: the code's round((p·i + R) / p)·p, which on an even
  patch such as 14 px rounds half to even, so odd i's corner is the next line's). **A**: radius R;
  **B**: radius R·U(0.3, 1.2);
  **C**: radius R and the moved coordinate(s) shifted by U(−R/2, R/2) ± R/4 (sign at random), then
  clamped to [p + R, S − p − R] and truncated to an integer pixel; **D**: C's shift and B's radius.
  **5A–8A**: at the centre, radius 2.5, 3, 3.5, 4 × p/2.
- **Layouts shared by every case**: one set of cells per image index (and gap), drawn in random
  order without replacement, a cell kept when its Chebyshev distance to every kept cell is ≥ 4 (≥ 5
  for 6A, ≥ 6 for 8A), 5000 draws at most; so cases differ only by their move, radii and shifts, and
  case differences are paired. At most 9 cells fit at distance 4 on the paper's grid: a count of 10
  gets fewer circles, as in the code.
- **Counts 1–10 spread evenly**: every block of 10 consecutive indices holds each count once, in a
  seeded order (the code shuffles one list of 200 with each count 20 times: the same spread over 200
  images).
- **Circles that leave the frame are dropped**: a circle is drawn only when it lies at least R inside
  every border (x − r ≥ R, x + r ≤ S − R, and so for y); the label is the number drawn, the requested
  count kept as ``meta["requested"]``. Red circles on white, no outline.

Departures, all countlens's: every image is a pure function of (seed, case, index) — the code seeds
one global generator and draws from it in threads, so its own images are not reproducible; the
rendering is countlens's (`Scene`), not PIL's ellipse. Names are the code's; the cases mean what they
mean here, not what countlens's 32 cases of the same names mean.
"""

from __future__ import annotations

from countlens.datasets.prompts import PROMPTS, answer_text, make_question
from countlens.datasets.recipe import recorded
from countlens.datasets.scene import PALETTE, Obj, Scene
from countlens.datasets.tasks import TaskSample, sample_rng
from countlens.errors import InputError
from countlens.model.geometry import Geometry

#: The code's 18 cases, in its config's order: (position 1–4, radius letter) or dilation.
REFERENCE_CASES: tuple[str, ...] = (
    *(f"{k}A" for k in range(1, 5)),
    *(f"{k}B" for k in range(1, 5)),
    *(f"{k}C" for k in range(2, 5)),
    *(f"{k}D" for k in range(2, 5)),
    *(f"{k}A" for k in range(5, 9)),
)
REFERENCE_COUNTS: tuple[int, ...] = tuple(range(1, 11))
#: Chebyshev cell distance every two kept cells keep: the code's min_gap + 1 (3 + 1; 6A: 4 + 1; 8A: 5 + 1).
SPACING: dict[str, int] = {"6A": 5, "8A": 6}
DEFAULT_SPACING = 4
DILATION: dict[str, float] = {"5A": 2.5, "6A": 3.0, "7A": 3.5, "8A": 4.0}  # diameters in patches
MAX_DRAWS = 5000


def _check(name: str, g: Geometry) -> None:
    if name not in REFERENCE_CASES:
        raise InputError(f"case {name!r} is not one of the paper code's 18 cases {list(REFERENCE_CASES)}")
    if g.image_height != g.image_width:
        raise InputError(f"design='paper-code' draws square images; the grid is {g.image_height}x{g.image_width}")
    if g.image_width // g.patch_size < 3:
        raise InputError(f"design='paper-code' needs at least 3 patches a side; {g.image_width} px / {g.patch_size} px")


def capacity(name: str, grid: Geometry) -> int:
    """The most circles case ``name`` can draw on ``grid``: the cells along one side whose circle stays
    R inside the frame (at the case's base radius: a B / D radius varies), kept ``spacing`` apart,
    squared. On the paper's grid a spacing-4 case holds 9 (its count of 10 gets fewer, as in the code)."""
    p, side = grid.patch_size, grid.seen[1]  # the frame: off a strip the tower drops (Geometry.dropped)
    base = p // 2
    r = DILATION[name] * p / 2 if name in DILATION else base
    last = side // p - 2
    fits = [i for i in range(1, last + 1) if p * i + base - r >= base and p * i + base + r <= side - base]
    if not fits:
        return 0
    per_side = (fits[-1] - fits[0]) // SPACING.get(name, DEFAULT_SPACING) + 1
    return per_side**2


def check_capacity(names: list[str], grid: Geometry) -> None:
    """Refuse a case that can draw no circle on ``grid`` (its images would all be blank, labelled 0), and
    warn, naming each case and what it holds, where a case holds fewer circles than it does on the
    paper's grid: images asked for more get fewer (their label is the number drawn), so the counts the
    benchmark spreads evenly over 1–10 pile up at the case's capacity."""
    import warnings

    for name in names:
        _check(name, grid)
    where = f"{grid.image_width} px / {grid.patch_size} px"
    empty = [n for n in names if capacity(n, grid) == 0]
    if empty:
        raise InputError(
            f"design='paper-code' on a {where} grid: cases {empty} can draw no circle (each leaves the frame), "
            "so every image would be blank; give a larger grid (the paper's is 384 px / 27 px) or leave them out"
        )
    paper = reference_grid()
    short = {n: capacity(n, grid) for n in names if capacity(n, grid) < min(max(REFERENCE_COUNTS), capacity(n, paper))}
    if short:
        held = ", ".join(f"{n} at most {k}" for n, k in short.items())
        warnings.warn(
            f"design='paper-code' on a {where} grid holds fewer circles than the paper's grid: {held} (of "
            f"counts {REFERENCE_COUNTS[0]}–{REFERENCE_COUNTS[-1]} asked); an image asked for more gets fewer and "
            "is labelled with the number drawn, so its counts pile up there: use a grid of more patches for the "
            "full range",
            UserWarning,
            stacklevel=3,
        )


def requested_count(seed: int, index: int) -> int:
    """The count asked of image ``index``: each of 1–10 once in every block of 10 indices."""
    block = sample_rng(seed, "paper-code/counts", index // len(REFERENCE_COUNTS)).permutation(len(REFERENCE_COUNTS))
    return REFERENCE_COUNTS[int(block[index % len(REFERENCE_COUNTS)])]


def layout(seed: int, index: int, n: int, grid: Geometry, spacing: int = DEFAULT_SPACING) -> list[tuple[int, int]]:
    """The cells (i, j) of image ``index``: shared by every case of that spacing (the code's base layout)."""
    last = grid.image_width // grid.patch_size - 2
    cells = [(i, j) for i in range(1, last + 1) for j in range(1, last + 1)]
    rng = sample_rng(seed, f"paper-code/layout/{spacing}", index)
    order = rng.permutation(len(cells))[:MAX_DRAWS]
    kept: list[tuple[int, int]] = []
    for k in order:
        i, j = cells[k]
        if all(max(abs(i - a), abs(j - b)) >= spacing for a, b in kept):
            kept.append((i, j))
            if len(kept) == n:
                break
    return kept


def circles(name: str, seed: int, index: int, grid: Geometry) -> tuple[list[tuple[float, float, float]], int]:
    """The circles (x, y, radius) case ``name`` draws for image ``index``, and the count it asked for."""
    _check(name, grid)
    p, side = grid.patch_size, grid.seen[1]  # the frame: off a strip the tower drops (Geometry.dropped)
    base = p // 2
    n = requested_count(seed, index)
    cells = layout(seed, index, n, grid, SPACING.get(name, DEFAULT_SPACING))
    rng = sample_rng(seed, f"paper-code/{name}", index)
    position, letter = int(name[0]), name[1]
    low, high = p + base, side - p - base

    def shifted(line: int) -> float:
        t = rng.uniform(-base / 2, base / 2) + rng.choice((-1.0, 1.0)) * base / 4
        return float(int(min(max(line + t, low), high)))

    out = []

    def line(k: int) -> int:
        """The grid line a position moves onto: p·k, but for the corner cases the code's round((p·k + R) / p)·p,
        Python's half-to-even, which on an even patch puts odd k's corner on the next line."""
        return round((p * k + base) / p) * p if position == 4 else p * k

    for i, j in cells:
        x, y = p * i + base, p * j + base
        if name in DILATION:
            r = DILATION[name] * p / 2
        else:
            if position in (2, 4):
                x = shifted(line(i)) if letter in "CD" else line(i)
            if position in (3, 4):
                y = shifted(line(j)) if letter in "CD" else line(j)
            r = base * rng.uniform(0.3, 1.2) if letter in "BD" else base
        if x - r >= base and y - r >= base and x + r <= side - base and y + r <= side - base:
            out.append((float(x), float(y), float(r)))
    return out, n


@recorded
def reference_sample(
    name: str,
    seed: int,
    index: int,
    grid: Geometry,
    *,
    prompt: str = "std",
    color: str = "red",
    background: str = "white",
) -> TaskSample:
    """The ``index``-th image of the paper code's case ``name`` under ``seed``: a pure function of them."""
    if prompt not in PROMPTS:
        raise InputError(f"unknown prompt style {prompt!r}; use one of {tuple(PROMPTS)}")
    if color not in PALETTE:
        raise InputError(f"unknown colour {color!r}; use one of {tuple(PALETTE)}")
    drawn, asked = circles(name, seed, index, grid)
    objects = tuple(Obj("circle", color, x, y, 2 * r) for x, y, r in drawn)
    n = len(objects)
    prompt_rng = sample_rng(seed, f"paper-code/{name}/prompt", index) if PROMPTS[prompt].conflict else None
    question, prompt_meta = make_question(prompt, "circle", n, prompt_rng)
    meta = {
        "count": n,
        "requested": asked,
        "case": name,
        "family": "dilation" if name in DILATION else "position",
        "shape": "circle",
        "prompt": prompt,
        "design": "paper-code",
        "grid": [grid.image_height, grid.image_width, grid.patch_size],
        **prompt_meta,
    }
    scene = Scene(grid.image_width, grid.image_height, objects, background)
    return TaskSample(scene, question, answer_text(prompt, "circle", n), "count", meta)


def case_params(name: str) -> dict:
    """The rules of case ``name`` as data (what an export's manifest records of it)."""
    if name not in REFERENCE_CASES:
        raise InputError(f"case {name!r} is not one of the paper code's 18 cases {list(REFERENCE_CASES)}")
    if name in DILATION:
        return {"design": "paper-code", "diameter": DILATION[name], "spacing": SPACING.get(name, DEFAULT_SPACING)}
    position, letter = int(name[0]), name[1]
    return {
        "design": "paper-code",
        "moved": {1: "", 2: "x", 3: "y", 4: "xy"}[position],
        "radius": "R·U(0.3, 1.2)" if letter in "BD" else "R",
        "shift": "U(-R/2, R/2) ± R/4" if letter in "CD" else "",
        "spacing": DEFAULT_SPACING,
    }


def reference_grid(grid: Geometry | None = None) -> Geometry:
    """The paper code's grid, 384 px / 27 px (a data-set grid with a 6 px partial cell), unless given."""
    return Geometry.data_grid(384, 27) if grid is None else grid
