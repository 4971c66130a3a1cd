"""Edits of a forward pass: overwrite sites (a layer's residual, a head's z) and read the logits.

`run_edits` is the engine under patching and ablation. Many edited copies ("replicas") of one
clean batch run stacked in one forward, replica r receiving its own edits; every replica shows the
same images, so the vision tower runs once, and nothing changes below a replica's lowest edited
layer, so those layers run once too. `cache_run` records the activations a patch copies from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens import memory
from countlens.circuits.sites import expert_contribution, repeat_inputs, repeat_output
from countlens.errors import InputError

if TYPE_CHECKING:
    from jaxtyping import Bool, Float

    from countlens.vlm import VLM, Batch


@torch.no_grad()
def cache_run(
    vlm: VLM, batch: Batch, layers: Sequence[int], resid: bool = True, z: bool = True, experts: bool = False
) -> dict:
    """One traced forward: ``resid[l]`` and ``z[l]`` for every layer asked, and last-position logits.
    ``resid[-1]`` is the input of layer 0 (token embeddings with the projected image tokens). A
    cross-attention model's image states come too, as ``states``: Float[Tensor, "batch n_states d"].
    With ``experts``, ``experts[l]`` for every MoE layer asked: the experts module's input and the
    router's choice, (x, top-k index, top-k weights), each reshaped to (batch, seq, …)."""
    out: dict = {"resid": {}, "z": {}, "experts": {}}
    moe = set(vlm.arch.expert_layers) if experts else set()
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
                site = vlm.module(vlm.arch.experts(layer))
                if vlm.arch.spec.moe.rule == "scaled_inputs":  # every expert's contribution, (E·T, d)
                    out["experts"][layer] = (site.output.save(),)
                else:  # what the contributions are computed from: (x, top-k index, top-k weights)
                    out["experts"][layer] = tuple(t.save() for t in site.inputs[0][:3])
            if resid:
                out["resid"][layer] = vlm.module(vlm.arch.layer(layer)).output.save()
        logits = vlm.nn.output.logits[:, -1].save()
    out["logits"] = logits.float()
    rows, seq = batch.inputs["input_ids"].shape
    out["experts"] = {layer: _per_token(vlm, got, rows, seq) for layer, got in out["experts"].items()}
    if cross is not None:
        out["states"] = states.reshape(len(batch), -1, states.shape[-1])
    return out


def _per_token(vlm: VLM, saved: tuple, rows: int, seq: int) -> tuple:
    """A MoE layer's recorded experts tensors reshaped per token: (x, index, weights) each (rows, seq, …),
    or, under the scaled-inputs rule, every expert's contribution (experts, rows, seq, d)."""
    if vlm.arch.spec.moe.rule == "scaled_inputs":
        return (saved[0].view(vlm.arch.n_experts, rows, seq, -1),)
    return tuple(t.view(rows, seq, -1) for t in saved)


@dataclass(frozen=True)
class Edit:
    """Overwrite one site at the masked positions: the residual after ``layer`` (``head`` None; layer
    −1 = the input of layer 0), head ``head``'s z there, or expert ``expert``'s contribution, with
    ``value`` (Float[Tensor, "batch seq d"]) or else the cached run's. With ``states`` (cross-attention
    models) the site is the image states
    (`countlens.circuits.sites`) and ``mask`` is Bool[Tensor, "batch n_states"]."""

    layer: int
    mask: Bool[Tensor, "batch seq"]
    head: int | None = None
    value: Float[Tensor, "batch seq d"] | None = None
    states: bool = False
    # A MoE layer's expert: its contribution (`countlens.circuits.sites.expert_contribution`) replaced by
    # ``value``'s or the cached run's (the cache recorded with experts=True).
    expert: int | None = None


