"""Edges: the computational graph between nodes.

A decoder layer of a pre-norm transformer adds its attention output and its MLP output to the
residual stream, and the attention output is the sum of its heads' contributions z_h·W_O[h]ᵀ. So
what any component reads is a sum over everything upstream of it: the input embeddings, each earlier
head's contribution and each earlier MLP's output (o_proj's bias, where there is one, is the same in
every run and drops out of every difference). An **edge** u → r is one term of that sum: upstream node
u (a node of `countlens.circuits.graph.faithfulness`: ``IN.image``, ``IN.text``, a head, an MLP) to the input
of a **receiver** r, itself a site (`countlens.circuits.sites`: `Q`, `K`, `V`, `AttnIn`, `MlpIn`, `Logits`):

- a head's query (``L2H1.q``), and a key / value head's key and value (``L2K0.k``, ``L2K0.v``;
  with grouped-query attention a kv head serves several query heads) where the layer projects q, k
  and v with separate linear maps;
- the whole attention block's input (``L2.attn``) where it does not (a fused qkv projection, a
  linear-attention layer);
- an MLP's input (``MLP2.in``; the heads of its own layer are upstream of it) and the logits
  (``logits``: the final norm's input).

A receiver reads norm(x_r), x_r its own copy of the residual stream. Keeping or ablating an edge
decides which version of u's output that copy holds.

`countlens.circuits.graph.edge_attribution` scores edges (EAP, EAP-IG); `countlens.circuits.graph.edge_ablation`
runs circuits of edges for `countlens.circuits.graph.faithfulness`.

Supported: models whose layers add exactly their attention output and MLP output to the residual
stream, and nothing enters between layers. `edge_graph` refuses gated cross-attention layers and
layers without the two pre-norms; `check_additive` then checks the rest element by element on the
first batch and refuses, naming the layer and why (Gemma's norms after attention and MLP, Qwen3-VL's
DeepStack); their nodes remain (`countlens.circuits.graph.faithfulness`).

Countlens calls the layers' own norm modules (and the projections' weights) on its copies of the
residual stream inside the forward, which nnsight's trace does not allow: edges run on plain torch
hooks, as `countlens.circuits.methods.atp_star` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.engine import Hook, hooked, module_of
from countlens.circuits.graph.nodes import Node, graph_nodes
from countlens.circuits.sites import (
    INPUTS,
    AttnIn,
    K,
    Logits,
    MlpIn,
    Q,
    V,
    first_output,
    heads_view,
)
from countlens.errors import InputError
from countlens.model.arguments import require_batch, require_vlm

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: A receiver: the input of one downstream component, a site — a head's query `Q`, a key-value head's
#: key `K` and value `V`, a whole attention block `AttnIn`, an MLP `MlpIn`, the `Logits`. Its ``block``
#: orders a layer's receivers (attention 0, MLP 1), its ``part_name`` names its kind in results.
Receiver = Q | K | V | AttnIn | MlpIn | Logits
RECEIVERS: tuple[type, ...] = (Q, K, V, AttnIn, MlpIn, Logits)


@dataclass(frozen=True)
class LayerPaths:
    """Where one decoder layer keeps what edges read and write."""

    attn_norm: str
    mlp_norm: str
    o_proj: str
    mlp: str
    qkv: tuple[str, str, str] | None  # q_proj, k_proj, v_proj; None: the block is one receiver


@dataclass
class EdgeGraph:
    """Nodes (upstream), receivers and edges of a model. Every receiver reads a prefix of ``nodes``
    (in forward order): ``prefix[r]`` nodes."""

    nodes: list[Node]
    receivers: list[Receiver]
    prefix: dict[Receiver, int]
    layers: list[LayerPaths]
    final_norm: str
    kv_heads: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    model: int = 0  # id() of the HF model it was built from
    checked: bool = False  # `check_additive` has passed on this model

    @property
    def edges(self) -> list[tuple[Node, Receiver]]:
        return [(u, r) for r in self.receivers for u in self.nodes[: self.prefix[r]]]

    def labels(self) -> list[str]:
        return [f"{u.label}→{r.label}" for u, r in self.edges]

    @property
    def starts(self) -> list[int]:
        """Where each layer's heads start in ``nodes`` (its MLP follows them)."""
        return list(accumulate((h + 1 for h in self.heads[:-1]), initial=len(INPUTS)))

    def offsets(self) -> dict[Receiver, int]:
        """Where each receiver's edges start in `edges`."""
        out, at = {}, 0
        for r in self.receivers:
            out[r] = at
            at += self.prefix[r]
        return out


