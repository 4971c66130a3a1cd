"""Circuits of edges: a forward in which chosen edges carry another run's values.

Ablating edge u → r (`countlens.circuits.graph.edges`) replaces u's output by the ablation value a_u (the
corrupt run's, or a mean) in receiver r's copy of the residual stream only. In one forward of the
clean input, every receiver reads

    x_r = x − Σ_{u → r ablated} (c_u − a_u),

x the residual stream at r as the forward computes it, c_u what node u outputs in this same forward
(which already reflects the edges ablated upstream of u). The receiver's input norm is applied to x_r
and, for a head's q, k or v, that head's columns of the projection recomputed from it; an MLP reads
norm(x_r); the logits are read from norm(x_r) at the final norm. Everything else — the residual
stream itself, the attention pattern's other heads — runs as usual. With no edge ablated every
receiver reads x (the clean run); with every edge ablated each receiver reads the sum of the ablation
values, so with counterfactual patching the forward is the corrupt run.

**Cost.** Each node's c_u − a_u is mapped into the stream once, as u's output is computed (a head's
z difference through its columns of o_proj), and a layer's receivers form their sums in one batched
product with each circuit's 0 / 1 weights over the nodes upstream: receivers × upstream nodes ×
d_model multiply-adds per layer and position (`countlens.pipeline.stages.edges.edge_forward_flops`).
A circuit that ablates more edges than it keeps reads the complement, x_r = x_a + Σ_{kept u → r}
(c_u − a_u), x_a the ablation values' own stream (their embeddings, o_proj outputs and MLP outputs
summed, as the residual stream adds them), so only the nodes some circuit's sum reads are kept.

**Gradients** (opt-in, ``grad``): the same forward keeps its graph, into the weights and into the
ablation values (a `record_nodes` recording made with ``grad``); planting an edge circuit trains through
it (`countlens.toy.edge_forward`). The default is the no-grad path above.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr
from torch import Tensor

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.graph.edges import EdgeGraph, Receiver, o_weight, receiver_columns
from countlens.circuits.sites import (
    INPUTS,
    AttnIn,
    K,
    MlpIn,
    Q,
    V,
    first_arg,
    first_output,
    heads_view,
    repeat_inputs,
    skip_tower,
    tower_output,
)
from countlens.errors import InputError
from countlens.model import memory
from countlens.validate import require_finite_scores

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch


def edge_scores(graph: EdgeGraph, scores) -> dict[int, float]:
    """A ranking's score per edge (by its index in ``graph.edges``): an `edge_attribution` result, or a
    mapping from edge label (``L0H1→L2H3.q``, ``IN.image→MLP0.in``, ``MLP5→logits``) to score, every edge."""
    labels = graph.labels()
    if isinstance(scores, xr.Dataset):
        scores = scores.effect
    if isinstance(scores, xr.DataArray):
        if scores.dims != ("edge",):
            raise InputError(
                f"edge scores over {scores.dims}: give edge_attribution's result, or {{edge label: score}}"
            )
        values = dict(zip(map(str, scores["edge"].values), map(float, scores.values)))
    elif isinstance(scores, Mapping):
        try:
            values = {str(k): float(v) for k, v in scores.items()}
        except (TypeError, ValueError) as err:
            raise InputError(f"edge scores must map edge labels to numbers ({err})") from None
    else:
        raise InputError(f"edge scores of type {type(scores).__name__}: give edge_attribution's result or a mapping")
    require_finite_scores({k: v for k, v in values.items() if k in labels and not np.isnan(v)}, "the edge ranking")
    missing = [lab for lab in labels if lab not in values or np.isnan(values[lab])]
    unknown = sorted(set(values) - set(labels))
    if unknown or missing:
        what = f"name {unknown[:3]}, which are no edges of this model" if unknown else f"score no {missing[:3]}"
        raise InputError(
            f"the edge ranking's labels {what}; rank every edge of edge_graph(vlm) (edge_attribution does)"
        )
    return {i: values[lab] for i, lab in enumerate(labels)}


class _Ablator:
    """The hooks of one stacked forward: k circuits × n rows of the batch.

    ``weights[r]`` (rows, prefix) is 1 where a row's circuit ablates edge u → r. Only the **live** nodes
    — those some receiver's ablated edges read — are kept: as each one's output is computed, its
    difference from the ablation value, in the residual stream's space, goes into one slot of
    ``deltas`` (rows, live, seq, d_model). A receiver's Σ (c_u − a_u) over its ablated edges is then
    one masked sum over those slots, and a layer's receivers share one batched product: the cost per
    layer is receivers × live nodes × d_model per position, not an o_proj-sized product per receiver
    and upstream layer."""

    def __init__(
        self, vlm: VLM, graph: EdgeGraph, weights: dict[Receiver, Tensor], values: dict, image: Tensor, k: int
    ):
        self.vlm, self.graph, self.values, self.k = vlm, graph, values, k
        self.image = image.repeat(k, 1)[..., None]  # (rows, seq, 1)
        arch = vlm.arch
        # A row whose circuit ablates more of these edges than it keeps reads the complement: Σ over its
        # ablated edges = (x − x_a) − Σ over its kept ones, x_a the ablation values' own stream there.
        rows = next(iter(weights.values())).shape[0] if weights else 0
        ablated, total = torch.zeros(rows), 0
        for w in weights.values():
            ablated += w.sum(1)
            total += w.shape[1]
        self.complement = ablated > total - ablated
        weights = {r: torch.where(self.complement[:, None], w - 1, w) for r, w in weights.items()}
        touched = torch.zeros(len(graph.nodes), dtype=torch.bool)
        for w in weights.values():
            touched[: w.shape[1]] |= (w != 0).any(0)
        self.live = touched.nonzero().flatten().tolist()
        self.slot = {u: i for i, u in enumerate(self.live)}
        self.streams: dict | None = None
        self.starts = graph.starts
        # Per layer (the logits: n_layers), the receivers with ablated edges — its attention block's, then
        # its MLP — and their weights over the live nodes before the layer's heads, read in one product
        # as the layer starts; the MLP's weights over its own layer's heads are read when it starts.
        self.groups: dict[int, tuple[list[Receiver], Tensor]] = {}
        self.own: dict[int, tuple[int, Tensor]] = {}
        self.partial: Tensor | None = None  # the MLP's sum over the nodes before its layer's heads
        for layer in range(arch.n_layers + 1):
            mine = [r for r in graph.receivers if r.layer == layer and r in weights]
            if not mine:
                continue
            before = self.starts[layer] if layer < arch.n_layers else len(graph.nodes)
            m0 = bisect_left(self.live, before)
            self.groups[layer] = (mine, torch.stack([weights[r][:, self.live[:m0]] for r in mine], 1))
            if isinstance(mine[-1], MlpIn):
                m1 = bisect_left(self.live, before + arch.heads(layer))
                self.own[layer] = (m0, weights[mine[-1]][:, self.live[m0:m1]])
        self.deltas: Tensor | None = None
        self.normed: dict[Receiver, Tensor] = {}
        self.busy = False

    def _store(self, u: int, delta: Tensor) -> None:
        i = self.slot.get(u)
        if i is not None:
            self.deltas[:, i] = delta

    def _rows(self, x: Tensor, value: Tensor) -> Tensor:
        """x − the ablation value, the value (n rows) broadcast over the k circuits."""
        return (x.reshape(self.k, -1, *x.shape[1:]) - value.to(x.dtype)).reshape(x.shape)

    def _sum(self, w: Tensor, start: int = 0) -> Tensor:
        """Σ over live nodes start … start + m of w (rows, receivers, m) × their differences:
        (rows, receivers, seq, d)."""
        d = self.deltas
        rows, _, seq, width = d.shape
        m = w.shape[-1]
        out = torch.bmm(w.to(d.device, d.dtype), d[:, start : start + m].reshape(rows, m, seq * width))
        return out.view(rows, w.shape[1], seq, width)

    def _complement(self, out: Tensor, x: Tensor, key) -> Tensor:
        """``out`` (rows, receivers, seq, d) plus, in the rows that read the complement, x − x_a."""
        if bool(self.complement.any()):
            out += (self._rows(x, self._stream(key)) * self.complement.to(x.device, x.dtype)[:, None, None])[:, None]
        return out

    def _stream(self, key) -> Tensor:
        """The ablation values' own residual stream (n rows) where group ``key`` reads it: the input
        embeddings plus every upstream layer's attention output (o_proj of its z) and MLP output."""
        if self.streams is None:
            v, hf = self.values, self.vlm.hf
            stream, self.streams = v["embed"], {}
            for layer, paths in enumerate(self.graph.layers):
                self.streams[(layer, 0)] = stream
                o_proj = module_of(hf, paths.o_proj)
                z = v["z"][layer].to(o_proj.weight.dtype)
                stream = stream + F.linear(z, o_proj.weight, o_proj.bias).to(stream.dtype)
                self.streams[(layer, 1)] = stream
                stream = stream + v["mlp"][layer].reshape(stream.shape).to(stream.dtype)
            self.streams[(len(self.graph.layers), 0)] = stream
        return self.streams[key]

    def norm_of(self, module, x: Tensor) -> Tensor:
        self.busy = True
        try:
            return module(x)
        finally:
            self.busy = False

    # hooks -----------------------------------------------------------------------------------------------

    def embed(self, module, args, kwargs):
        x = first_arg(args, kwargs)
        self.deltas = x.new_empty(x.shape[0], len(self.live), *x.shape[1:])
        d = self._rows(x, self.values["embed"])
        image = self.image.to(d.dtype)
        self._store(0, d * image)
        self._store(1, d * (1 - image))

    def z(self, layer):
        start, heads = self.starts[layer], self.vlm.arch.heads(layer)
        live = [h for h in range(heads) if start + h in self.slot]
        paths = self.graph.layers[layer]

        def hook(module, args, kwargs):
            if not live:
                return
            dz = heads_view(self._rows(first_arg(args, kwargs), self.values["z"][layer]), heads)[:, :, live]
            w = o_weight(self.vlm, paths, heads)[live].to(dz.dtype)
            i = self.slot[start + live[0]]
            self.deltas[:, i : i + len(live)] = torch.einsum("bshd,hod->bhso", dz, w)

        return hook

    def mlp_out(self, layer):
        u = self.starts[layer] + self.vlm.arch.heads(layer)

        def hook(module, args, kwargs, out):
            if u in self.slot:
                d = self.deltas
                delta = first_output(out).reshape(d.shape[0], *d.shape[2:])
                self._store(u, self._rows(delta, self.values["mlp"][layer].reshape(-1, *d.shape[2:])))

        return hook

    def attn_norm(self, layer):
        def hook(module, args, kwargs, out):
            if self.busy or layer not in self.groups:
                return None
            x = args[0]
            mine, w = self.groups[layer]
            removed = self._sum(w)
            if isinstance(mine[-1], MlpIn):
                self.partial, removed, mine = removed[:, -1], removed[:, :-1], mine[:-1]
            if not mine:
                return None
            removed = self._complement(removed, x, (layer, 0))
            if removed.requires_grad:  # with gradients (out= has none)
                copies = self.norm_of(module, x[:, None] - removed)
            else:  # every receiver's at once, in place
                copies = self.norm_of(module, torch.sub(x[:, None], removed, out=removed))
            self.normed = {r: copies[:, i] for i, r in enumerate(mine)}
            return self.normed[mine[0]] if isinstance(mine[0], AttnIn) else None

        return hook

    def projection(self, layer, part: type):
        def hook(module, args, kwargs, out):
            todo = [r for r in self.normed if type(r) is part and r.layer == layer]
            if not todo:
                return None
            out = out.clone()
            for r in todo:
                cols = receiver_columns(self.graph, r, module)
                bias = None if module.bias is None else module.bias[cols]
                out[..., cols] = F.linear(self.normed[r], module.weight[cols], bias)
            return out

        return hook

    def mlp_norm(self, layer):
        """The MLP's norm applied to its own copy of the stream: the sum over the nodes before its layer
        (formed as the layer started) and over its own layer's heads."""

        def hook(module, args, kwargs, out):
            if self.busy or layer not in self.own:
                return None
            x = args[0]
            start, w = self.own[layer]
            removed = self.partial[:, None] + self._sum(w[:, None], start)
            return self.norm_of(module, x - self._complement(removed, x, (layer, 1))[:, 0])

        return hook

    def final_norm(self, module, args, kwargs, out):
        """The final norm applied to the logits' own copy of the stream."""
        layer = len(self.graph.layers)
        if self.busy or layer not in self.groups:
            return None
        x = args[0]
        removed = self._complement(self._sum(self.groups[layer][1]), x, (layer, 0))
        return self.norm_of(module, x - removed[:, 0])

    def hooks(self) -> list:
        graph = self.graph
        if not self.groups:
            return []
        out = [Hook(self.vlm.arch.layer(0), "before", self.embed)]
        for layer, paths in enumerate(graph.layers):
            out += [
                Hook(paths.attn_norm, "after", self.attn_norm(layer)),
                Hook(paths.o_proj, "before", self.z(layer)),
                Hook(paths.mlp_norm, "after", self.mlp_norm(layer)),
                Hook(paths.mlp, "after", self.mlp_out(layer)),
            ]
            if paths.qkv is not None:
                out += [Hook(p, "after", self.projection(layer, part)) for part, p in zip((Q, K, V), paths.qkv)]
        out.append(Hook(graph.final_norm, "after", self.final_norm))
        return out


