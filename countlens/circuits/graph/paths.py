"""Path patching and edge sets: the exact metric of chosen edges, on the edge engine.

An edge u → r (`countlens.circuits.graph.edges`) is one term of what receiver r reads: node u's
output (a head, an MLP, an input part) in r's own copy of the residual stream. Corrupting a set of
edges is one forward of the clean input in which each receiver's copy holds the corrupt run's output
of its corrupted edges' nodes (`countlens.circuits.graph.edge_ablation.edge_ablated_logits`, with the
pair's corrupt run as the ablation values: counterfactual patching). Three primitives name the set:

- ``path_patch(vlm, pairs, senders, receivers)``: the senders' corrupt outputs reach only the named
  receivers (a head's query, a key-value head's key or value, an MLP's input, the logits; a whole
  attention block where q, k and v are one projection), everything else reads them clean. The
  corrupted set is every edge sender → receiver, so the figure equals `edge_ablated_logits` with
  exactly those edges. What the receivers then compute flows on to every later component as usual (the
  path patching of Wang et al. 2022, where the receivers' changed outputs reach the logits).
- ``ablate_edges(vlm, pairs, edges)``: those edges corrupted, every other edge clean. Every edge
  ablated is the corrupt run; none, the clean run.
- ``keep_edges(vlm, pairs, edges)``: every edge *but* those corrupted: a circuit kept, measured exactly
  (no ranking, no size as in `countlens.circuits.graph.faithfulness`). Every edge kept is the clean run;
  1 − its ``effect`` is the circuit's faithfulness to the clean run.

Each returns the normalised change of the metric M (`countlens.circuits.engine.metrics`; default the
logit difference), as `countlens.circuits.effect` gives it:

    effect = (Σ M_edited − Σ M_clean) / (Σ M_corrupt − Σ M_clean)

over the pairs (the normaliser refused below the noise rule, `countlens.circuits.engine.pair_batch`),
with ``overwrite`` (the share of pairs whose edited arg-max is the corrupt answer) and, per pair, the
metric (named after it: ``logit_diff``), ``to_corrupt``, and the clean and corrupt runs' metric.
Provenance names the metric, the senders and receivers (or the edges) and the pairs.

Senders are nodes: a label (``"L0H1"``, ``"MLP2"``, ``"IN.image"``), a site (``HeadZ(0, 1)``,
``MlpOut(2)``, ``Embed("image")``) or a (layer, head) pair. Receivers are edge receivers: a label
(``"L3H1.q"``, ``"L3K0.k"``, ``"L3K0.v"``, ``"MLP3.in"``, ``"L3.attn"``, ``"logits"``) or a site
(``Q(3, 1)``, ``K(3, 0)``, ``V(3, 0)``, ``MlpIn(3)``, ``AttnIn(3)``, ``Logits(n_layers)``). An edge is
its label (``"L0H1→L3H1.q"``, `countlens.labels.edge_label`; `edge_graph(vlm).labels()` lists them) or a
(sender, receiver) pair of those. Every refusal comes before any forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.metrics import Metric, metric_for, normalised
from countlens.circuits.engine.pair_batch import batch_pairs, pairs_provenance
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.graph.edge_ablation import edge_ablated_logits
from countlens.circuits.graph.edges import RECEIVERS, EdgeGraph, Receiver, check_additive, edge_graph, require_graph
from countlens.circuits.graph.nodes import NODE_SITES, Node, image_positions, record_nodes
from countlens.errors import InputError
from countlens.labels import edge_key, edge_label, head_key, head_label, is_head_pair
from countlens.model.arguments import require_vlm

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

SENDER_FORMS = "a node: a label ('L0H1', 'MLP2', 'IN.image'), a site (HeadZ, MlpOut, Embed) or a (layer, head) pair"
RECEIVER_FORMS = (
    "an edge receiver: a label ('L3H1.q', 'L3K0.k', 'L3K0.v', 'MLP3.in', 'L3.attn', 'logits') or a site "
    "(Q, K, V, MlpIn, AttnIn, Logits)"
)


# ----------------------------------------------------------------------------- the edges named


#: An example of each argument, for the refusals.
EXAMPLES = {"senders": "['L0H0']", "receivers": "['L1H0.q', 'MLP1.in']", "edges": "['L0H0→L1H0.q']"}


def _items(value, what: str) -> list:
    """``value`` as a list: one item given alone (a string, a site, a (layer, head) pair) or a collection
    of them; an empty one is refused."""
    if isinstance(value, str) or hasattr(value, "label") or is_head_pair(value):
        return [value]
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable) or hasattr(value, "dims"):
        raise InputError(f"{what}: give a list, not {type(value).__name__} {value!r:.60}")
    items = list(value)
    if not items:
        raise InputError(f"{what} is empty: give at least one, e.g. {what}={EXAMPLES[what]} (edge_graph(vlm).labels())")
    return items


def _unique(items: list, what: str) -> list:
    seen = set()
    for item in items:
        if item in seen:
            label = getattr(item, "label", item)
            raise InputError(f"{what} names {label} more than once; give each once")
        seen.add(item)
    return items


def sender_node(graph: EdgeGraph, sender) -> Node:
    """``sender`` as one of ``graph``'s nodes (`SENDER_FORMS`); anything else refused by name."""
    nodes = {n.label: n for n in graph.nodes}
    receivers = {r.label for r in graph.receivers}
    label = None
    if isinstance(sender, str):
        label = sender.strip()
        if label in receivers:
            raise InputError(
                f"sender {sender!r} is a receiver (a component's input), not a node: give the node whose output "
                f"is sent, e.g. {label.split('.')[0]!r} for a head's output"
            )
    elif is_head_pair(sender):
        label = head_label(head_key(sender))
    elif isinstance(sender, tuple(NODE_SITES.values())):
        label = sender.label
    elif isinstance(sender, RECEIVERS):
        raise InputError(
            f"sender {sender!r} is a receiver site (a component's input), which cannot send; senders are nodes: "
            f"give {SENDER_FORMS}"
        )
    else:
        raise InputError(f"sender {sender!r:.60} cannot send: give {SENDER_FORMS}")
    if label not in nodes:
        raise InputError(
            f"sender {label!r} is no node of this model's edge graph (an expert, a layer or head it lacks?); give "
            f"{SENDER_FORMS}, one of edge_graph(vlm).nodes"
        )
    return nodes[label]


