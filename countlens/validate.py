"""Ranges declared once: the checks every configuration dataclass and public function applies to
its numbers, shared by the Python API and the command line.

Each check takes the value, the name the user knows it by (a field such as ``lr``, an argument
such as ``batch_size``, an option such as ``--seed``) and the error class to raise (`InputError`
for an argument of a function, `ConfigError` for a field of a configuration), and returns the
value. A bool is never a number here (``True`` as a batch size is a mistake), and NaN or ±inf is
never in range.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral, Real

from countlens.errors import CountlensError, InputError


def _integer(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def require_count(value, name: str, kind: type[CountlensError] = InputError) -> int:
    """An integer ≥ 1 (a sample count, a batch size, steps): refuses a bool, 2.5, zero, a negative."""
    if not _integer(value) or value < 1:
        raise kind(f"{name} must be an integer ≥ 1, got {value!r}")
    return int(value)


#: The largest image side (px) countlens draws or plans for: above any VLM processor's (Qwen2.5-VL's
#: default budget is 3584² pixels), and a side that would need gigabytes for one scene.
MAX_IMAGE_SIDE = 16384


def require_image_side(value, name: str, kind: type[CountlensError] = InputError) -> int:
    """An image side in pixels: an integer from 1 to `MAX_IMAGE_SIDE`."""
    require_count(value, name, kind)
    if value > MAX_IMAGE_SIDE:
        raise kind(f"{name} {value} px is above {MAX_IMAGE_SIDE} px, larger than any VLM takes; give a smaller size")
    return int(value)


def require_seed(value, name: str = "seed", kind: type[CountlensError] = InputError) -> int:
    """A non-negative integer: numpy's generators take no negative seed."""
    if not _integer(value) or value < 0:
        raise kind(f"{name} must be an integer ≥ 0, got {value!r}")
    return int(value)


def require_positive(value, name: str, kind: type[CountlensError] = InputError) -> float:
    """A finite number > 0 (a learning rate, a temperature β, a width σ)."""
    if not _real(value) or value <= 0:
        raise kind(f"{name} must be a finite number > 0, got {value!r}")
    return value


def require_nonnegative(value, name: str, kind: type[CountlensError] = InputError) -> float:
    """A finite number ≥ 0 (a loss weight, a weight decay, an importance threshold)."""
    if not _real(value) or value < 0:
        raise kind(f"{name} must be a finite number ≥ 0, got {value!r}")
    return value


def require_share(
    value, name: str, kind: type[CountlensError] = InputError, below_one: bool = False, above_zero: bool = False
) -> float:
    """A finite number in [0, 1] (a depth, an attention share, a rate); with ``below_one`` 1 is out,
    with ``above_zero`` 0 is (a probability whose log-odds are taken)."""
    if not _real(value) or not 0 <= value <= 1 or (below_one and value == 1) or (above_zero and value == 0):
        bounds = f"{'(' if above_zero else '['}0, 1{')' if below_one else ']'}"
        raise kind(f"{name} must be a number in {bounds}, got {value!r}")
    return value


def require_order(low: tuple[str, float], high: tuple[str, float], kind: type[CountlensError] = InputError) -> None:
    """``low`` ≤ ``high``, each a (name, value): refuses inverted bounds such as early 0.9, late 0.1."""
    (low_name, low_value), (high_name, high_value) = low, high
    if low_value > high_value:
        raise kind(f"{low_name} ({low_value}) must not exceed {high_name} ({high_value}); swap or change them")


def require_distinct(values: Iterable, name: str, kind: type[CountlensError] = InputError) -> None:
    """No value twice (cases of an export, target layers): a repeat would be counted or trained twice."""
    seen, twice = set(), []
    for v in values:
        if v in seen and v not in twice:
            twice.append(v)
        seen.add(v)
    if twice:
        raise kind(f"{name} lists {', '.join(map(str, twice))} more than once; give each once")


def require_choice(value, name: str, choices: Iterable, kind: type[CountlensError] = InputError):
    """One of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise kind(f"{name}={value!r}: use one of {', '.join(map(repr, choices))}")
    return value


def require_sequence(value, name: str, kind: type[CountlensError] = InputError, example: str = "[0.1, 0.5]") -> list:
    """A non-empty list, tuple or array (not a string, a number or a mapping), as a list."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable) or isinstance(value, Real):
        raise kind(f"{name} must be a sequence, e.g. {example}; got {type(value).__name__} {value!r}")
    values = list(value)
    if not values:
        raise kind(f"{name} is empty; give at least one value, e.g. {example}")
    return values


def require_fractions(value, name: str, kind: type[CountlensError] = InputError) -> list[float]:
    """A non-empty, strictly increasing sequence of fractions in [0, 1] (circuit sizes, levels): refuses
    a bare number, percentages (80 for 0.8), NaN or ±inf, a repeat, descending order."""
    values = require_sequence(value, name, kind)
    for v in values:
        require_share(v, f"each of {name}", kind)
    if any(b <= a for a, b in zip(values, values[1:])):
        raise kind(f"{name} must increase strictly (smallest first, each once); got {values}")
    return [float(v) for v in values]


def require_finite_scores(values: dict, name: str, kind: type[CountlensError] = InputError) -> dict:
    """A mapping of scores whose values are finite numbers: an inf would rank first whatever it means."""
    bad = [k for k, v in values.items() if not _real(v)]
    if bad:
        raise kind(
            f"{name} holds non-finite scores (NaN or ±inf) at {bad[:5]}{' …' if len(bad) > 5 else ''}; rank with "
            "a result whose every score is finite (a degenerate denominator gives inf: check the pairs)"
        )
    return values
