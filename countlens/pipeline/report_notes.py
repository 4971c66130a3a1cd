"""Two notes of a discover report read from its stored results: which count pairs the patching stages
read (their clean × corrupt table, unfolded from the results' ``data_recipe``), and a mark beside each
section whose stage divided by a normaliser below the noise rule (``attrs["normaliser_noisy"]``,
`countlens.circuits.engine.pair_batch.NOISE_K`).

The prose is in ``templates/header.md.j2`` (the pairs) and ``templates/noise.md.j2`` (the mark);
here are the values. Nothing runs a model: a pair's counts are a pure function of its recipe
(`countlens.datasets.pairs.pair_counts`), so the table is what ran, in old runs (cycling order) too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import xarray as xr

from countlens.circuits.engine.pair_batch import NOISE_K
from countlens.datasets.pairs import count_table, pair_counts
from countlens.errors import CountlensError, RunDirError
from countlens.results import sample_recipes

#: The stages whose pairs the report's table shows: the first of these the run holds with a recipe.
PAIR_STAGES: tuple[str, ...] = ("vap", "heads")
COUNT_PAIR = "countlens.datasets.pairs.count_pair"
#: The arguments of `count_pair` that decide a pair's counts (`pair_counts`).
COUNT_ARGS: tuple[str, ...] = ("seed", "kind", "clean", "corrupt", "counts", "order")


def recipe_counts(entries: Sequence) -> tuple[list[tuple[int, int]], set[str], int]:
    """The (clean, corrupt) counts of the pairs a ``data_recipe`` (`countlens.results.recipe_of`)
    describes, in order (unfolded by `countlens.results.sample_recipes`); the orders they were drawn in
    ("stratified", "cycle", or "fixed" for a given pair); and how many pairs it holds that `count_pair`
    did not draw (their counts are not recorded)."""
    got: list[tuple[int, int]] = []
    orders: set[str] = set()
    other = 0
    for recipe in sample_recipes(list(entries)):
        if recipe.get("generator") != COUNT_PAIR:
            other += 1
            continue
        args = {k: recipe[k] for k in COUNT_ARGS if k in recipe}  # a recipe older than `order` cycled
        orders.add("fixed" if args.get("clean") is not None else args.get("order", "cycle"))
        got.append(pair_counts(index=recipe["index"], **args))
    return got, orders, other


def pairs_values(results: Mapping[str, xr.Dataset]) -> dict | None:
    """What the report's pairs paragraph shows: the number of pairs, how they were drawn, the table (a
    markdown table, clean counts as rows); None when no patching result records its pairs."""
    for stage in PAIR_STAGES:
        raw = results[stage].attrs.get("data_recipe") if stage in results else None
        if raw is None:
            continue
        try:
            got, orders, other = recipe_counts(json.loads(raw))
        except (CountlensError, ValueError, TypeError, AttributeError, KeyError) as err:
            raise RunDirError(
                f"results/{stage}.nc records a data_recipe the report cannot read ({type(err).__name__}: {err}): "
                f"a damaged file, or one another program wrote; delete it and rerun `countlens discover` (it resumes)"
            ) from None
        if not got:
            return None
        table = count_table(got).to_pandas()
        table.index.name, table.columns.name = "clean \\ corrupt", None
        n_counts = len(set(table.index) | set(table.columns))
        k = n_counts * (n_counts - 1)
        return {
            "stage": stage,
            "n": len(got),
            "order": " and ".join(sorted(orders)),
            "k": k,
            "low": len(got) // k,
            "high": -(-len(got) // k),
            "other": other,
            "table": table.to_markdown(),
        }
    return None


def noisy(result: xr.Dataset | xr.DataArray | None) -> dict | None:
    """A result's normaliser stats when its normaliser is below the noise rule, else None."""
    attrs = getattr(result, "attrs", {})
    if not int(attrs.get("normaliser_noisy", 0) or 0):
        return None
    return {
        "normaliser": float(attrs.get("normaliser", float("nan"))),
        "se": float(attrs.get("normaliser_se", float("nan"))),
        "k": NOISE_K,
    }


def noisy_stages(results: Mapping[str, xr.Dataset], stages: Sequence[str]) -> list[dict]:
    """Each of ``stages`` whose stored result is marked noisy, with its figures, in order."""
    return [{"stage": s, **stats} for s in stages if (stats := noisy(results.get(s))) is not None]


def with_mark(section: str, mark: str) -> str:
    """``section`` (a rendered report section, its heading the first line) with ``mark`` under the heading."""
    if not mark.strip():
        return section
    heading, _, rest = section.partition("\n")
    return f"{heading}\n\n{mark.strip()}\n{rest}"
