"""EAP and EAP-IG: attribution scores of every edge of `countlens.circuits.graph.edges`' graph.

Patching edge u → r alone changes x_r by Δ_u = c_u(corrupt) − c_u(clean), so attribution patching
estimates its effect as Δ_u · ∂LD/∂x_r, summed over positions
(MIB sums them; ``positions`` restricts the sum to a token group). ∂LD/∂x_r is the gradient through
r alone: the norm's vector-Jacobian product at x_r of what r's projection sends back (for a head's
q, the gradient of q_proj's output at that head's columns times their weights). EAP takes the
gradient at the clean run; EAP-IG (``steps`` = m > 1) averages it over m points of the straight path
from the corrupt input to the clean one, interpolating the input of decoder layer 0 as
`countlens.circuits.graph.integrated` does for nodes. LD is the metric (`countlens.circuits.metrics`;
default the logit difference): EAP refuses one whose gradient vanishes at the clean run (``kl``), which
EAP-IG, integrating from the corrupt input, takes. Scores are normalised like the exact sweeps: divided
by Σ LD_corrupt − Σ LD_clean. Since a node's output reaches the metric only through the receivers
downstream of it, a node's score is the sum of its outgoing edges' (``node_effect``): EAP's node
scores are AtP's and EAP-IG's are `node_attribution`'s.

Memory: the gradients are kept per layer at their projections' width, as `node_attribution` keeps
them; the residual-space products are formed ``chunk`` positions at a time, so an image-heavy
prompt's cost in memory is a chunk's, not the sequence's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.engine.gradients import activation_gradients_only
from countlens.circuits.engine.metrics import Metric, logit_diff, metric_for, normalised
from countlens.circuits.engine.pair_batch import pairs_provenance, prepare_pairs
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.graph.edges import (
    EdgeGraph,
    Receiver,
    check_additive,
    edge_graph,
    node_deltas,
    receiver_columns,
    require_graph,
)
from countlens.circuits.graph.integrated import IG_STEPS
from countlens.circuits.graph.nodes import image_positions, record_nodes
from countlens.circuits.sites import AttnIn, K, MlpIn, Q, V, check_group, first_arg, group_mask, replace_first
from countlens.errors import InputError
from countlens.model.arguments import require_vlm
from countlens.validate import require_choice, require_count

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: What the residual-space products of one chunk of positions may hold (float64 node differences and
#: one layer's receiver gradients).
CHUNK_BYTES = 256 << 20


def _norm_vjp(norm: torch.nn.Module, x: Tensor, cot: Tensor) -> Tensor:
    """(receivers, …) gradients at x of norm's output paired with each cotangent in ``cot``."""
    with torch.enable_grad():
        xe = x.detach().unsqueeze(0).expand_as(cot).clone().requires_grad_(True)
        (g,) = torch.autograd.grad(norm(xe), xe, grad_outputs=cot.to(xe.dtype))
    return g


def gradient_pass(vlm: VLM, graph: EdgeGraph, batch: Batch, embed: Tensor, pb, metric: Metric | None = None) -> dict:
    """One forward and backward of ``batch`` with layer 0's input replaced by ``embed`` (a tensor shaped
    like it; a copy is taken), LD = ``metric`` (bound; None: the logit difference, logit(``pb.clean_id``) −
    logit(``pb.corrupt_id``)) at the last position summed over rows: each layer's norm inputs and the
    gradients of LD's sum at the receivers' projections, which `receiver_gradients` turns into each
    receiver's ∂LD/∂x_r. Rows do not interact, so a row's gradients are its own LD's. A metric that reads
    the clean run's logits reads ``pb.clean_logits``. Also `countlens.circuits.objects.edges`' pass."""
    metric = logit_diff() if metric is None else metric
    hf, got = vlm.hf, {"x": {}, "mid": {}, **{kind: {} for kind in (Q, K, V, AttnIn, MlpIn)}}
    leaf = embed.detach().clone().requires_grad_(True)

    def set_input(module, args, kwargs):
        return replace_first(args, kwargs, leaf)

    def keep_out(store, layer, with_input=None):
        def hook(module, args, kwargs, out):
            out.retain_grad()
            store[layer] = out
            if with_input is not None:
                with_input[layer] = args[0].detach()

        return hook

    def keep_final(module, args, kwargs):
        x = first_arg(args, kwargs)
        x.retain_grad()
        got["final"] = x

    hooks = [Hook(vlm.arch.layer(0), "before", set_input)]
    for layer, paths in enumerate(graph.layers):
        hooks.append(Hook(paths.attn_norm, "after", keep_out(got[AttnIn], layer, got["x"])))
        hooks.append(Hook(paths.mlp_norm, "after", keep_out(got[MlpIn], layer, got["mid"])))
        if paths.qkv is not None:
            for part, path in zip((Q, K, V), paths.qkv):
                hooks.append(Hook(path, "after", keep_out(got[part], layer)))
    hooks.append(Hook(graph.final_norm, "before", keep_final))
    with activation_gradients_only(hf):
        with torch.enable_grad(), hooked(hf, hooks):
            logits = vlm.hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
            metric(logits, pb).sum().backward()
    grads = {key: {la: t.grad.detach() for la, t in got[key].items()} for key in (Q, K, V, AttnIn, MlpIn)}
    return {**grads, "x": got["x"], "mid": got["mid"], "final": got["final"].grad.detach()}


