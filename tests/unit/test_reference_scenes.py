"""COUNTINGTRICKS as the MAS paper's generator writes it: its rules checked on the scenes' geometry."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from countlens.datasets.countingtricks import countingtricks
from countlens.datasets.paper_generator import (
    REFERENCE_CASES,
    circles,
    layout,
    reference_sample,
    requested_count,
)
from countlens.errors import InputError
from countlens.model.geometry import Geometry

GRID = Geometry.data_grid(384, 27)  # the code's grid: 14 whole cells and a 6 px strip
P, R = 27, 13


def test_the_codes_eighteen_cases_and_even_counts():
    assert REFERENCE_CASES == (
        *("1A", "2A", "3A", "4A", "1B", "2B", "3B", "4B"),
        *("2C", "3C", "4C", "2D", "3D", "4D", "5A", "6A", "7A", "8A"),
    )
    asked = [requested_count(7, i) for i in range(200)]
    assert Counter(asked) == {n: 20 for n in range(1, 11)}  # each count 20 times in 200, as the code's list
    assert all(sorted(asked[k : k + 10]) == list(range(1, 11)) for k in range(0, 200, 10))


def _cell(name: str, x: float, y: float) -> tuple[int, int]:
    """The layout cell (i, j) a circle of a position-A case came from, read back from its centre."""
    position = int(name[0])
    i = x / P if position in (2, 4) else (x - R) / P
    j = y / P if position in (3, 4) else (y - R) / P
    assert i == int(i) and j == int(j)
    return int(i), int(j)


@pytest.mark.parametrize("index", range(12))
def test_one_layout_per_image_shared_by_every_case(index):
    """1A–4A never drop a circle on the code's grid, so each draws its layout's cells exactly, the
    same cells: case differences are paired."""
    cells = {
        name: sorted(_cell(name, x, y) for x, y, _ in circles(name, 3, index, GRID)[0]) for name in REFERENCE_CASES[:4]
    }
    assert len({tuple(c) for c in cells.values()}) == 1
    drawn = cells["1A"]
    assert len(drawn) == min(requested_count(3, index), len(layout(3, index, 10, GRID)))
    assert all(1 <= i <= 12 and 1 <= j <= 12 for i, j in drawn)  # the outer ring of cells is excluded


@pytest.mark.parametrize("name, spacing", [("1B", 4), ("6A", 5), ("8A", 6)])
def test_cells_keep_the_codes_chebyshev_gap(name, spacing):
    for index in range(40):
        cells = layout(5, index, 10, GRID, spacing)
        assert all(max(abs(a - c), abs(b - d)) >= spacing for (a, b), (c, d) in itertools.combinations(cells, 2))
    # At distance 4 at most 9 cells fit on 12 × 12: a requested 10 gets fewer circles, as in the code.
    assert max(len(layout(5, i, 10, GRID)) for i in range(40)) <= 9


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_drop_rule_and_case_geometry(name):
    """Every drawn circle lies at least R inside the frame; a cell whose circle would not is dropped
    and the label counts what is drawn; C/D shifts stay within R/2 + R/4 of the grid line (then
    truncated to a pixel, or clamped to [p + R, S − p − R])."""
    for index in range(30):
        drawn, asked = circles(name, 11, index, GRID)
        sample = reference_sample(name, 11, index, GRID)
        assert sample.meta["count"] == len(drawn) == len(sample.scene.objects) and sample.meta["requested"] == asked
        for x, y, r in drawn:
            assert x - r >= R and y - r >= R and x + r <= 384 - R and y + r <= 384 - R
            if name in ("5A", "6A", "7A", "8A"):
                assert r == {"5A": 2.5, "6A": 3.0, "7A": 3.5, "8A": 4.0}[name] * P / 2
                assert (x - R) % P == 0 and (y - R) % P == 0
            elif name[1] in "BD":
                assert 0.3 * R <= r <= 1.2 * R
            else:
                assert r == R
            if name[1] in "CD":
                moved = [v for v, axis in ((x, 2), (y, 3)) if int(name[0]) in (axis, 4)]
                for v in moved:
                    line = round(v / P) * P
                    # int() truncates: up to 1 px further below the line than the shift's R/2 + R/4
                    assert v == int(v) and (
                        -(R / 2 + R / 4) - 1 < v - line <= R / 2 + R / 4 or v in (P + R, 384 - P - R)
                    )
    # 8A's circles (radius 54 px) fit only in cells 2–11: a layout cell in row or column 1 or 12 is dropped.
    for index in range(30):
        cells = layout(11, index, requested_count(11, index), GRID, 6)
        kept = [c for c in cells if all(2 <= v <= 11 for v in c)]
        assert reference_sample("8A", 11, index, GRID).meta["count"] == len(kept)


def test_corner_cases_round_half_to_even_on_an_even_patch():
    """The code places 4A–4D corners at round((p·i + R) / p)·p: on a 14 px patch, (14 i + 7) / 14 = i + ½
    rounds to the even neighbour, so an odd i's corner moves to the next grid line."""
    even = Geometry.square(224, 14)
    for index in range(6):
        for x, y, _ in circles("4A", 4, index, even)[0]:
            assert x % 14 == 0 and y % 14 == 0 and (x // 14) % 2 == 0 and (y // 14) % 2 == 0


def test_pure_function_of_seed_case_and_index_on_any_grid():
    a = countingtricks(["2D", "5A"], 4, seed=9, design="paper-code")
    b = countingtricks(["2D", "5A"], 4, seed=9, design="paper-code")
    assert [s.scene for s in a] == [s.scene for s in b] and a[0].meta["grid"] == [384, 384, 27]
    assert [s.scene for s in countingtricks(["2D"], 4, seed=10, design="paper-code")] != [s.scene for s in a[:4]]
    assert len(countingtricks(None, 1, design="paper-code")) == 18
    small = countingtricks(["4C"], 6, Geometry.square(224, 14), seed=1, design="paper-code")
    assert all(s.scene.render().size == (224, 224) for s in small[:2]) and small[0].answer.startswith("circle: ")
    with pytest.raises(InputError, match="design='paper-code' draws red circles"):
        countingtricks(["1A"], 1, design="paper-code", shapes="square")
    with pytest.raises(InputError, match="not one of the paper code's 18 cases"):
        countingtricks(["12A"], 1, design="paper-code")
    with pytest.raises(InputError, match="unknown design"):
        countingtricks(["1A"], 1, design="paper")


def test_export_and_command_write_the_paper_codes_design(tmp_path):
    """`countlens data countingtricks --design paper-code`: the code's cases, one manifest line per image
    with the drawn and the requested count; its own export.json (another design is another export)."""
    import json

    from typer.testing import CliRunner

    from countlens.cli import app
    from countlens.datasets.export import export_countingtricks

    runner = CliRunner()
    out = tmp_path / "code"
    args = ["data", "countingtricks", "--out", str(out), "--design", "paper-code", "--n", "2", "--cases", "2C,8A"]
    done = runner.invoke(app, [*args, "--image-size", "384", "--patch-size", "27"])
    assert done.exit_code == 0, done.output
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(r["case"], r["design"]) for r in records] == [("2C", "paper-code")] * 2 + [("8A", "paper-code")] * 2
    want = reference_sample("8A", 0, 1, GRID)
    assert (records[3]["count"], records[3]["requested"]) == (want.meta["count"], want.meta["requested"])
    assert records[0]["case_params"]["moved"] == "x" and (out / "images" / "8A" / "8A_00001.png").exists()
    again = export_countingtricks(out, ["2C", "8A"], 2, GRID, design="paper-code", prompt="std", color="red")
    assert again == out / "manifest.jsonl"  # the same export, kept
    refused = runner.invoke(
        app, ["data", "countingtricks", "--out", str(tmp_path / "x"), "--design", "paper-code", "--counts", "3"]
    )
    assert refused.exit_code == 2 and "leave --counts and --shapes out" in refused.output
    wrong = runner.invoke(
        app, ["data", "countingtricks", "--out", str(tmp_path / "y"), "--design", "paper-code", "--cases", "9A"]
    )
    assert wrong.exit_code == 2 and "not among the paper code's 18 cases" in wrong.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_grid_that_holds_fewer_circles_than_the_papers_is_said_per_case():
    """On a 3-patch grid each position case holds one circle: a warning names every case and what it
    holds (the labels stay the number drawn); on the paper's own grid nothing is said."""
    import warnings

    from countlens.datasets import countingtricks
    from countlens.model.geometry import Geometry

    with pytest.warns(UserWarning, match=r"48 px / 16 px grid .*1A at most 1, 2B at most 1 \(of counts 1–10"):
        small = countingtricks(["1A", "2B"], 10, Geometry.square(48, 16), design="paper-code")
    assert max(s.meta["count"] for s in small) == 1 and max(s.meta["requested"] for s in small) == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        countingtricks(["1A", "8A"], 2, design="paper-code")  # the paper's grid: its shortfall is the code's
