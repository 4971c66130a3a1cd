"""Labels of model sites in results, one function per kind, and the largest (layer, head) cells of a result.

Nodes: heads ``"L3H2"`` (`head_label`), experts ``"L1E0"`` (`expert_label`), transcoder features
``"L1F17"`` (`feature_label`), MLPs ``"MLP1"`` (`mlp_label`; the toy once wrote ``"L1MLP"``, which
`mlp_key` still reads), inputs ``"IN.image"`` (`input_label`) and the logits (`LOGITS`). Edge
receivers: a head's query ``"L3H2.q"`` (`query_label`), a key-value head's key or value ``"L0K1.k"`` /
``"L0K1.v"`` (`kv_label`), an MLP's input ``"MLP1.in"`` (`mlp_in_label`), a whole attention block's
input ``"L1.attn"`` (`attn_in_label`). Edges: ``"L0H2→MLP1.in"`` (`edge_label`, read by `edge_key`).

A result's ``head`` coordinate is an index, but tables, reports and configuration name a head by its
label; `head_key` reads either form back (a (layer, head) pair or its label) and refuses anything
else with the form to use. Experts of a mixture-of-experts layer are labelled the same way.

Where an API takes a *selection* of heads (a fine-tune's ``target_heads``, a circuit scored by
`countlens.circuits.graph.recovery`) it reads it with `head_keys`, and a selection of transcoder features
with `feature_keys`: one parser for every spelling. Each takes one pair or a collection of pairs,
nested or not — tuples, lists, numpy integers, a numpy array of shape (2,) or (n, 2) — and labels;
it refuses non-integers (a float is never rounded to a head it may not mean), bools, negative
indices, a site given twice (as a pair and as its label too) and an empty selection: "no
restriction" is the caller's ``None``, never ``()``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral
from typing import NamedTuple

import numpy as np
import xarray as xr

from countlens.errors import CountlensError, InputError


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
        and _ndim(head) == 1
        and len(head) == 2
        and all(isinstance(x, Integral) and not isinstance(x, (bool, np.bool_)) for x in head)
    )


def _ndim(value) -> int | None:
    """``np.ndim(value)``, or None for a ragged collection numpy cannot shape (pairs mixed with labels)."""
    try:
        return np.ndim(value)
    except (ValueError, TypeError):
        return None


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


_FEATURE_LABEL = re.compile(r"L(\d+)F(\d+)")


def feature_label(feature: tuple[int, int]) -> str:
    """The label `countlens.features.feature_cards` gives feature (layer, index): ``"L1F17"``."""
    return f"L{feature[0]}F{feature[1]}"


_MLP_LABEL = re.compile(r"MLP(\d+)")
#: The planted toy's former MLP spelling (``"L1MLP"``), kept in value-route's shipped planted.json: read, never written.
_OLD_MLP_LABEL = re.compile(r"L(\d+)MLP")


def mlp_label(layer: int) -> str:
    """The label of layer ``layer``'s MLP (its output, a node): ``"MLP1"``."""
    return f"MLP{layer}"


def mlp_key(mlp) -> int:
    """An MLP's layer from either spelling: a layer index, or its label ``"MLP1"`` (`mlp_label`; the
    toy's former ``"L1MLP"`` is read too). Anything else is an `InputError` naming both forms."""
    if isinstance(mlp, str):
        match = _MLP_LABEL.fullmatch(mlp.strip()) or _OLD_MLP_LABEL.fullmatch(mlp.strip())
        if match:
            return int(match[1])
    elif isinstance(mlp, Integral) and not isinstance(mlp, (bool, np.bool_)) and mlp >= 0:
        return int(mlp)
    raise InputError(f"MLP {mlp!r}: give its layer as an integer ≥ 0, e.g. 1, or its label, e.g. 'MLP1'")


def query_label(head: tuple[int, int]) -> str:
    """The label of head (layer, head)'s query, an edge receiver: ``"L3H2.q"``."""
    return f"{head_label(head)}.q"


def kv_label(kv_head: tuple[int, int], part: str) -> str:
    """The label of key-value head (layer, head)'s key (``part`` "k") or value ("v"), an edge receiver:
    ``"L0K1.k"``."""
    if part not in ("k", "v"):
        raise InputError(f"kv_label: part {part!r}: give 'k' (the key) or 'v' (the value)")
    return f"L{kv_head[0]}K{kv_head[1]}.{part}"


def mlp_in_label(layer: int) -> str:
    """The label of layer ``layer``'s MLP input, an edge receiver: ``"MLP1.in"``."""
    return f"{mlp_label(layer)}.in"


def attn_in_label(layer: int) -> str:
    """The label of layer ``layer``'s whole attention input (a fused qkv, a linear layer), an edge
    receiver: ``"L1.attn"``."""
    return f"L{layer}.attn"


def resid_label(layer: int) -> str:
    """The label of the residual stream after decoder layer ``layer`` (−1: layer 0's input): ``"L3.resid"``."""
    return f"L{layer}.resid"


def states_label(layer: int) -> str:
    """The label of a cross-attention model's image states read at ``layer`` (−1: the projector's output):
    ``"L-1.states"``."""
    return f"L{layer}.states"


def pattern_label(head: tuple[int, int]) -> str:
    """The label of head (layer, head)'s attention pattern: ``"L3H2.pattern"``."""
    return f"{head_label(head)}.pattern"