def edge_row_bytes(w: memory.Widths, seq: int, receivers: int, live: int | None = None) -> int:
    """What one stacked row of `edge_ablated_logits` holds beyond a plain forward's: the live nodes'
    differences from their ablation values in the residual stream's space (``live``: every node of the
    graph unless given), and one layer's ``receivers`` copies of the stream and their normed copies
    (with the norm's two float32 intermediates)."""
    nodes = len(INPUTS) + w.n_layers * (w.n_heads + 1) if live is None else live
    return ((nodes + 2 * receivers) * w.act_bytes + 2 * receivers * 4) * seq * w.d_model


def _weights(graph: EdgeGraph, sets: Sequence[frozenset], n: int) -> dict[Receiver, Tensor]:
    """Per receiver, (rows, prefix) 1.0 where the row's set ablates the edge; receivers no set touches
    are left out."""
    offsets = graph.offsets()
    ablated = torch.zeros(len(sets), len(graph.edges))
    for i, s in enumerate(sets):
        if s:
            ablated[i, sorted(s)] = 1.0
    out = {}
    for r in graph.receivers:
        w = ablated[:, offsets[r] : offsets[r] + graph.prefix[r]]
        if bool(w.any()):
            out[r] = w.repeat_interleave(n, 0)
    return out


def edge_max_rows(vlm: VLM, graph: EdgeGraph, batch: Batch) -> int:
    """The rows of ``batch``'s shape an edge-ablated forward may stack in the memory free now, every
    node live (`edge_row_bytes`)."""
    free = memory.model_free_bytes(vlm)
    if free is None:
        return memory.MAX_ROWS
    w = memory.widths(vlm)
    seq = int(batch.inputs["input_ids"].shape[1])
    receivers = max(sum(r.layer == la for r in graph.receivers) for la in range(vlm.arch.n_layers))
    return memory.rows_per_forward(w, seq, free, 1, batch.patches(w.merge), extra=edge_row_bytes(w, seq, receivers))


