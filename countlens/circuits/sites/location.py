"""Where a site lives in the HF model (`Location`: a module, its input or output, the site's view of that
tensor), the helpers that read a module call's first input and output, and the checks every site runs
(`check_indices` at construction, `check_site` against a model). How a site is written is the engine's
(`countlens.circuits.engine.writes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from countlens.errors import InputError
from countlens.validate import require_integer

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


def check_indices(site, **lows: int) -> None:
    """In a site's ``__post_init__``: each named field an integer ≥ its low bound (a numpy integer is one,
    a bool or 1.5 is not), stored as a plain int; else an `InputError` naming the site and the field."""
    for name, low in lows.items():
        value = require_integer(getattr(site, name), f"{type(site).__name__}'s {name}", low=low)
        object.__setattr__(site, name, value)


def check_site(vlm: VLM, site) -> None:
    """Refuse, before any forward, what is no site or a site ``vlm`` lacks (a layer, head, key-value head,
    expert or vision block it has not): the one check behind `record`, `mean_activation`, `effect` and
    `intervene`. A site's own ``check`` where it has one (a site whose ``location`` runs it, or one with
    no location of its own: `Expert`); else finding its ``location`` is the check."""
    check = getattr(site, "check", None) or getattr(site, "location", None)
    if isinstance(site, type) or not callable(check):
        raise InputError(
            f"{site!r:.60} is no site; name one with countlens.circuits' Residual(layer), HeadZ(layer, head), Q, K, "
            "V, MlpIn, MlpOut, Expert, ImageStates or Pattern"
        )
    check(vlm)


#: The backends that serve a site (`countlens.circuits.engine`): nnsight's trace (the sweeps' stacked
#: edits, remote runs) and the engine's torch hooks (record, intervene, local runs).
TRACE, HOOKS = "trace", "hooks"


class Location(NamedTuple):
    """Where a site lives in the HF model: a module, whether the site is its ``input`` (first
    argument), its ``output`` (first element), an attention module's ``weights`` (its second output,
    read only) or ``inside`` its computation (an expert's share of the experts module's output: written
    by its kind's own writer, `countlens.circuits.engine.writes.WRITERS`), and ``view``: the site's
    (batch, seq, width) view of that tensor (in place: writing into the view writes the tensor)."""

    path: str
    io: str
    view: Callable[[Tensor], Tensor]


def whole(t: Tensor) -> Tensor:
    return t


def columns(cols: slice) -> Callable[[Tensor], Tensor]:
    """The view of a (batch, seq, width) tensor's columns ``cols``."""
    return lambda t: t[..., cols]


def head_axis(layout: str, head: int, n_heads: int, d_head: int) -> Callable[[Tensor], Tensor]:
    """The view of one head of q in ``layout`` ("bs(hd)", "bs(qkv)", "bshd", "bhsd") as (batch, seq, d_head)."""
    if layout in ("bs(hd)", "bs(qkv)"):
        return columns(slice(head * d_head, (head + 1) * d_head))
    if layout == "bshd":
        return lambda t: t[:, :, head]
    return lambda t: t[:, head]


def first_arg(args, kwargs) -> Tensor:
    """A module call's first input tensor: positional, or a decoder layer's ``hidden_states``."""
    return args[0] if args else kwargs["hidden_states"]


def replace_first(args, kwargs, value: Tensor):
    """(args, kwargs) of a module call with its first input tensor replaced by ``value``."""
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def first_output(output):
    """A module's output tensor: Llama 4's MoE block returns (output, router logits)."""
    return output[0] if isinstance(output, tuple) else output
