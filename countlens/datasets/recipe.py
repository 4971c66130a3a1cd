"""Recipes: each generated sample carries the call that makes it again, as data, never as code.

Every generator of one sample (`task_sample`, `trick_sample`, `count_pair`, `count_scene`, the paper
code's `reference_sample`, the top-half organism's `top_half_sample`) is wrapped by `recorded`: the
sample it returns carries ``recipe``, a plain JSON dict of the generator's dotted name, every argument
of the call with its defaults filled in (a `Geometry` as its fields), the countlens version that made
it and the recipe schema (`RECIPE_SCHEMA`). Generators are pure functions of their arguments, so
`rebuild` gives the sample again. `countlens.results.recipe_of` folds many samples' recipes into the
``data_recipe`` attr every result carries, so a recipe travels in every saved file;
`countlens.results.sample_recipes` unfolds it again (one recipe per sample) and
`countlens.results.rebuild_samples` makes a result's samples again.

A recipe read from a file is data: `rebuild` calls only a generator of `GENERATORS`, the allow-list
kept here beside the `recorded` wrapper (a function wrapped by `recorded` that is not on it fails at
import), with arguments its signature names, each plain JSON data (no path, no object): nothing in a
file can make countlens call anything else. A recipe of another countlens version or schema is
refused, naming both, since a generator of another version may draw other samples from the same
arguments.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import asdict, fields, is_dataclass, replace
from typing import Any

from countlens import __version__
from countlens.errors import CountlensError, InputError
from countlens.model.geometry import Geometry

#: The recipe format: what `recorded` writes beside the generator's arguments. Raised when that changes.
RECIPE_SCHEMA = 1
#: The keys of a recipe that are not arguments of its generator.
GENERATOR_KEY, VERSION_KEY, SCHEMA_KEY = "generator", "countlens_version", "recipe_schema"

#: The data generators a recipe may name (dotted names): `rebuild` calls these and nothing else. Each
#: draws one sample (or pair) from plain arguments and writes no file.
GENERATORS: frozenset[str] = frozenset(
    {
        "countlens.datasets.countingtricks.trick_sample",
        "countlens.datasets.pairs.count_pair",
        "countlens.datasets.pairs.count_scene",
        "countlens.datasets.tasks.task_sample",
        "countlens.datasets.paper_generator.reference_sample",
        "countlens.toy.regions.top_half_sample",
    }
)
#: Generators that moved, by the name older recipes of this version recorded → the name they have now:
#: a recipe keeps naming its call after a module moves (data, read as a lookup, never imported by it).
RENAMED: dict[str, str] = {
    "countlens.reference.counting_to_four.scenes.reference_sample": (
        "countlens.datasets.paper_generator.reference_sample"
    ),
}
_REGISTERED: dict[str, Any] = {}  # dotted name -> the recorded generator, filled as their modules import


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: dataclasses (a Geometry) as dicts, tuples and ranges as lists."""
    if is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in asdict(value).items()}
    if isinstance(value, (list, tuple, range)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "item"):  # a numpy scalar
        return value.item()
    return repr(value)


def stamp(out, recipe: dict):
    """A sample (or a pair's two samples) carrying ``recipe``."""
    if hasattr(out, "clean") and hasattr(out, "corrupt"):
        return replace(out, clean=stamp(out.clean, recipe), corrupt=stamp(out.corrupt, recipe))
    return replace(out, recipe=recipe)


def recorded(fn):
    """Wrap a one-sample generator of `GENERATORS` so that what it returns carries its recipe."""
    signature = inspect.signature(fn)
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name not in GENERATORS:  # a programming error, met at import: the allow-list is kept by hand
        raise TypeError(f"{name} is recorded but not in countlens.datasets.recipe.GENERATORS; add it there")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {k: plain(v) for k, v in bound.arguments.items()}
        return stamp(out, {GENERATOR_KEY: name, VERSION_KEY: __version__, SCHEMA_KEY: RECIPE_SCHEMA, **arguments})

    _REGISTERED[name] = call
    return call


def rebuild(recipe: dict):
    """The sample (or pair) that ``recipe`` describes, made again by its generator.

    ``recipe``: a sample's ``.recipe``, or one of the recipes a result's ``data_recipe`` attr unfolds to
    (`countlens.results.sample_recipes`; `countlens.results.rebuild_samples` rebuilds them all)::

        from countlens.datasets import rebuild, task_samples
        from countlens.results import rebuild_samples, sample_recipes
        s = task_samples("count", 3, seed=4)[2]
        assert rebuild(s.recipe).scene == s.scene

        sample = rebuild(sample_recipes(result)[0])   # result: a Dataset / DataArray, or a stored one's path
        samples = rebuild_samples("runs/demo/heads.nc")

    The recipe is data: its generator must be one of `GENERATORS` (data generators that write
    nothing), its arguments names in that generator's signature with plain JSON values, and it must
    have been written by this countlens version and recipe schema. Anything else is an `InputError`
    naming what differs, before any generator runs.
    """
    generator, fn, args = _checked(recipe)
    try:
        return fn(**args)
    except CountlensError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as err:  # a value of the wrong kind for the generator
        raise InputError(
            f"the recipe of {generator} cannot be made again ({type(err).__name__}: {err}); its arguments "
            f"{args!r:.200} are not what this generator takes: rebuild from a recipe countlens wrote"
        ) from err  # chained: where a generator's own bug raised it, the traceback shows where