def _at(value: Tensor, b: Tensor, s: Tensor) -> Tensor:
    """value[b, s], wherever value and the indices live (edit values may sit on the CPU)."""
    return value[b.to(value.device), s.to(value.device)]


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
    the device's free memory holds, at most `countlens.memory.MAX_ROWS`;
    `countlens.memory.rows_per_forward`). Two savings, exact by construction:
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
    # Stacked forwards share their skipped prefix: order replicas by their lowest edited layer.
    first = [min((e.layer for e in edits), default=n_layers) for edits in replicas]
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
        where = [(r, e, *e.mask.nonzero(as_tuple=True)) for r, i in enumerate(chunk) for e in replicas[i]]
        with vlm.trace(inputs, use_cache=False, logits_to_keep=keep):
            if clean:
                vlm.module(tower).skip(repeat_output(clean["vision"], k, int(vlm.arch.spec.packed_tower)))
                if start >= 1:
                    # Layers below the first edit: only the last one's output is ever read.
                    below = repeat_output(clean[start - 1], k)
                    for layer in range(start):
                        vlm.module(vlm.arch.layer(layer)).skip(below)
            # nnsight needs modules in execution order: layers ascending; in a layer the image states
            # (the projector's output, or a cross-attention layer's input), o_proj, the layer output.
            for layer in sorted({e.layer for _, e, _, _ in where}):
                ss = [w for w in where if w[1].layer == layer and w[1].states]
                if ss:
                    _edit_states(vlm, layer, ss, cache, n)
                zs = [w for w in where if w[1].layer == layer and w[1].head is not None]
                if zs:
                    zin = vlm.module(vlm.arch.o_proj(layer)).input
                    for r, e, b, s in zs:
                        d_head = vlm.arch.head_dim(layer)
                        cols = slice(e.head * d_head, (e.head + 1) * d_head)
                        src = _at(e.value, b, s) if e.value is not None else cache["z"][layer][b, s, cols]
                        zin[b.to(zin.device) + r * n, s.to(zin.device), cols] = src.to(zin.device, zin.dtype)
                xs = [w for w in where if w[1].layer == layer and w[1].expert is not None]
                if xs:
                    _edit_experts(vlm, layer, xs, cache, n, int(inputs["input_ids"].shape[1]))
                rs = [
                    w
                    for w in where
                    if w[1].layer == layer and w[1].head is None and not w[1].states and w[1].expert is None
                ]
                if rs:
                    site = vlm.module(vlm.arch.layer(max(layer, 0)))
                    hid = site.input if layer == -1 else site.output
                    for r, e, b, s in rs:
                        src = _at(e.value, b, s) if e.value is not None else cache["resid"][layer][b, s]
                        hid[b.to(hid.device) + r * n, s.to(hid.device)] = src.to(hid.device, hid.dtype)
            logits = (vlm.nn.output.logits[:, -1] if keep == 1 else vlm.nn.output.logits[:, -keep:]).save()
        for r, i in enumerate(chunk):
            rows = logits[r * n : (r + 1) * n].float()
            out[i] = (rows if reduce is None else reduce(rows)).cpu()
    return torch.stack(out)


def _edit_experts(vlm: VLM, layer: int, edits: list, cache: dict | None, n: int, seq: int) -> None:
    """Inside a trace: replace experts' contributions at a MoE layer's output (flattened tokens: row ·
    seq + position) by the edit's value or the cached run's contribution of the same expert."""
    path = vlm.arch.experts(layer)
    module = vlm.hf.get_submodule(path)
    site = vlm.module(path)
    if vlm.arch.spec.moe.rule == "scaled_inputs":  # each expert's contribution is its own rows: overwrite them
        out = site.output.view(vlm.arch.n_experts, -1, site.output.shape[-1])
        for r, e, b, s in edits:
            rows = ((b + r * n) * seq + s).to(out.device)
            if e.value is not None:
                src = _at(e.value, b, s)
            else:
                cached = cache["experts"][layer][0][e.expert]
                src = cached[b.to(cached.device), s.to(cached.device)]
            out[e.expert, rows] = src.to(out.device, out.dtype)
        return
    x, index, weights = site.inputs[0][:3]
    out = site.output
    for r, e, b, s in edits:
        rows = ((b + r * n) * seq + s).to(out.device)
        mine = expert_contribution(module, x[rows], index[rows], weights[rows], e.expert)
        if e.value is not None:
            src = _at(e.value, b, s)
        else:
            cx, ci, cw = (t[b.to(t.device), s.to(t.device)] for t in cache["experts"][layer])
            src = expert_contribution(module, cx.to(out.device), ci.to(out.device), cw.to(out.device), e.expert)
        out[rows] = out[rows] - mine + src.to(out.device, out.dtype)


def _edit_states(vlm: VLM, layer: int, edits: list, cache: dict | None, n: int) -> None:
    """Inside a trace: overwrite image states — at layer −1 the projector's output, which every
    cross-attention layer reads; at a cross-attention layer the states that layer alone reads, a
    patched copy passed in its place (the tensor itself is shared by every cross-attention layer)."""
    cross = vlm.arch.spec.cross_attention
    n_states = edits[0][1].mask.shape[1]

    def per_row(states: Tensor) -> Tensor:
        if states.numel() % (n_states * states.shape[-1]):
            raise InputError(
                f"the image states {tuple(states.shape)} are not rows of {n_states} states: the edit's mask "
                "was made for another batch (build it from the batch that runs)"
            )
        return states.view(-1, n_states, states.shape[-1])

    if layer == -1:
        rows = per_row(vlm.module(cross.states).output)  # (rows, images, tiles, patches, d): written in place
    else:
        if vlm.arch.kind(layer) != "cross":
            raise ValueError(f"layer {layer} is not a cross-attention layer; its attention reads no image states")
        site = vlm.module(f"{vlm.arch.layer(layer)}.{cross.attn}")
        args, kwargs = site.inputs
        states = kwargs[cross.states_kwarg].clone()  # (rows · images · tiles, patches, d)
        rows = per_row(states)
    for r, e, b, s in edits:
        src = (
            _at(e.value, b, s)
            if e.value is not None
            else cache["states"][b.to(cache["states"].device), s.to(cache["states"].device)]
        )
        rows[b.to(rows.device) + r * n, s.to(rows.device)] = src.to(rows.device, rows.dtype)
    if layer != -1:
        site.inputs = (args, {**kwargs, cross.states_kwarg: states})
