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
import os
from collections.abc import Iterable
from numbers import Integral, Real
from pathlib import Path

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


def require_finite(value, name: str, kind: type[CountlensError] = InputError) -> float:
    """A finite number, of any sign (a steering factor, a clamped activation): refuses NaN, ±inf, a bool."""
    if not _real(value):
        raise kind(f"{name} must be a finite number, got {value!r}")
    return float(value)


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
    if not isinstance(value, (str, bytes, Real)) or value not in choices:
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
    a bare number, percentages (80 for 0.8), NaN or ±inf, a repeat, descending order, and a set (it
    has no order: its sizes would be taken in whatever order it iterates)."""
    if isinstance(value, (set, frozenset)):
        raise kind(f"{name} is a set, which has no order; give a list, smallest first, e.g. [0.1, 0.5]")
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


def require_text(value, name: str, kind: type[CountlensError] = InputError, empty: bool = False) -> str:
    """A string (non-empty unless ``empty``)."""
    if not isinstance(value, str) or (not empty and not value):
        raise kind(f"{name} must be {'a' if empty else 'a non-empty'} string, got {type(value).__name__} {value!r:.60}")
    return value


def require_integer(value, name: str, kind: type[CountlensError] = InputError, low: int | None = None) -> int:
    """An integer (not a bool, not 2.0), at least ``low`` where given."""
    if not _integer(value) or (low is not None and value < low):
        bound = "" if low is None else f" ≥ {low}"
        raise kind(f"{name} must be an integer{bound}, got {value!r:.60}")
    return int(value)


def require_bool(value, name: str, kind: type[CountlensError] = InputError) -> bool:
    """True or False (a numpy bool too): refuses "nonsense", None, 2.5 or a tensor as a switch."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise kind(f"{name} must be True or False, got {type(value).__name__} {value!r:.60}")
    return bool(value)


def require_path(value, name: str, kind: type[CountlensError] = InputError, example: str = "'out'") -> Path:
    """A file or folder path: a non-empty string or a `pathlib.Path` (not None, a number or a list)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise kind(f"{name} must be a path (a string or a pathlib.Path), e.g. {example}; got {value!r:.60}")
    return Path(value)


def require_callback(value, name: str = "progress", kind: type[CountlensError] = InputError):
    """None, or a function (a progress callback): checked before any work, never first called mid-run."""
    if value is not None and not callable(value):
        raise kind(f"{name} must be a function (called with each log row) or None, got {value!r:.60}")
    return value


def require_dataarray(value, name: str, dims=None, kind: type[CountlensError] = InputError):
    """An xarray DataArray (over exactly ``dims``, in any order, where given), not a Dataset or an array."""
    import xarray as xr

    if isinstance(value, xr.Dataset):
        raise kind(f"{name} is a Dataset; give one of its variables (a DataArray), e.g. result.effect")
    if not isinstance(value, xr.DataArray):
        raise kind(f"{name} must be an xarray DataArray, got {type(value).__name__} {value!r:.60}")
    if dims is not None and set(value.dims) != set(dims):
        raise kind(f"{name} must be over {tuple(dims)}, got dims {value.dims}")
    return value


def require_dataset(value, name: str, variables=(), kind: type[CountlensError] = InputError):
    """An xarray Dataset holding ``variables`` (a countlens result)."""
    import xarray as xr

    if not isinstance(value, xr.Dataset):
        raise kind(f"{name} must be an xarray Dataset (a countlens result), got {type(value).__name__} {value!r:.60}")
    missing = [v for v in variables if v not in value]
    if missing:
        raise kind(f"{name} lacks {missing}: give the result of the function that makes it")
    return value


def require_tensor(value, name: str, ndim: int | None = None, kind: type[CountlensError] = InputError):
    """A torch tensor (of ``ndim`` dimensions where given), finite where floating."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise kind(f"{name} must be a torch tensor, got {type(value).__name__} {value!r:.60}")
    if ndim is not None and value.ndim != ndim:
        raise kind(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.is_floating_point() and not torch.isfinite(value).all():
        raise kind(f"{name} holds NaN or ±inf")
    return value


def require_finite_tensor(value, name: str, kind: type[CountlensError] = InputError, nan: bool = False, fix: str = ""):
    """A tensor or array whose numbers are finite, as read from a file: no ±inf, and no NaN unless
    ``nan`` (NaN that marks "no value there", as a result's absent head). ``name`` says where the
    numbers came from (the file and the tensor or variable), ``fix`` what to do; integer and bool
    values pass as they are. Returns ``value``."""
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor
        if not value.is_floating_point() and not value.is_complex():
            return value
        data = value.detach()
        bad = ~data.isfinite() if not nan else data.isinf()
        if not bool(bad.any()):
            return value
        n_nan, n_inf = int(data.isnan().sum()), int(data.isinf().sum())
        first = tuple(int(i) for i in bad.nonzero()[0].tolist()) if data.ndim else ()
        total = data.numel()
    else:
        data = np.asarray(value)
        if not (np.issubdtype(data.dtype, np.floating) or np.issubdtype(data.dtype, np.complexfloating)):
            return value
        bad = ~np.isfinite(data) if not nan else np.isinf(data)
        if not bad.any():
            return value
        n_nan, n_inf = int(np.isnan(data).sum()), int(np.isinf(data).sum())
        first = tuple(int(i[0]) for i in np.nonzero(bad)) if data.ndim else ()
        total = data.size
    counts = [f"{n} {what}" for n, what in ((n_nan, "NaN"), (n_inf, "±inf")) if n and (what != "NaN" or not nan)]
    where = f", the first at index {first}" if first else ""
    rule = "finite (or NaN: no value there)" if nan else "finite"
    raise kind(
        f"{name} holds {' and '.join(counts)} of its {total} values{where}: numbers countlens reads must be {rule}"
        + (f"; {fix}" if fix else "")
    )