def receiver_columns(graph: EdgeGraph, r: Receiver, module: torch.nn.Module) -> slice:
    """The columns of r's projection output that belong to r: its head's (a query head's, or a kv
    head's for keys and values). A projection wider than heads × head size (Qwen3.5's full-attention
    q_proj, each head's query then its output gate) gives each head its whole block."""
    count = graph.heads[r.layer] if isinstance(r, Q) else graph.kv_heads[r.layer]
    width = module.out_features // count
    return slice(r.head * width, (r.head + 1) * width)


def _module(vlm: VLM, path: str) -> torch.nn.Module | None:
    return module_of(vlm.hf, path, missing_ok=True)


def edge_graph(vlm: VLM) -> EdgeGraph:
    """The model's edge graph (see the module docstring); refuses a model whose layers are not
    pre-norm blocks with the two norms edges read."""
    require_vlm(vlm, "edge_graph")
    arch = vlm.arch
    if arch.cross_layers:
        raise InputError(
            f"{vlm.name} has gated cross-attention layers {list(arch.cross_layers)}: their output is not a sum of "
            "heads added to the residual stream, so edges are undefined; use nodes "
            "(countlens.circuits.graph.faithfulness)"
        )
    nodes = graph_nodes(vlm)
    receivers, prefix, layers, kv = [], {}, [], []
    seen = len(INPUTS)
    for layer in range(arch.n_layers):
        norms = [arch.attn_norm(layer), arch.mlp_norm(layer)]
        missing = [p for p in norms if _module(vlm, p) is None]
        if missing:
            raise InputError(
                f"layer {layer} of {vlm.name} has no {missing[0].rsplit('.', 1)[-1]}: edges need a pre-norm layer "
                "(a norm before attention, one before the MLP); use nodes (countlens.circuits.graph.faithfulness)"
            )
        q, k, v = arch.q_proj(layer), arch.k_proj(layer), arch.v_proj(layer)
        separate = arch.softmax(layer) and not arch.spec.fused_qkv and all(_module(vlm, p) for p in (q, k, v))
        heads = arch.heads(layer)
        n_kv = _module(vlm, k).out_features // arch.head_dim(layer) if separate else 0
        kv.append(n_kv)
        if separate:
            mine = [Q(layer, h) for h in range(heads)]
            mine += [part(layer, j) for part in (K, V) for j in range(n_kv)]
        else:
            mine = [AttnIn(layer)]
        for r in mine:
            prefix[r] = seen
        seen += heads
        mlp = MlpIn(layer)
        prefix[mlp] = seen
        seen += 1
        receivers += [*mine, mlp]
        layers.append(LayerPaths(*norms, arch.o_proj(layer), arch.mlp(layer), (q, k, v) if separate else None))
    logits = Logits(arch.n_layers)
    prefix[logits] = seen
    receivers.append(logits)
    return EdgeGraph(
        nodes,
        receivers,
        prefix,
        layers,
        arch.final_norm,
        kv,
        [arch.heads(i) for i in range(arch.n_layers)],
        model=id(vlm.hf),
    )


def refusal(vlm: VLM) -> str | None:
    """Why ``vlm``'s edges are undefined (`edge_graph`'s refusal), or None: the edge methods' refusal."""
    try:
        edge_graph(vlm)
    except InputError as err:
        return str(err)
    return None


def require_graph(vlm: VLM, graph: object) -> EdgeGraph:
    """``graph`` if it is ``vlm``'s `edge_graph` (built once per stage and handed to each step)."""
    if not isinstance(graph, EdgeGraph):
        raise InputError(f"graph must be edge_graph(vlm)'s result, not {type(graph).__name__}")
    if graph.model != id(vlm.hf):
        raise InputError(f"this edge graph was built for another model than {vlm.name}: give edge_graph(vlm)")
    return graph


def checked_graph(vlm: VLM, batch: Batch) -> EdgeGraph:
    """`edge_graph` with `check_additive` passed on ``batch``: what a stage builds once and hands down."""
    require_batch(batch, "checked_graph")
    graph = edge_graph(vlm)
    check_additive(vlm, graph, batch)
    return graph