def check_recipe(recipe: dict) -> None:
    """Refuse ``recipe`` as `rebuild` would, without making the sample: an `InputError` naming what is
    wrong (a generator off the allow-list, arguments its generator does not take or that are not plain
    JSON data, another countlens version or recipe schema, a loaded sample's count). Nothing runs but
    the import of an allow-listed generator's module. `countlens.results.rebuild_samples` checks every
    recipe of a result with it before it makes any sample."""
    _checked(recipe)


def _checked(recipe: dict) -> tuple[str, Any, dict]:
    """(generator name, the recorded generator, its arguments) of a recipe that passes every check."""
    if not isinstance(recipe, dict):
        raise InputError(
            f"rebuild takes a recipe dict (a sample's .recipe, or an entry of a result's data_recipe), "
            f"got {type(recipe).__name__} {recipe!r:.80}"
        )
    if set(recipe) == {"loaded"}:
        raise InputError(
            f"{recipe!r} counts samples loaded from a data set, which have no recipe; load that data set again"
        )
    generator = recipe.get(GENERATOR_KEY)
    generator = RENAMED.get(generator, generator) if isinstance(generator, str) else generator
    if not isinstance(generator, str) or generator not in GENERATORS:
        raise InputError(
            f"the recipe names the generator {generator!r:.120}, which is no registered data generator: a recipe "
            f"may name only {sorted(GENERATORS)}; rebuild from a recipe countlens wrote (the file was edited, or "
            "written by another program)"
        )
    _check_version(recipe)
    fn = _generator(generator)
    args = {k: v for k, v in recipe.items() if k not in (GENERATOR_KEY, VERSION_KEY, SCHEMA_KEY)}
    return generator, fn, _arguments(generator, fn, args)


def _check_version(recipe: dict) -> None:
    """Refuse a recipe of another countlens version or schema, or one written before recipes had one."""
    generator, version, schema = recipe.get(GENERATOR_KEY), recipe.get(VERSION_KEY), recipe.get(SCHEMA_KEY)
    remake = "make the data again with this version's generator (the recipe names the call)"
    if version is None and schema is None:
        raise InputError(
            f"the recipe of {generator} carries no countlens version and no recipe schema: it was written before "
            f"recipes carried them, and this is countlens {__version__} (recipe schema {RECIPE_SCHEMA}); {remake}"
        )
    pairs = (("countlens version", version, __version__), ("recipe schema", schema, RECIPE_SCHEMA))
    differs = [f"{what} {theirs!r}, this one's {ours!r}" for what, theirs, ours in pairs if theirs != ours]
    if differs:
        raise InputError(
            f"the recipe of {generator} was written by another countlens ({'; '.join(differs)}): a generator of "
            f"another version may draw other samples from the same arguments; {remake}, or rebuild it with the "
            f"version that wrote it (pip install countlens=={version})"
        )


def _generator(name: str):
    """The recorded generator ``name`` (one of `GENERATORS`), its module imported if it was not yet."""
    if name not in _REGISTERED:
        from importlib import import_module

        import_module(name.rsplit(".", 1)[0])  # a module named by the allow-list, never by the file
    return _REGISTERED[name]


def _arguments(generator: str, fn, args: dict) -> dict:
    """``args`` checked against ``fn``'s signature (names it knows, every required one given) and for
    plain JSON values; a ``grid`` dict made a `Geometry` again."""
    params = inspect.signature(fn).parameters
    unknown = sorted(set(args) - set(params))
    missing = [p.name for p in params.values() if p.default is inspect.Parameter.empty and p.name not in args]
    if unknown or missing:
        said = "; ".join(
            part
            for part in (
                f"arguments {unknown} it does not take" if unknown else "",
                f"no {missing}, which it needs" if missing else "",
            )
            if part
        )
        raise InputError(
            f"the recipe of {generator} gives {said} (it takes {list(params)}): the file was edited, or written by "
            "another program; rebuild from a recipe countlens wrote"
        )
    for key, value in args.items():
        bad = _not_plain(value)
        if bad is not None:
            raise InputError(
                f"the recipe of {generator} gives {key}={value!r:.80}, which holds {bad}: a recipe's arguments are "
                "plain JSON data (strings, finite numbers, booleans, null, lists, objects)"
            )
    if isinstance(args.get("grid"), dict):
        names = {f.name for f in fields(Geometry)}
        extra = sorted(set(args["grid"]) - names)
        if extra:
            raise InputError(
                f"the recipe of {generator} gives grid fields {extra}, which a Geometry has not ({sorted(names)})"
            )
        try:
            args["grid"] = Geometry(**args["grid"])
        except TypeError as err:
            raise InputError(f"the recipe of {generator} gives a grid that is no Geometry ({err})") from None
    return args


def _not_plain(value: Any, depth: int = 0) -> str | None:
    """What in ``value`` is not plain JSON data (None when it all is)."""
    if depth > 8:
        return "lists or objects nested deeper than 8"
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"the non-finite number {value}"
    if isinstance(value, list):
        return next((bad for v in value if (bad := _not_plain(v, depth + 1)) is not None), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "an object key that is not a string"
        return next((bad for v in value.values() if (bad := _not_plain(v, depth + 1)) is not None), None)
    return f"a {type(value).__name__}"
