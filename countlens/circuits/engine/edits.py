"""Edits of a forward pass: overwrite sites at masked positions and read the logits.

An `Edit` is a site (`countlens.circuits.sites`: a layer's residual, a head's z, q / k / v, an MLP's
input or output, an expert's contribution, the image states), a mask of the positions it overwrites,
and the value written there — or, without one, the value a cached run had there; or a function of
the value the forward has there (`countlens.circuits.engine.interventions` lowers to these). `cache_run`
records those cached values.

`run_edits` is the engine under patching and ablation. Many edited copies ("replicas") of one
clean batch run stacked in one forward, replica r receiving its own edits, which each site kind
writes itself; every replica shows the same images, so the vision tower runs once, and nothing
changes below a replica's lowest edited layer, so those layers run once too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.engine.writes import Placed, write
from countlens.circuits.sites import Site, repeat_inputs, repeat_output, skip_tower
from countlens.circuits.sites.expert_rules import expert_rule
from countlens.errors import InputError
from countlens.model import memory

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.model.vlm import VLM, Batch


@torch.no_grad()
def cache_run(
    vlm: VLM, batch: Batch, layers: Sequence[int], resid: bool = True, z: bool = True, experts: bool = False
) -> dict:
    """One traced forward: ``resid[l]`` and ``z[l]`` for every layer asked, and last-position logits.
    ``resid[-1]`` is the input of layer 0 (token embeddings with the projected image tokens). A
    cross-attention model's image states come too, as ``states``: Float[Tensor, "batch n_states d"].
    With ``experts``, ``experts[l]`` for every MoE layer asked: what the layer's rule reads expert
    contributions from, per token (`countlens.circuits.sites.expert_rules`: the experts module's input and
    the router's choice, or every expert's contribution)."""
    out: dict = {"resid": {}, "z": {}, "experts": {}}
    moe = set(vlm.arch.expert_layers) if experts else set()
    rule = expert_rule(vlm.arch) if moe else None
    cross = vlm.arch.spec.cross_attention
    with vlm.read(batch):
        if cross is not None:
            states = vlm.module(cross.states).output.save()
        if resid and -1 in layers:
            out["resid"][-1] = vlm.module(vlm.arch.layer(0)).input.save()
        for layer in sorted(x for x in layers if x >= 0):
            if z:
                out["z"][layer] = vlm.module(vlm.arch.o_proj(layer)).input.save()
            if layer in moe:
                out["experts"][layer] = rule.record(vlm.module(vlm.arch.experts(layer)))
            if resid:
                out["resid"][layer] = vlm.module(vlm.arch.layer(layer)).output.save()
        logits = vlm.nn.output.logits[:, -1].save()
    out["logits"] = logits.float()
    rows, seq = batch.inputs["input_ids"].shape
    out["experts"] = {
        layer: rule.per_token(got, rows, seq, vlm.arch.n_experts) for layer, got in out["experts"].items()
    }
    if cross is not None:
        out["states"] = states.reshape(len(batch), -1, states.shape[-1])
    return out


@dataclass(frozen=True)
class Edit:
    """Overwrite ``site`` at the masked positions with ``value`` (Float[Tensor, "batch seq d"], d the
    site's width), or else with the cached run's value there. An `countlens.circuits.sites.ImageStates`
    site's positions are the states: its mask is Bool[Tensor, "batch n_states"]."""

    site: Site
    mask: Bool[Tensor, "batch seq"]
    value: Float[Tensor, "batch seq d"] | None = None
    # Or what is written as a function of what the forward has there (Float[Tensor, "k d"] → same).
    op: Callable[[Tensor], Tensor] | None = None

    def placed(self, replica: int) -> Placed:
        """This edit in replica ``replica`` of a stacked forward, its mask's entries listed."""
        return Placed(replica, self.site, self.mask, self.value, *self.mask.nonzero(as_tuple=True), self.op)


@torch.no_grad()
def run_edits(
    vlm: VLM,
    batch: Batch,
    cache: dict | None,
    replicas: Sequence,
    max_rows: int | None = None,
    reduce=None,
    keep: int = 1,
) -> Float[Tensor, "replicas ..."]:
    """Last-position logits with each replica's edits applied: Float[Tensor, "replicas batch vocab"]
    (with ``keep`` > 1 the last ``keep`` positions: Float[Tensor, "replicas batch keep vocab"]), or
    ``reduce(logits)`` per replica (e.g. the gold answer's log-prob) so that a long sweep over a
    large vocabulary never holds every replica's full logits.

    ``replicas`` holds one `Edit` or a list of edits (applied together) per replica; replicas run
    stacked in one forward, ``max_rows // len(batch)`` at a time (``max_rows`` None: as many rows as
    the device's free memory holds, at most `countlens.model.memory.MAX_ROWS`;
    `countlens.model.memory.rows_per_forward`). Two savings, exact by construction:
    every replica shows the same images, so the vision tower runs once and is skipped in the stacked
    forwards; and nothing changes below a replica's lowest edited layer, so the layers beneath the
    lowest edit of a stacked forward are skipped too, their clean output fed in from one clean run.
    """
    n = len(batch)
    if max_rows is None:
        free = memory.model_free_bytes(vlm)
        if free is None:  # a remote model: the server's memory is not known here
            max_rows = memory.MAX_ROWS
        else:
            w, seq = memory.widths(vlm), int(batch.inputs["input_ids"].shape[1])
            patches = batch.patches(w.merge)
            max_rows = memory.rows_per_forward(w, seq, free, keep, patches)
    per_pass = max(1, max_rows // n)
    n_layers = vlm.arch.n_layers
    replicas = [[r] if isinstance(r, Edit) else list(r) for r in replicas]
    for e in [e for edits in replicas for e in edits if e.value is not None]:
        if e.value.shape[-1] != (width := e.site.width(vlm.arch)):
            raise InputError(f"an edit of {e.site} writes values {e.value.shape[-1]} wide; the site is {width} wide")
    # Stacked forwards share their skipped prefix: order replicas by their lowest edited layer.
    first = [min((e.site.layer for e in edits), default=n_layers) for edits in replicas]
    order = sorted(range(len(replicas)), key=lambda i: first[i])
    chunks = [order[i : i + per_pass] for i in range(0, len(order), per_pass)]
    starts = [min(first[i] for i in chunk) for chunk in chunks]
    if vlm.arch.kv_shared_layers:  # later layers read keys and values the earlier ones store as they run
        starts = [0] * len(chunks)
    tower = vlm.arch.spec.vision_tower
    clean: dict = {}
    if len(replicas) > 1:
        # A copy of the tower's output, because the model edits that object afterwards.
        with vlm.read(batch):
            clean["vision"] = repeat_output(vlm.module(tower).output, 1)
            for layer in sorted({s - 1 for s in starts if s >= 1}):
                clean[layer] = vlm.module(vlm.arch.layer(layer)).output.save()
    out = [None] * len(replicas)
    for chunk, start in zip(chunks, starts):
        k = len(chunk)
        inputs = repeat_inputs(batch.inputs, k)
        seq = int(inputs["input_ids"].shape[1])
        writes: dict[tuple[int, int], list[Placed]] = {}
        for r, i in enumerate(chunk):
            for e in replicas[i]:
                writes.setdefault((e.site.layer, e.site.stage), []).append(e.placed(r))
        with vlm.trace(inputs, use_cache=False, logits_to_keep=keep):
            if clean:
                skip_tower(vlm, clean["vision"], k)
                if start >= 1:
                    # Layers below the first edit: only the last one's output is ever read.
                    below = repeat_output(clean[start - 1], k)
                    for layer in range(start):
                        vlm.module(vlm.arch.layer(layer)).skip(below)
            # nnsight needs modules in execution order: layers ascending, and in a layer the site
            # kinds by stage; each kind writes its edits at a layer together.
            for key in sorted(writes):
                group = writes[key]
                write(vlm, group, cache, n, seq)
            logits = (vlm.nn.output.logits[:, -1] if keep == 1 else vlm.nn.output.logits[:, -keep:]).save()
        for r, i in enumerate(chunk):
            rows = logits[r * n : (r + 1) * n].float()
            out[i] = (rows if reduce is None else reduce(rows)).cpu()
    return torch.stack(out)
