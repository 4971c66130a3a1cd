"""Does "touching" show in the pixels? Per adjacency case, the share of neighbouring pairs whose
drawn masks join under 4- and 8-connectivity, and the share of touching polygon pairs that meet
along an edge.

    .venv/bin/python docs/countingtricks/pixel_contact.py    # writes pixel_contact.json beside it, prints the table

Neighbours are the pairs whose outlines stand exactly the case's gap apart (0 px for A, 1 px for B;
`contact.boundary_gap` within 1e-6 px). "Joined" (`contact.pixel_joined`): a pixel of one mask is a
4- (or 8-) neighbour of, or the same as, a pixel of the other. For A cases that is what touching
should look like (100 %); for B cases it is what "1 px apart" must not look like (0 %), since a
reader of the image cannot tell such a pair from a touching one. "Edge" is the share of touching
polygon–polygon pairs (squares and triangles; circles meet at a point) that share at least 1 px of
outline (`contact.shared_edge`); the last line says how many of those are 4-joined. 60 samples per
case and grid (every count 3–12 under every shape twice), seed 0, split by the shape asked, on the
organism's grid (192 px / 16 px) and the MAS paper's (384 px / 27 px).
"""

from __future__ import annotations

import json
from pathlib import Path

from countlens.datasets.contact import boundary_gap, pixel_joined, shared_edge
from countlens.datasets.countingtricks import CASES, trick_sample
from countlens.model.geometry import Geometry

GRIDS = {"192/16": Geometry.square(192, 16), "384/27": Geometry.data_grid(384, 27)}
N_SAMPLES = 60


def case_rows(name: str, grid: Geometry) -> dict:
    """Per shape asked (``objects`` for the mixed rows of 14), the pair counts and shares."""
    gap = CASES[name].gap_px
    tally: dict[str, list[int]] = {}  # shape → [pairs, joined4, joined8, polygon pairs, edges, edges joined4]
    for i in range(N_SAMPLES):
        sample = trick_sample(name, 0, i, grid)
        objs, masks = sample.scene.objects, sample.scene.masks()
        t = tally.setdefault(sample.meta["shape"], [0] * 6)
        for a in range(len(objs)):
            for b in range(a + 1, len(objs)):
                if abs(boundary_gap(objs[a], objs[b]) - gap) > 1e-6:
                    continue
                t[0] += 1
                t[1] += pixel_joined(masks[a], masks[b], 4)
                t[2] += pixel_joined(masks[a], masks[b], 8)
                if gap == 0 and "circle" not in (objs[a].shape, objs[b].shape):
                    t[3] += 1
                    if shared_edge(objs[a], objs[b]) >= 1.0:
                        t[4] += 1
                        t[5] += pixel_joined(masks[a], masks[b], 4)
    share = lambda k, m: round(k / m, 3) if m else None  # noqa: E731
    return {
        shape: {
            "pairs": p,
            "joined_4": share(j4, p),
            "joined_8": share(j8, p),
            "polygon_pairs": pp,
            "edge": share(e, pp),
            "edge_pairs": e,
            "edge_pairs_joined_4": share(ej, e),
        }
        for shape, (p, j4, j8, pp, e, ej) in tally.items()
    }


def main() -> dict:
    names = [n for n, c in CASES.items() if c.layout]
    result = {
        "n_samples": N_SAMPLES,
        "seed": 0,
        "grids": {g: {n: case_rows(n, grid) for n in names} for g, grid in GRIDS.items()},
    }
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict, grid: str = "384/27") -> str:
    """Markdown: a row per case, per shape the 4-joined / 8-joined / edge shares."""
    pct = lambda v: "—" if v is None else f"{100 * v:.0f}"  # noqa: E731
    shapes = ("circle", "square", "triangle", "objects")
    lines = ["| case | " + " | ".join(f"{s}: 4 / 8 / edge %" for s in shapes) + " |", "|---" * 5 + "|"]
    for name, rows in result["grids"][grid].items():
        cells = [
            " / ".join(pct(rows[s][k]) for k in ("joined_4", "joined_8", "edge")) if s in rows else "" for s in shapes
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def edge_summary(result: dict) -> str:
    """How many edge-sharing pairs there were on each grid, and the share of them 4-joined."""
    out = []
    for g, cases in result["grids"].items():
        rows = [r for shapes in cases.values() for r in shapes.values() if r["edge_pairs"]]
        n = sum(r["edge_pairs"] for r in rows)
        joined = sum(r["edge_pairs"] * r["edge_pairs_joined_4"] for r in rows)
        out.append(f"{g}: {n} pairs share ≥ 1 px of edge, {100 * joined / n:.0f} % of them 4-joined")
    return "; ".join(out)


if __name__ == "__main__":
    res = main()
    print(table(res))
    print(edge_summary(res))
