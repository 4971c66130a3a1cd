"""Circuits of edges: a forward in which chosen edges carry another run's values.

Ablating edge u → r (`countlens.circuits.edges`) replaces u's output by the ablation value a_u (the
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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr
from torch import Tensor

from countlens import memory
from countlens.circuits.edges import EdgeGraph, Receiver, hooked, receiver_columns, stream_shaped
from countlens.circuits.sites import INPUTS, AttnIn, K, MlpIn, Q, V, first_arg, first_output, repeat_inputs
from countlens.errors import InputError
from countlens.validate import require_finite_scores

if TYPE_CHECKING:
    from countlens.vlm import VLM, Batch


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
    """The hooks of one stacked forward: ``weights[r]`` (rows, prefix) is 1 where row's circuit ablates
    edge u → r, ``values`` the ablation values tiled to the rows."""

    def __init__(self, vlm: VLM, graph: EdgeGraph, weights: dict[Receiver, Tensor], values: dict, image: Tensor):
        self.vlm, self.graph, self.weights, self.values = vlm, graph, weights, values
        self.image = image[..., None]
        self.delta: dict = {"z": {}, "mlp": {}}
        self.normed: dict[Receiver, Tensor] = {}
        self.busy = False
        arch = vlm.arch
        self.starts = []  # where each layer's heads start in the node order
        at = len(INPUTS)
        for layer in range(arch.n_layers):
            self.starts.append(at)
            at += arch.heads(layer) + 1

    def removed(self, r: Receiver, like: Tensor) -> Tensor | None:
        """Σ over r's ablated edges of (c_u − a_u), or None where r has none."""
        w = self.weights.get(r)
        if w is None:
            return None
        w = w.to(like.device, like.dtype)
        arch, out = self.vlm.arch, torch.zeros_like(like)
        d_in = self.delta["embed"]
        out += w[:, 0, None, None] * d_in * self.image + w[:, 1, None, None] * d_in * (1 - self.image)
        for layer in range(arch.n_layers):
            s = self.starts[layer]
            if s >= w.shape[1]:
                break
            heads = arch.heads(layer)
            wh = w[:, s : s + heads]
            if bool(wh.any()):
                dz = self.delta["z"][layer] * wh.repeat_interleave(arch.head_dim(layer), 1)[:, None, :]
                out += F.linear(dz, self.vlm.hf.get_submodule(self.graph.layers[layer].o_proj).weight)
            if s + heads < w.shape[1] and bool(w[:, s + heads].any()):
                out += w[:, s + heads, None, None] * self.delta["mlp"][layer]
        return out

    def norm_of(self, module, x: Tensor) -> Tensor:
        self.busy = True
        try:
            return module(x)
        finally:
            self.busy = False

    # hooks -----------------------------------------------------------------------------------------------

    def embed(self, module, args, kwargs):
        x = first_arg(args, kwargs)
        self.delta["embed"] = x - self.values["embed"].to(x.dtype)

    def z(self, layer):
        def hook(module, args, kwargs):
            self.delta["z"][layer] = first_arg(args, kwargs) - self.values["z"][layer]

        return hook

    def mlp_out(self, layer):
        def hook(module, args, out):
            delta = first_output(out) - self.values["mlp"][layer]
            self.delta["mlp"][layer] = stream_shaped(delta, self.delta["embed"])

        return hook

    def attn_norm(self, layer):
        mine = [r for r in self.graph.receivers if r.layer == layer and r.block == 0]

        def hook(module, args, out):
            if self.busy:
                return None
            x = args[0]
            self.normed = {}  # one layer's copies at a time
            for r in mine:
                removed = self.removed(r, x)
                self.normed[r] = None if removed is None else self.norm_of(module, x - removed)
            if isinstance(mine[0], AttnIn) and self.normed[mine[0]] is not None:
                return self.normed[mine[0]]
            return None

        return hook

    def projection(self, layer, part: type):
        mine = [r for r in self.graph.receivers if r.layer == layer and type(r) is part]

        def hook(module, args, out):
            todo = [r for r in mine if self.normed.get(r) is not None]
            if not todo:
                return None
            out = out.clone()
            for r in todo:
                cols = receiver_columns(self.graph, r, module)
                bias = None if module.bias is None else module.bias[cols]
                out[..., cols] = F.linear(self.normed[r], module.weight[cols], bias)
            return out

        return hook

    def reread(self, r: Receiver):
        """A norm's forward hook: the norm applied to r's own copy of the stream (the MLP, the logits)."""

        def hook(module, args, out):
            if self.busy:
                return None
            x = args[0]
            removed = self.removed(r, x)
            return None if removed is None else self.norm_of(module, x - removed)

        return hook

    def hooks(self) -> list:
        hf, graph = self.vlm.hf, self.graph
        out = [(hf.get_submodule(self.vlm.arch.layer(0)), "pre", self.embed)]
        mlps = [r for r in graph.receivers if isinstance(r, MlpIn)]
        for layer, paths in enumerate(graph.layers):
            out += [
                (hf.get_submodule(paths.attn_norm), "forward", self.attn_norm(layer)),
                (hf.get_submodule(paths.o_proj), "pre", self.z(layer)),
                (hf.get_submodule(paths.mlp_norm), "forward", self.reread(mlps[layer])),
                (hf.get_submodule(paths.mlp), "forward", self.mlp_out(layer)),
            ]
            if paths.qkv is not None:
                out += [
                    (hf.get_submodule(p), "forward", self.projection(layer, part))
                    for part, p in zip((Q, K, V), paths.qkv)
                ]
        out.append((hf.get_submodule(graph.final_norm), "forward", self.reread(graph.receivers[-1])))
        return out