def receiver_site(graph: EdgeGraph, receiver) -> Receiver:
    """``receiver`` as one of ``graph``'s receivers (`RECEIVER_FORMS`); anything else refused by name."""
    by_label = {r.label: r for r in graph.receivers}
    if isinstance(receiver, str):
        label = receiver.strip()
        if label in {n.label for n in graph.nodes}:
            raise InputError(
                f"receiver {receiver!r} is a node (a component's output), which cannot receive: give its input, "
                f"{RECEIVER_FORMS}"
            )
    elif isinstance(receiver, RECEIVERS):
        label = receiver.label
        if by_label.get(label) != receiver:
            label = None
    else:
        raise InputError(
            f"receiver {receiver!r:.60}: a {type(receiver).__name__} cannot receive an edge; give {RECEIVER_FORMS}"
        )
    if label not in by_label:
        attn = sorted({r.label for r in graph.receivers if r.block == 0 and r.label != "logits"})[:3]
        raise InputError(
            f"receiver {receiver!r:.60} is no receiver of this model's edge graph (a layer or head it lacks, or q, "
            f"k, v where its layer projects them as one: then the block's input 'L<layer>.attn'); its attention "
            f"receivers look like {attn}: see [r.label for r in edge_graph(vlm).receivers]"
        )
    return by_label[label]


def _edge_index(graph: EdgeGraph, u: Node, r: Receiver, index: dict) -> int:
    """The index of u → r in ``graph.edges``; refused where r reads the stream before u writes to it."""
    i = graph.nodes.index(u)
    if i >= graph.prefix[r]:
        raise InputError(
            f"{edge_label(u.label, r.label)} is no edge: receiver {r.label} reads the residual stream before "
            f"{u.label} writes to it (it is upstream of, or at, {u.label}'s layer; only an MLP's input reads its "
            "own layer's heads). Give receivers downstream of every sender"
        )
    return index[(u, r)]


