"""Recipes: each generated sample carries the call that makes it again.

Every generator of one sample (`task_sample`, `trick_sample`, `count_pair`, `count_scene`, the paper
code's `reference_sample`) is wrapped by `recorded`: the sample it returns carries ``recipe``, the
generator's dotted name and every argument of the call with its defaults filled in (a `Geometry` as its
fields). ``import_module(module).<name>(**arguments)`` gives the sample again — generators are pure
functions of their arguments. `countlens.results.recipe_of` folds many samples' recipes into the
``recipe`` attr every result carries.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, is_dataclass, replace
from typing import Any


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
    """Wrap a one-sample generator so that what it returns carries its recipe."""
    signature = inspect.signature(fn)
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return stamp(out, {"generator": name, **{k: plain(v) for k, v in bound.arguments.items()}})

    return call


def rebuild(recipe: dict):
    """The sample (or pair) a recipe describes, made again by its generator."""
    from importlib import import_module

    from countlens.errors import InputError
    from countlens.geometry import Geometry

    args = dict(recipe)
    generator = args.pop("generator", None)
    if not isinstance(generator, str) or not generator.startswith("countlens."):
        raise InputError(f"{recipe!r} is no countlens recipe: it names no countlens generator")
    module, name = generator.rsplit(".", 1)
    if isinstance(args.get("grid"), dict):
        args["grid"] = Geometry(**args["grid"])
    return getattr(import_module(module), name)(**args)