def edge_row_bytes(w: memory.Widths, seq: int, receivers: int) -> int:
    """What one stacked row of `edge_ablated_logits` holds beyond a plain forward's: the ablation
    values and this forward's differences from them (the embeddings, every layer's z and MLP output),
    and one layer's ``receivers`` normed copies of the stream."""
    return (2 * (2 * w.n_layers + 1) + receivers) * seq * w.d_model * w.act_bytes


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


@torch.no_grad()
def edge_ablated_logits(
    vlm: VLM, graph: EdgeGraph, batch: Batch, sets: Sequence[frozenset], values: dict, image: Tensor, max_rows=None
) -> torch.Tensor:
    """Last-position logits of ``batch`` once per set of edge indices in ``sets`` (circuits × batch ×
    vocab), those edges ablated to ``values`` (a `record_nodes` recording of the same batch's shape),
    as many sets a stacked forward as memory holds."""
    n = len(batch)
    if max_rows is None:
        free = memory.model_free_bytes(vlm)
        w = memory.widths(vlm)
        seq = int(batch.inputs["input_ids"].shape[1])
        receivers = max(sum(r.layer == la for r in graph.receivers) for la in range(vlm.arch.n_layers))
        extra = edge_row_bytes(w, seq, receivers)
        max_rows = (
            memory.MAX_ROWS
            if free is None
            else memory.rows_per_forward(w, seq, free, 1, batch.patches(w.merge), extra=extra)
        )
    per_pass = max(1, max_rows // n)
    out = []
    for i in range(0, len(sets), per_pass):
        chunk = sets[i : i + per_pass]
        k = len(chunk)
        tiled = {
            "embed": torch.cat([values["embed"]] * k),
            "z": {la: torch.cat([v] * k) for la, v in values["z"].items()},
            "mlp": {la: torch.cat([v] * k) for la, v in values["mlp"].items()},
        }
        ablator = _Ablator(vlm, graph, _weights(graph, chunk, n), tiled, torch.cat([image] * k).float())
        with hooked(ablator.hooks()):
            logits = vlm.hf(**repeat_inputs(batch.inputs, k), use_cache=False, logits_to_keep=1).logits[:, -1]
        out.append(logits.float().view(k, n, -1).cpu())
    return torch.cat(out)
