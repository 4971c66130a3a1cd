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