def edge_ablated_logits(
    vlm: VLM,
    graph: EdgeGraph,
    batch: Batch | dict,
    sets: Sequence[frozenset],
    values: dict,
    image: Tensor,
    max_rows=None,
    grad: bool = False,
) -> torch.Tensor:
    """Last-position logits of ``batch`` once per set of edge indices in ``sets`` (circuits × batch ×
    vocab), those edges ablated to ``values`` (a `record_nodes` recording of the same batch's shape),
    as many sets a stacked forward as memory holds. ``batch``: a prepared `Batch`, or the model's
    inputs (then give ``max_rows``); one set a forward runs on them as they are, not copied.

    Without ``grad``, no gradients, and the logits come back on the CPU. With it (opt-in: training,
    `countlens.toy.edge_plant`) the logits keep their graph, into the weights and into ``values`` (a
    `record_nodes` recording made with ``grad``), and stay on the model's device."""
    inputs = batch if isinstance(batch, dict) else batch.inputs
    if max_rows is None:
        if isinstance(batch, dict):
            raise InputError("edge_ablated_logits of an inputs dict needs max_rows: give it, or a prepared Batch")
        max_rows = edge_max_rows(vlm, graph, batch)
    n = int(inputs["input_ids"].shape[0])
    per_pass = max(1, max_rows // n)
    with torch.set_grad_enabled(grad):
        tower = tower_output(vlm, inputs) if len(sets) > 1 else None
        out = []
        for i in range(0, len(sets), per_pass):
            chunk = sets[i : i + per_pass]
            k = len(chunk)
            ablator = _Ablator(vlm, graph, _weights(graph, chunk, n), values, image, k)
            with (
                hooked(vlm.hf, ablator.hooks()),
                vlm.trace(inputs if k == 1 else repeat_inputs(inputs, k), use_cache=False, logits_to_keep=1),
            ):
                if tower is not None:
                    skip_tower(vlm, tower, k)
                logits = vlm.nn.output.logits[:, -1].save()
            logits = logits.float().view(k, n, -1)
            out.append(logits if grad else logits.cpu())
        return torch.cat(out)