def _one_pair(edges) -> bool:
    """Whether ``edges`` is one (sender, receiver) pair, not a collection of two edges: its first item
    is a sender (a site, a (layer, head) pair, a label without an arrow)."""
    if not (isinstance(edges, tuple) and len(edges) == 2):
        return False
    first = edges[0]
    return hasattr(first, "label") or is_head_pair(first) or (isinstance(first, str) and "→" not in first)


def _indices(graph: EdgeGraph) -> dict:
    return {edge: i for i, edge in enumerate(graph.edges)}


def path_edges(graph: EdgeGraph, senders, receivers) -> tuple[list[Node], list[Receiver], list[int]]:
    """(senders as nodes, receivers, indices of every edge sender → receiver in ``graph.edges``);
    refused where a set is empty, an item is no node / receiver, or a receiver is upstream of (or at) a
    sender's layer."""
    nodes = _unique([sender_node(graph, s) for s in _items(senders, "senders")], "senders")
    into = _unique([receiver_site(graph, r) for r in _items(receivers, "receivers")], "receivers")
    index = _indices(graph)
    return nodes, into, [_edge_index(graph, u, r, index) for u in nodes for r in into]


def edge_indices(graph: EdgeGraph, edges) -> list[int]:
    """Indices in ``graph.edges`` of ``edges``: edge labels (``"L0H1→L3H1.q"``) or (sender, receiver)
    pairs, each side a label or a site; one edge may be given alone. Refused: an empty set, an edge
    given twice, an edge not in the graph (named, with the graph's labels to choose from)."""
    items = [edges] if isinstance(edges, str) or _one_pair(edges) else _items(edges, "edges")
    index, out = _indices(graph), []
    for edge in items:
        if isinstance(edge, str):
            sender, receiver = edge_key(edge)
        elif isinstance(edge, tuple) and len(edge) == 2 and not is_head_pair(edge):
            sender, receiver = edge
        else:
            raise InputError(
                f"edge {edge!r:.60}: give an edge label, e.g. 'L0H1→L3H1.q' (edge_graph(vlm).labels()), or a "
                "(sender, receiver) pair, e.g. ('L0H1', Q(3, 1))"
            )
        try:
            i = _edge_index(graph, sender_node(graph, sender), receiver_site(graph, receiver), index)
        except InputError as err:
            raise InputError(f"edge {edge!r:.60} is not in this model's edge graph: {err}") from None
        if i in out:
            raise InputError(f"edges names {graph.labels()[i]} more than once; give each edge once")
        out.append(i)
    return out


# ----------------------------------------------------------------------------- the measurement


def _door(vlm: VLM, pairs: Sequence, batch_size: int, graph, method: str) -> EdgeGraph:
    require_vlm(vlm, method)
    check_pair_sweep(pairs, batch_size, method)
    return edge_graph(vlm) if graph is None else require_graph(vlm, graph)


def corrupted_metric(
    vlm: VLM, pairs: Sequence, graph: EdgeGraph, ablated: frozenset, metric: Metric, batch_size: int, **attrs
) -> xr.Dataset:
    """The pairs' clean run with the edges ``ablated`` (indices in ``graph.edges``) carrying the corrupt
    run's values, read through ``metric`` (bound, checked at the door): ``effect``, ``overwrite`` and
    the per-pair values (see the module docstring); ``attrs`` go into provenance."""
    name = metric.name
    rows: dict[str, list] = {k: [] for k in (name, "to_corrupt", f"clean_{name}", f"corrupt_{name}", "clean_correct")}
    for start in range(0, len(pairs), batch_size):
        pb = batch_pairs(vlm, pairs[start : start + batch_size])
        if not graph.checked:
            check_additive(vlm, graph, pb.clean)
        values = record_nodes(vlm, pb.corrupt, graph.nodes, logits=True)  # the corrupt run's logits too
        # The clean run (no edge corrupted) stacked with the edited one: one vision tower for both.
        image = image_positions(vlm, pb.clean)
        clean, edited = edge_ablated_logits(vlm, graph, pb.clean, [frozenset(), ablated], values, image)
        corrupt = values.pop("logits").cpu()
        del values
        pb = metric.at_clean(pb, clean)
        rows[name].append(metric(edited, pb).float())
        rows["to_corrupt"].append(edited.argmax(-1) == pb.corrupt_id)
        rows[f"clean_{name}"].append(metric(clean, pb).float())
        rows[f"corrupt_{name}"].append(metric(corrupt, pb).float())
        rows["clean_correct"].append(clean.argmax(-1) == pb.clean_id)
    per = {k: torch.cat(v).numpy() for k, v in rows.items()}
    m, m_clean, m_corrupt = (per[k].astype(np.float64) for k in (name, f"clean_{name}", f"corrupt_{name}"))
    differences = m_corrupt - m_clean
    denom, noted = normalised(m_clean.sum(), m_corrupt.sum(), differences, metric)
    ds = xr.Dataset(
        {
            "effect": ((), (m.sum() - m_clean.sum()) / denom + 0.0),  # + 0.0: no "-0.0" where nothing changes
            "overwrite": ((), float(per["to_corrupt"].mean())),
            **{k: ("pair", v) for k, v in per.items()},
        },
        coords={"pair": np.arange(len(pairs))},
    )
    ds.attrs.update(
        pairs_provenance(vlm, pairs, **noted, **attrs),
        edges_corrupted=len(ablated),
        edges_in_graph=len(graph.edges),
    )
    return ds