def stream_shaped(t: Tensor, like: Tensor) -> Tensor:
    """A module output in the residual stream's shape: Llama 4's MoE block returns its tokens
    flattened, (rows · seq, d)."""
    return t.view(like.shape) if t.ndim == 2 and like.ndim == 3 and t.numel() == like.numel() else t


def check_additive(vlm: VLM, graph: EdgeGraph, batch: Batch) -> None:
    """Refuse the model unless each layer's output is its input plus its attention output plus its
    MLP output, and each layer reads the previous one's output (one forward of ``batch``). Checked
    element by element as each layer ends (a few roundings of the three terms' sizes), so only one
    layer's tensors are held."""
    seen, bad = {}, []

    def keep(name):
        def hook(module, args, kwargs, out):
            seen[name] = (args[0] if args else None, first_output(out))

        return hook

    def check(layer):
        def hook(module, args, kwargs, out):
            x, o, m = seen.pop("x")[0], seen.pop("o")[1], seen.pop("mlp")[1]
            out = first_output(out)
            m = stream_shaped(m, x)
            if o.shape != x.shape or m.shape != x.shape:
                bad.append(
                    f"its attention or MLP output is shaped {tuple(o.shape)}, {tuple(m.shape)}, not like the stream"
                )
            elif _off(x + o + m, out, (x.abs() + o.abs() + m.abs())):
                bad.append("it does not add its attention and MLP outputs to the residual stream unchanged")
            elif "out" in seen and _off(x, seen["out"], x.abs()):
                bad.append("it does not read the previous layer's output (inputs are added between layers)")
            seen["out"] = out
            if bad and not isinstance(bad[-1], tuple):
                bad[-1] = (layer, bad[-1])

        return hook

    def final(module, args, kwargs, out):
        if _off(args[0], seen["out"], args[0].abs()):
            bad.append((vlm.arch.n_layers, "the final norm does not read the last layer's output"))

    hooks = []
    for layer, paths in enumerate(graph.layers):
        hooks += [
            Hook(paths.attn_norm, "after", keep("x")),
            Hook(paths.o_proj, "after", keep("o")),
            Hook(paths.mlp, "after", keep("mlp")),
            Hook(vlm.arch.layer(layer), "after", check(layer)),
        ]
    hooks.append(Hook(graph.final_norm, "after", final))
    with torch.no_grad(), hooked(vlm.hf, hooks):
        vlm.forward(batch, use_cache=False, logits_to_keep=1)
    if bad:
        layer, why = bad[0]
        raise InputError(
            f"{vlm.name}'s layer {layer}: {why} (a norm after attention or the MLP, or image features added "
            "between layers): edges are undefined here; use nodes (countlens.circuits.graph.faithfulness)"
        )
    graph.checked = True


def _off(a: Tensor, b: Tensor, size: Tensor) -> bool:
    """Whether a and b differ anywhere by more than a few roundings of ``size`` there."""
    eps = torch.finfo(a.dtype).eps
    return bool(((a - b).abs() > 4 * eps * size + torch.finfo(a.dtype).tiny).any())


def o_weight(vlm: VLM, paths: LayerPaths, heads: int) -> Tensor:
    """o_proj's weight per head: (heads, d_model, d_head)."""
    w = module_of(vlm.hf, paths.o_proj).weight
    return w.view(w.shape[0], heads, -1).permute(1, 0, 2)


def node_deltas(vlm: VLM, graph: EdgeGraph, a: dict, b: dict, image: Tensor, sl: slice) -> Tensor:
    """Residual-space a − b of every node at positions ``sl`` (recordings of `record_nodes`): (nodes,
    batch, positions, d_model), in graph order."""
    arch = vlm.arch
    d = (a["embed"] - b["embed"])[:, sl]
    img = image[:, sl, None].to(d.dtype)
    out = [d * img, d * (1 - img)]
    for layer, paths in enumerate(graph.layers):
        heads = arch.heads(layer)
        dz = heads_view((a["z"][layer] - b["z"][layer])[:, sl], heads)
        out += list(torch.einsum("bshd,hod->hbso", dz, o_weight(vlm, paths, heads).to(dz.dtype)))
        out.append(stream_shaped(a["mlp"][layer] - b["mlp"][layer], a["embed"])[:, sl])
    return torch.stack(out)