def receiver_gradients(vlm: VLM, graph: EdgeGraph, layer: int, g: dict, sl: slice) -> dict[Receiver, Tensor]:
    """∂LD/∂x_r at positions ``sl`` of every receiver of ``layer`` (the logits: ``layer`` = n_layers),
    (batch, positions, d_model) each, from a `gradient_pass`."""
    if layer == vlm.arch.n_layers:
        return {graph.receivers[-1]: g["final"][:, sl]}
    paths, hf = graph.layers[layer], vlm.hf
    mine = [r for r in graph.receivers if r.layer == layer]
    cots = []
    for r in mine[:-1]:
        if isinstance(r, AttnIn):
            cots.append(g[AttnIn][layer][:, sl])
            continue
        projection = module_of(hf, paths.qkv[r.qkv])
        w = projection.weight
        cols = receiver_columns(graph, r, projection)
        grad = g[type(r)][layer]
        cots.append(grad[:, sl, cols] @ w[cols].to(grad.dtype))
    out = dict(zip(mine[:-1], _norm_vjp(module_of(hf, paths.attn_norm), g["x"][layer][:, sl], torch.stack(cots))))
    mlp_g = _norm_vjp(module_of(hf, paths.mlp_norm), g["mid"][layer][:, sl], g[MlpIn][layer][:, sl][None])
    out[mine[-1]] = mlp_g[0]
    return out


