"""Pruning an attribution graph to the nodes and edges that carry most of the influence on its logits,
and the graph's predicted effects of removing a feature.

**Influence** (circuit-tracer's definition). With ``A`` the adjacency (rows targets, columns sources),
``Â = |A| / rowsum(|A|)`` (each row's absolute edges as shares; a row sum below 1e-10 counts as 1e-10)
and ``w`` the logit nodes' probabilities (0 on other nodes), a node's influence is
``(w @ (Â + Â² + Â³ + …))[node]``: the probability-weighted share of the logits' direct inputs that
flows through it along paths of any length. Edges only run from earlier layers (or positions) to
later ones, so the series ends (``Â`` is nilpotent); `influence` stops when a term is exactly zero,
after at most 1000 terms.

**Pruning** (`prune`, as circuit-tracer's ``prune_graph``):

1. Node influence as above. Features and errors are kept while their influence is within the top
   ``node_threshold`` share: sort influence descending, cumulative sum over total, the threshold is
   the score at ``searchsorted(cumulative, node_threshold)`` and nodes scoring at least that stay.
   Embeddings and logits always stay.
2. The adjacency restricted to kept nodes is renormalised (``Â'``), influence recomputed on it and
   the logits' own weights added (``i' = w @ (Â' + Â'² + …) + w``); an edge's score is
   ``Â'[t, s] · i'[t]``, and edges are kept while within the top ``edge_threshold`` share (the same
   cumulative rule over all entries).
3. Repeatedly, feature and error nodes with no kept outgoing edge, and features with no kept incoming
   edge, are dropped (with their edges), until nothing changes.
4. Each node's ``influence`` field is its **cumulative share** at its rank in step 1's order (the
   share of total influence carried by it and every node above it): small for the most influential.

**Predicted removal effects** (`removal_effects`). Removing feature f (activation a_f) changes each
target's value directly by ``−A[t, f]``; a feature target t then changes its activation by as much
(TopK / ReLU are the identity on active features), so t's own out-edges scale by ``1 + Δ_t / a_t``.
With ``N[t, s] = A[t, s] / a_s`` for feature sources, the change of a logit L is
``−a_f · (r_1 + r_2 + …)[f]``, ``r_1 = N[L]`` and ``r_{k+1} = r_k @ N``: the total (direct and
indirect) effect along every path, in the graph's linear world.
"""

from __future__ import annotations

import torch

from countlens.errors import InputError
from countlens.features.graph import AttributionGraph
from countlens.features.influence import MAX_ITERATIONS, influence, normalized
from countlens.validate import require_integer, require_share


def logit_weights(graph: AttributionGraph) -> torch.Tensor:
    """(n,) the logit nodes' probabilities, 0 elsewhere."""
    w = torch.zeros(graph.n_nodes)
    w[graph.start("logit") :] = graph.logit_probs.float()
    return w


def node_influence(graph: AttributionGraph) -> torch.Tensor:
    """(n,) each node's influence on the logits, ``w @ (Â + Â² + …)``."""
    if not isinstance(graph, AttributionGraph):
        raise InputError(f"node_influence takes an AttributionGraph (attribution_graph(...)), got {graph!r:.60}")
    return influence(normalized(graph.adjacency), logit_weights(graph))


def cumulative_share(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's cumulative share of the total at its rank (scores sorted descending)."""
    ordered, index = scores.sort(descending=True)
    out = torch.zeros_like(scores)
    out[index] = ordered.cumsum(0) / ordered.sum().clamp_min(1e-30)
    return out


def threshold_of(scores: torch.Tensor, share: float) -> torch.Tensor:
    """The score at which the top scores reach ``share`` of the total (circuit-tracer's ``find_threshold``)."""
    ordered = scores.flatten().sort(descending=True).values
    cumulative = ordered.cumsum(0) / ordered.sum().clamp_min(1e-30)
    index = min(int(torch.searchsorted(cumulative, torch.tensor(share, dtype=cumulative.dtype))), len(ordered) - 1)
    return ordered[index]


def prune(graph: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
    """The graph pruned by influence (see the module's docstring): the kept nodes, their kept edges,
    and each node's ``influence`` (cumulative share at its rank); the thresholds are recorded."""
    if not isinstance(graph, AttributionGraph):
        raise InputError(f"prune takes an AttributionGraph (attribution_graph(...)), got {type(graph).__name__}")
    if graph.node_threshold is not None:
        raise InputError("this graph is already pruned; prune the graph attribution_graph returned")
    require_share(node_threshold, "node_threshold", above_zero=True)
    require_share(edge_threshold, "edge_threshold", above_zero=True)
    n_f, n_kept_always = graph.n_features, graph.start("embedding")
    w = logit_weights(graph)
    scores = influence(normalized(graph.adjacency), w)
    node_mask = scores >= threshold_of(scores, node_threshold)
    node_mask[n_kept_always:] = True

    pruned = graph.adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    a = normalized(pruned)
    edge_scores = a * (influence(a, w) + w)[:, None]
    edge_mask = edge_scores >= threshold_of(edge_scores, edge_threshold)
    edge_mask &= pruned != 0

    while True:
        before = node_mask.clone()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:n_kept_always] &= edge_mask[:, :n_kept_always].any(0)
        node_mask[:n_f] &= edge_mask[:n_f].any(1)
        if torch.equal(before, node_mask):
            break
    out = graph.select(node_mask, graph.adjacency * edge_mask)
    out.influence = cumulative_share(scores)[node_mask]
    out.node_threshold, out.edge_threshold = float(node_threshold), float(edge_threshold)
    return out


def removal_effects(graph: AttributionGraph, logit: int | None = None) -> torch.Tensor:
    """(n_features,) the graph's predicted change of logit node ``logit``'s value (default: the most
    probable) when each feature is zero-ablated, direct and indirect (see the module's docstring)."""
    if not isinstance(graph, AttributionGraph):
        raise InputError(f"removal_effects takes an AttributionGraph, got {type(graph).__name__}")
    if logit is not None:
        require_integer(logit, "logit (a vocab id of one of the graph's logit nodes, or None)", low=0)
    row = graph.logit_node(logit)
    n_f = graph.n_features
    acts = graph.activations.float()
    per_unit = graph.adjacency[:n_f, :n_f] / acts.clamp_min(1e-30)  # N over feature targets and sources
    current = graph.adjacency[row, :n_f] / acts.clamp_min(1e-30)
    total = current.clone()
    for _ in range(MAX_ITERATIONS):
        current = current @ per_unit
        if not current.any():
            return -acts * total
        total += current
    raise InputError("removal_effects: the feature adjacency has a cycle; build the graph with attribution_graph")
