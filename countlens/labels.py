"""Labels of model sites in results: heads as ``"L3H2"``, experts as ``"L1E0"``, and the largest
(layer, head) cells of a result.

A result's ``head`` coordinate is an index, but tables, reports and configuration name a head by its
label; `head_key` reads either form back (a (layer, head) pair or its label) and refuses anything
else with the form to use. Experts of a mixture-of-experts layer are labelled the same way.
"""

from __future__ import annotations

import re
from numbers import Integral

import numpy as np
import xarray as xr

from countlens.errors import InputError


def top_sites(da: xr.DataArray, k: int | None = None, absolute: bool = False) -> list[tuple[int, int, float]]:
    """The ``k`` largest (layer, head) cells of ``da`` (all with None; by |value| with ``absolute``),
    largest first and ties in (layer, head) order: (layer, head, value), the value's sign kept; NaN
    cells (no head there) left out."""
    flat = da.stack(site=("layer", "head"))
    values = flat.values
    order = np.argsort(-(np.abs(values) if absolute else values), kind="stable")
    order = order[~np.isnan(values[order])][:k]  # NaN: a slot beyond a layer's own heads, no site
    return [(int(flat.site.values[i][0]), int(flat.site.values[i][1]), float(values[i])) for i in order]


_HEAD_LABEL = re.compile(r"L(\d+)H(\d+)")


def head_label(head: tuple[int, int]) -> str:
    """The label results, tables and reports give head (layer, head): ``"L3H2"``."""
    return f"L{head[0]}H{head[1]}"


def is_head_pair(head) -> bool:
    """Whether ``head`` is (layer, head) as two integers: a tuple, a list or a numpy row."""
    return (
        not isinstance(head, (str, bytes))
        and np.ndim(head) == 1
        and len(head) == 2
        and all(isinstance(x, Integral) and not isinstance(x, (bool, np.bool_)) for x in head)
    )


def head_key(head) -> tuple[int, int]:
    """A head as (layer, head) from either spelling countlens uses: a pair of integers, or the label
    of its tables (``"L3H2"``, `head_label`). Anything else is an `InputError` naming both forms."""
    if isinstance(head, str):
        match = _HEAD_LABEL.fullmatch(head.strip())
        if match:
            return int(match[1]), int(match[2])
    elif is_head_pair(head):
        return int(head[0]), int(head[1])
    raise InputError(f"head {head!r}: give (layer, head) as two integers, e.g. (3, 2), or its label, e.g. 'L3H2'")


_EXPERT_LABEL = re.compile(r"L(\d+)E(\d+)")


def expert_label(expert: tuple[int, int]) -> str:
    """The label results give expert (layer, expert): ``"L1E0"`` (`ablate_experts`' ``experts`` attr)."""
    return f"L{expert[0]}E{expert[1]}"


def expert_key(expert) -> tuple[int, int]:
    """An expert as (layer, expert) from either spelling countlens uses: a pair of integers, or its
    label (``"L1E0"``, `expert_label`). Anything else — ``(1, 1.7)``, ``"expert 0"`` — is an
    `InputError` naming both forms: a float is never rounded to an expert it may not mean."""
    if isinstance(expert, str):
        match = _EXPERT_LABEL.fullmatch(expert.strip())
        if match:
            return int(match[1]), int(match[2])
    elif is_head_pair(expert):  # two integers, the same test as a head's
        return int(expert[0]), int(expert[1])
    raise InputError(f"expert {expert!r}: give (layer, expert) as two integers, e.g. (1, 0), or its label, e.g. 'L1E0'")