def _chunk(vlm: VLM, graph: EdgeGraph, rows: int, seq: int, chunk: int | None) -> int:
    """Positions a residual-space product covers at once: ``chunk``, or what keeps the node deltas
    and one layer's receiver gradients within `CHUNK_BYTES`."""
    if chunk is not None:
        require_count(chunk, "chunk")
        return chunk
    receivers = max(sum(r.layer == layer for r in graph.receivers) for layer in range(vlm.arch.n_layers + 1))
    # float64: the node differences (stacked, then masked: two copies) and one layer's receiver gradients
    per_position = (2 * len(graph.nodes) + receivers) * rows * vlm.arch.d_model * 8
    return max(1, min(seq, CHUNK_BYTES // per_position))


#: `edge_attribution`'s ``method`` values: EAP (the clean run's gradient) and EAP-IG (integrated).
EDGE_VARIANTS: tuple[str, ...] = ("eap", "eap-ig")


def edge_attribution(
    vlm: VLM,
    pairs: Sequence,
    method: str = "eap-ig",
    steps: int = IG_STEPS,
    positions: str = "all",
    batch_size: int = 16,
    chunk: int | None = None,
    graph: EdgeGraph | None = None,
    metric=None,
) -> xr.Dataset:
    """EAP (``method="eap"``: one gradient, the clean run's) or EAP-IG (``steps`` points) scores of
    every edge: ``effect`` over ``edge`` (with ``upstream``, ``receiver`` and ``part`` coordinates),
    and ``node_effect`` over ``node`` (the sum of a node's outgoing edges). ``positions``: the token
    group whose positions are summed ("all", "image", "text", "last"); ``graph``: the model's
    `edge_graph`, built here if not given; ``metric``: `countlens.circuits.metrics` (default the logit
    difference; EAP refuses one stationary at the clean run, such as ``kl``, which EAP-IG takes). See the
    module docstring."""
    require_choice(method, "method ('eap': the clean run's gradient; 'eap-ig': integrated)", EDGE_VARIANTS)
    return edge_attributions(vlm, pairs, (method,), steps, positions, batch_size, chunk, graph, metric)[method]


def edge_attributions(
    vlm: VLM,
    pairs: Sequence,
    methods: Sequence[str] = ("eap-ig", "eap"),
    steps: int = IG_STEPS,
    positions: str = "all",
    batch_size: int = 16,
    chunk: int | None = None,
    graph: EdgeGraph | None = None,
    metric=None,
) -> dict[str, xr.Dataset]:
    """`edge_attribution`'s result per method of ``methods``, from one pass: EAP's gradient is EAP-IG's
    last point (the clean input), so both cost EAP-IG's ``steps`` gradients, and both come from the
    same recordings, whose own forwards give the normaliser. The gradients are taken one step at a
    time; the node differences are formed once per chunk of pairs where one product covers every
    position (``chunk``), else once per step and product: keeping every step's gradients instead would
    hold about 90 GB more on LLaVA-1.5-7B at 16 pairs (MHA: 96 q / k / v heads a layer), every
    position's differences more still."""
    require_vlm(vlm, "edge_attribution")
    check_pair_sweep(pairs, batch_size, "edge_attribution")
    if not isinstance(methods, (list, tuple)) or not methods:
        raise InputError(
            f"methods must be a non-empty list of {EDGE_VARIANTS}, e.g. ('eap-ig', 'eap'); got {methods!r}"
        )
    for name in methods:
        require_choice(name, "method ('eap': the clean run's gradient; 'eap-ig': integrated)", EDGE_VARIANTS)
    require_count(steps, "steps")
    check_group(positions)
    graph = edge_graph(vlm) if graph is None else require_graph(vlm, graph)
    first_order = "eap" in methods
    who = "EAP (edge_attribution, method='eap')" if first_order else "EAP-IG (edge_attribution)"
    metric = metric_for(vlm, pairs, metric, who, moving=first_order)
    m = steps if "eap-ig" in methods else 1
    # which gradients each method averages: EAP-IG all m, EAP the last (the clean input)
    divisor = {"eap-ig": [m] * m, "eap": [0] * (m - 1) + [1]}
    offsets = graph.offsets()
    n_edges = sum(graph.prefix.values())
    scores = {method: torch.zeros(n_edges, dtype=torch.float64) for method in methods}
    clean_sum = corrupt_sum = 0.0
    differences = []  # per pair: M_corrupt − M_clean, for the normaliser's noise rule
    for start in range(0, len(pairs), batch_size):
        pb = prepare_pairs(vlm, pairs[start : start + batch_size])
        if not graph.checked:
            check_additive(vlm, graph, pb.clean)
        corrupt, clean = (record_nodes(vlm, b, graph.nodes, logits=True) for b in (pb.corrupt, pb.clean))
        pb = metric.at_clean(pb, clean["logits"])
        clean_m, corrupt_m = metric(clean["logits"], pb), metric(corrupt["logits"], pb)
        clean_sum += float(clean_m.sum())
        corrupt_sum += float(corrupt_m.sum())
        differences.append((corrupt_m.double() - clean_m.double()).cpu().numpy())
        image = image_positions(vlm, pb.clean)
        where = group_mask(pb.clean, positions)
        seq = int(where.shape[1])
        step = _chunk(vlm, graph, len(pb.clean), seq, chunk)
        cached: Tensor | None = None  # the node differences, when one product covers every position
        for k in range(1, m + 1):
            used = [(method, divisor[method][k - 1]) for method in methods if divisor[method][k - 1]]
            if not used:
                continue
            embed = corrupt["embed"] + (k / m) * (clean["embed"] - corrupt["embed"])
            g = gradient_pass(vlm, graph, pb.clean, embed, pb, metric)
            with torch.no_grad():
                for p0 in range(0, seq, step):
                    sl = slice(p0, min(seq, p0 + step))
                    delta = (
                        cached if cached is not None else _masked_deltas(vlm, graph, corrupt, clean, image, where, sl)
                    )
                    if step >= seq:
                        cached = delta
                    for layer in range(vlm.arch.n_layers + 1):
                        by_prefix: dict[int, list] = {}  # receivers reading the same nodes: one product
                        for r, gr in receiver_gradients(vlm, graph, layer, g, sl).items():
                            by_prefix.setdefault(graph.prefix[r], []).append((r, gr))
                        for p, group in by_prefix.items():
                            grads_r = torch.stack([gr for _, gr in group]).double()
                            got = torch.einsum("ubsd,rbsd->ru", delta[:p], grads_r).cpu()
                            for (r, _), row in zip(group, got):
                                for method, wt in used:
                                    scores[method][offsets[r] : offsets[r] + p] += row / wt
            del g
    denom, attrs = normalised(clean_sum, corrupt_sum, differences, metric)
    return {
        method: _result(
            vlm, pairs, graph, (scores[method] / denom).numpy(), method, 1 if method == "eap" else m, positions, attrs
        )
        for method in methods
    }


def _masked_deltas(vlm: VLM, graph: EdgeGraph, corrupt: dict, clean: dict, image, where, sl: slice) -> Tensor:
    """Every node's corrupt − clean difference at positions ``sl`` in float64, zero outside ``where``."""
    delta = node_deltas(vlm, graph, corrupt, clean, image, sl).double()
    return delta * where[None, :, sl, None].to(delta.device)


def _result(
    vlm: VLM, pairs, graph: EdgeGraph, effect: np.ndarray, method: str, steps: int, positions: str, attrs: dict
) -> xr.Dataset:
    edges = graph.edges
    node_effect = np.zeros(len(graph.nodes))
    index = {u: i for i, u in enumerate(graph.nodes)}
    for (u, _), e in zip(edges, effect):
        node_effect[index[u]] += e
    return xr.Dataset(
        {"effect": ("edge", effect), "node_effect": ("node", node_effect)},
        coords={
            "edge": graph.labels(),
            "upstream": ("edge", [u.label for u, _ in edges]),
            "receiver": ("edge", [r.label for _, r in edges]),
            "part": ("edge", [r.part_name for _, r in edges]),
            "node": [u.label for u in graph.nodes],
        },
        attrs={**pairs_provenance(vlm, pairs, **attrs), "method": method, "steps": steps, "positions": positions},
    )
