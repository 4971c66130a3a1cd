"""Confidence intervals countlens reports, one implementation each.

`wilson`: Wilson's score interval of a rate (``hits`` of ``n``), scipy's
(``scipy.stats.binomtest(...).proportion_ci(method="wilson")``); the planted organisms' fresh
accuracy (`countlens.toy.strictness`, `countlens.toy.edge_plant`, `countlens.toy.regions`) and the
misses table's missed rate (`countlens.analysis.object_misses`) all read it here.
"""

from __future__ import annotations

from countlens.errors import InputError
from countlens.validate import require_count, require_integer, require_share


def wilson(hits: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval (two-sided, at confidence ``level``) of the rate ``hits`` / ``n``, as
    (low, high) floats. ``hits`` is an integer in [0, n] and ``n`` ≥ 1 (a rate of no trials has no
    interval: the caller says what it shows instead, e.g. NaN)."""
    n = require_count(n, "n (trials of the rate)")
    hits = require_integer(hits, "hits", low=0)
    if hits > n:
        raise InputError(f"hits={hits} exceeds n={n}: give a number of hits in [0, n]")
    level = require_share(level, "level", below_one=True, above_zero=True)
    from scipy.stats import binomtest  # deferred on purpose: scipy.stats costs its importer ~0.5 s

    ci = binomtest(hits, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)
