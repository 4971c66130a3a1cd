"""How sites are written inside a traced forward: an edit placed in a stacked batch (`Placed`), what it
leaves at its entries (a value, a cached run's, or a function of what is there), and where a site
lives in the HF model (`Location`: a module, its input or output, the site's view of that tensor)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from countlens.errors import InputError
from countlens.validate import require_integer

if TYPE_CHECKING:
    from jaxtyping import Bool, Float, Int

    from countlens.model.vlm import VLM


class Placed(NamedTuple):
    """An edit placed in a stacked forward: replica ``replica`` (rows replica·n … of the stacked
    batch) gets ``value``, or else the cached run's, at the mask's entries — rows b, positions s; or,
    with ``op``, op(what the forward has there) (`countlens.circuits.interventions`)."""

    replica: int
    site: Any  # a `countlens.circuits.sites.Site`
    mask: Bool[Tensor, "batch positions"]
    value: Float[Tensor, "batch positions d"] | None
    b: Int[Tensor, " k"]
    s: Int[Tensor, " k"]
    op: Callable[[Tensor], Tensor] | None = None


def written(vlm: VLM, placed: Placed, cache: dict | None, current: Tensor) -> Tensor:
    """What a placed edit leaves at its entries, given what the forward has there (``current``, k × d)."""
    if placed.op is not None:
        return placed.op(current)
    return source(vlm, placed, cache, current.device).to(current.device, current.dtype)


def source(vlm: VLM, placed: Placed, cache: dict | None, device: torch.device) -> Float[Tensor, "k d"]:
    """What a placed edit writes at its entries: its value there, or the cached run's (on ``device``)."""
    if placed.value is None:
        return placed.site.read(vlm, cache, placed.b, placed.s, device)
    value, b, s = placed.value, placed.b, placed.s
    return value[b.to(value.device), s.to(value.device)]  # edit values may sit on the CPU


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


class Location(NamedTuple):
    """Where a site lives in the HF model: a module, whether the site is its ``input`` (first
    argument), its ``output`` (first element) or an attention module's ``weights`` (its second output,
    read only), and ``view``: the site's (batch, seq, width) view of that tensor (in place: writing into
    the view writes the tensor)."""

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


def mlp_path(vlm: VLM, layer: int) -> str:
    """A decoder layer's MLP module (``mlp``, or Llama 4's ``feed_forward``)."""
    path = vlm.arch.layer(layer)
    for name in ("mlp", "feed_forward"):
        try:
            vlm.hf.get_submodule(f"{path}.{name}")
        except AttributeError:
            continue
        return f"{path}.{name}"
    raise InputError(f"layer {layer} of {vlm.arch.name} has no mlp or feed_forward module: its MLP is no site")


def refuse_ops(placed: Sequence[Placed], what: str) -> None:
    if any(p.op is not None for p in placed):
        raise InputError(f"{what} can only be overwritten (Patch, Zero, Mean, Resample), not added to or scaled")


def write_at(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
    """Inside a trace: sites of one kind at one layer, written through their `Location`. A site
    without a recorded cache of its own reads its values from the edit (``Placed.value``) or ``op``."""
    for p in placed:
        loc = p.site.location(vlm)
        envoy = vlm.module(loc.path)
        view = loc.view(envoy.input if loc.io == "input" else first_output(envoy.output))
        b, s = p.b.to(view.device) + p.replica * n, p.s.to(view.device)
        view[b, s] = written(vlm, p, cache, view[b, s]).to(view.dtype)
