"""How the engine writes sites inside a traced forward (the sweeps' stacked edits, `countlens.circuits.engine.edits`).

An edit placed in a stacked batch (`Placed`): replica r (rows r·n … of the stacked batch) gets a value, or
a cached run's, or a function of what the forward has there (`written`), at its mask's entries. `write`
writes the placed edits of one site kind at one layer: through the site's `Location` (`write_at`), or,
where the site lives inside a module's own computation, by that kind's writer (an expert's contribution
inside the experts module, `write_experts`; a cross-attention model's image states, `write_states`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from countlens.circuits.sites import Expert, ImageStates, first_output
from countlens.circuits.sites.expert_rules import expert_rule
from countlens.errors import InputError

if TYPE_CHECKING:
    from jaxtyping import Bool, Float, Int

    from countlens.model.vlm import VLM


class Placed(NamedTuple):
    """An edit placed in a stacked forward: replica ``replica`` (rows replica·n … of the stacked
    batch) gets ``value``, or else the cached run's, at the mask's entries — rows b, positions s; or,
    with ``op``, op(what the forward has there) (`countlens.circuits.engine.interventions`)."""

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


def write_experts(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
    """Inside a trace: experts' contributions at one MoE layer, every replica's entries (the
    experts module sees the tokens flattened: row · seq + position)."""
    path = vlm.arch.experts(placed[0].site.layer)
    refuse_ops(placed, "an expert's contribution")
    writes = [
        ((p.b + p.replica * n) * seq + p.s, p.site.expert, lambda device, p=p: source(vlm, p, cache, device))
        for p in placed
    ]
    expert_rule(vlm.arch).write(vlm.hf.get_submodule(path), vlm.module(path), vlm.arch.n_experts, writes)


def write_states(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
    """Inside a trace: image states at one layer, every replica's entries — the projector's output
    written in place, or a patched copy passed to the cross-attention layer in place of the
    states every cross-attention layer shares."""
    layer, cross = placed[0].site.layer, vlm.arch.spec.cross_attention
    refuse_ops(placed, "the image states")
    n_states = placed[0].mask.shape[1]

    def per_row(states: Tensor) -> Tensor:
        if states.numel() % (n_states * states.shape[-1]):
            raise InputError(
                f"the image states {tuple(states.shape)} are not rows of {n_states} states: the edit's "
                "mask was made for another batch (build it from the batch that runs)"
            )
        return states.view(-1, n_states, states.shape[-1])

    if layer == -1:
        rows = per_row(vlm.module(cross.states).output)  # (rows, images, tiles, patches, d): in place
    else:
        if vlm.arch.kind(layer) != "cross":
            raise ValueError(f"layer {layer} is not a cross-attention layer; its attention reads no image states")
        attn = vlm.module(f"{vlm.arch.layer(layer)}.{cross.attn}")
        args, kwargs = attn.inputs
        states = kwargs[cross.states_kwarg].clone()  # (rows · images · tiles, patches, d)
        rows = per_row(states)
    for p in placed:
        src = source(vlm, p, cache, rows.device)
        rows[p.b.to(rows.device) + p.replica * n, p.s.to(rows.device)] = src.to(rows.device, rows.dtype)
    if layer != -1:
        attn.inputs = (args, {**kwargs, cross.states_kwarg: states})


#: Site kinds written inside a module's own computation, by their own writer; every other kind through
#: its `Location`.
WRITERS: dict[type, Callable] = {Expert: write_experts, ImageStates: write_states}


def write(vlm: VLM, placed: Sequence[Placed], cache: dict | None, n: int, seq: int) -> None:
    """Inside a trace: the placed edits of one site kind at one layer, written by that kind's writer."""
    WRITERS.get(type(placed[0].site), write_at)(vlm, placed, cache, n, seq)