def vision_label(index: int) -> str:
    """The label of vision block ``index``'s output: ``"V5"``."""
    return f"V{index}"


def input_label(part: str) -> str:
    """The label of an input node, the model's ``part`` ("image" or "text") tokens: ``"IN.image"``."""
    return f"IN.{part}"


#: The label of the logits, the last edge receiver.
LOGITS = "logits"
_ARROW = "→"


def edge_label(upstream: str, receiver: str) -> str:
    """The label of the edge from node ``upstream`` into ``receiver`` (each a label): ``"L0H2→MLP1.in"``."""
    return f"{upstream}{_ARROW}{receiver}"


def edge_key(edge) -> tuple[str, str]:
    """An edge label's (upstream, receiver) labels, e.g. ``("L0H2", "MLP1.in")`` from ``"L0H2→MLP1.in"``;
    anything else is an `InputError` naming the form."""
    upstream, arrow, receiver = edge.partition(_ARROW) if isinstance(edge, str) else ("", "", "")
    if not (arrow and upstream.strip() and receiver.strip()) or _ARROW in receiver:
        raise InputError(f"edge {edge!r:.60}: write an edge as 'upstream→receiver', e.g. 'L0H2→MLP1.in'")
    return upstream.strip(), receiver.strip()


class Spelling(NamedTuple):
    """How one kind of site is written: its unit's name, its label's pattern and maker, its pair's form,
    and an example pair and label."""

    unit: str
    pattern: re.Pattern
    label: Callable[[tuple[int, int]], str]
    form: str
    pair: str
    example: str


HEAD = Spelling("head", _HEAD_LABEL, head_label, "(layer, head)", "(3, 2)", "'L3H2'")
FEATURE = Spelling("feature", _FEATURE_LABEL, feature_label, "(layer, feature)", "(1, 17)", "'L1F17'")


def head_keys(
    heads, what: str = "heads", kind: type[CountlensError] = InputError, none: str | None = None
) -> tuple[tuple[int, int], ...]:
    """A selection of heads as (layer, head) pairs in the order given, from every spelling countlens
    takes: one head alone (``(3, 2)``, ``[3, 2]``, ``"L3H2"``) or a collection of them, numpy integers
    and an (n, 2) integer array included. ``what``: the argument's name in the message; ``kind``: the
    error class (`ConfigError` for a configuration field); ``none``: what the caller's ``None`` means,
    offered when the selection is empty (e.g. "None (the default) to train every head"). Refuses
    non-integers, bools, negative indices, an empty selection and a head given twice."""
    return _site_keys(heads, HEAD, what, kind, none)


def feature_keys(
    features, what: str = "features", kind: type[CountlensError] = InputError
) -> tuple[tuple[int, int], ...]:
    """A selection of transcoder features as (layer, feature) pairs in the order given: `head_keys`'
    rules with the feature's label ``"L1F17"`` (`feature_label`)."""
    return _site_keys(features, FEATURE, what, kind, None)


def _site_keys(sites, spelling: Spelling, what: str, kind, none: str | None) -> tuple[tuple[int, int], ...]:
    unit, pattern, label, form, pair, example = spelling
    takes = f"{what} takes {form} pairs of integers, e.g. [{pair}], or labels, e.g. [{example}]"
    if isinstance(sites, str) or _pair_like(sites):
        items = [sites]  # one site given alone
    elif isinstance(sites, np.ndarray):
        if sites.ndim != 2 or sites.shape[1] != 2:
            raise kind(f"{takes}; a numpy array of them has shape (n, 2), got shape {sites.shape}")
        items = list(sites)
    elif isinstance(sites, (bytes, Mapping)) or not isinstance(sites, Iterable) or hasattr(sites, "dims"):
        raise kind(f"{takes}; got {type(sites).__name__} {sites!r:.60}")
    else:
        items = list(sites)
    if not items:
        raise kind(
            f"{what} is empty: give {form} pairs, e.g. [{pair}], or labels, e.g. [{example}]"
            + (f", or {none}" if none else "")
        )
    out: list[tuple[int, int]] = []
    for item in items:
        match = pattern.fullmatch(item.strip()) if isinstance(item, str) else None
        if match:
            key = int(match[1]), int(match[2])
        elif is_head_pair(item):
            key = int(item[0]), int(item[1])
        else:
            shown = tuple(item.tolist()) if isinstance(item, np.ndarray) else item
            raise kind(f"{takes}; got {shown!r:.60}")
        if min(key) < 0:
            raise kind(
                f"{what}: {unit} {key} has a negative index; layers and {unit}s count from 0, so give indices ≥ 0"
            )
        if key in out:
            raise kind(f"{what} names {label(key)} more than once; give each {unit} once")
        out.append(key)
    return tuple(out)


def _pair_like(value) -> bool:
    """Whether ``value`` is meant as one pair: a tuple, list or numpy row of scalars (right or wrong
    ones, such as ``(0, 1.7)`` or ``(0, 1, 2)``), not a collection of sites (``[(0, 1), "L2H3"]``)."""
    return (
        isinstance(value, (tuple, list, np.ndarray))
        and _ndim(value) == 1
        and len(value) > 0
        and all(not isinstance(x, (str, bytes)) and _ndim(x) == 0 for x in value)
    )