def path_patch(
    vlm: VLM, pairs: Sequence, senders, receivers, metric=None, batch_size: int = 16, graph: EdgeGraph | None = None
) -> xr.Dataset:
    """The senders' corrupt outputs reaching only ``receivers``, everything else clean: the metric's
    normalised change ``effect`` (and per pair) with every edge sender → receiver corrupted, equal to
    `edge_ablated_logits` of exactly those edges. ``senders``: nodes, ``receivers``: edge receivers
    (one alone, or a list; see the module docstring). ``graph``: the model's `edge_graph`, if built
    already. Refused before any forward: an empty set, a site that cannot send or receive, a receiver
    upstream of (or at) a sender's layer."""
    graph = _door(vlm, pairs, batch_size, graph, "path_patch")
    nodes, into, ablated = path_edges(graph, senders, receivers)
    metric = metric_for(vlm, pairs, metric, "path_patch")
    return corrupted_metric(
        vlm,
        pairs,
        graph,
        frozenset(ablated),
        metric,
        batch_size,
        method="path_patch",
        senders=[n.label for n in nodes],
        receivers=[r.label for r in into],
    )


def ablate_edges(
    vlm: VLM, pairs: Sequence, edges, metric=None, batch_size: int = 16, graph: EdgeGraph | None = None
) -> xr.Dataset:
    """The exact metric with ``edges`` corrupted (the corrupt run's values in their receivers' copies of
    the stream) and every other edge clean: ``effect`` (0: nothing changes; every edge corrupted is the
    corrupt run, 1) and per pair. ``edges``: labels (``"L0H1→L3H1.q"``) or (sender, receiver) pairs."""
    graph = _door(vlm, pairs, batch_size, graph, "ablate_edges")
    chosen = edge_indices(graph, edges)
    metric = metric_for(vlm, pairs, metric, "ablate_edges")
    labels = graph.labels()
    shown = [labels[i] for i in chosen]
    return corrupted_metric(
        vlm, pairs, graph, frozenset(chosen), metric, batch_size, method="ablate_edges", edges=shown
    )


def keep_edges(
    vlm: VLM, pairs: Sequence, edges, metric=None, batch_size: int = 16, graph: EdgeGraph | None = None
) -> xr.Dataset:
    """The exact metric with only ``edges`` clean, every other edge corrupted: a circuit of edges kept.
    ``effect`` is 0 with every edge kept (the clean run) and 1 − ``effect`` the circuit's faithfulness
    to the clean run; per pair too. ``edges``: labels (``"L0H1→L3H1.q"``) or (sender, receiver) pairs."""
    graph = _door(vlm, pairs, batch_size, graph, "keep_edges")
    chosen = edge_indices(graph, edges)
    metric = metric_for(vlm, pairs, metric, "keep_edges")
    labels = graph.labels()
    ablated = frozenset(range(len(graph.edges))) - set(chosen)
    return corrupted_metric(
        vlm, pairs, graph, ablated, metric, batch_size, method="keep_edges", edges=[labels[i] for i in chosen]
    )
