"""Influence on the logits in an attribution graph: the normalised adjacency and its power series.

circuit-tracer ranks nodes by how much of the logits' weight reaches them along every path:
``Â = |A| / rowsum(|A|)`` (rows are targets), and a node's **influence** is ``w @ (Â + Â² + …)``
with ``w`` the logit nodes' probabilities (zero elsewhere). `countlens.features.prune` prunes by it;
`countlens.features.graph` uses it (`feature_order`) to choose which features to visit when a graph
keeps at most ``max_features`` of them.
"""

from __future__ import annotations

import torch

from countlens.errors import InputError

MAX_ITERATIONS = 1000


def normalized(adjacency: torch.Tensor) -> torch.Tensor:
    """``|A| / rowsum(|A|)``, each row sum clamped to ≥ 1e-10."""
    a = adjacency.abs()
    return a / a.sum(1, keepdim=True).clamp_min(1e-10)


def influence(normalized_adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights @ (Â + Â² + …)``, summed until a term is exactly zero (at most 1000 terms). A NaN or
    ±inf in ``Â`` or ``weights`` is refused as what it is (NaN never sums to zero: it would read as
    a cycle)."""
    for what, values in (("adjacency", normalized_adjacency), ("logit weights", weights)):
        if not torch.isfinite(values).all():
            raise InputError(
                f"the graph's {what} holds {int((~torch.isfinite(values)).sum())} NaN or ±inf values: the replacement "
                "model computed non-finite numbers (transcoders with NaN or ±inf weights, or a model that overflows "
                "in its dtype); check the transcoders (load_transcoders refuses a file with them) and build the "
                "graph again"
            )
    current = weights @ normalized_adjacency
    total = current.clone()
    for _ in range(MAX_ITERATIONS):
        if not current.any():
            return total
        current = current @ normalized_adjacency
        total += current
    raise InputError(
        f"influence did not vanish after {MAX_ITERATIONS} terms: the adjacency has a cycle, which an attribution "
        "graph (edges from earlier to later only) cannot have; build it with attribution_graph"
    )


def feature_order(logit_rows, logit_probs, n_f: int, max_features: int | None, rows: int) -> list:
    """The chunks of feature targets `attribution_graph` fills, ``rows`` at a time: all features in
    order, or (``max_features``) a callable per chunk that picks, given the rows filled so far and
    the visited mask, the unvisited features of largest influence on the logits (direct plus
    indirect, through the rows so far), as circuit-tracer's ``max_feature_nodes`` does."""
    if max_features is None or n_f <= max_features:
        return [torch.arange(i, min(i + rows, n_f)) for i in range(0, n_f, rows)]

    def pick(size):
        def chunk(feature_rows, visited):
            a = torch.zeros(n_f + len(logit_probs), n_f)
            a[:n_f] = feature_rows[:, :n_f]
            a[n_f:] = logit_rows[:, :n_f]
            w = torch.cat([torch.zeros(n_f), logit_probs.float()])
            full = torch.zeros(len(w), len(w))
            full[:, :n_f] = a
            score = influence(normalized(full), w)[:n_f] + (w @ normalized(full))[:n_f]
            score[visited] = -1
            return score.topk(size).indices

        return chunk

    sizes = [min(rows, max_features - i) for i in range(0, max_features, rows)]
    return [pick(s) for s in sizes]
