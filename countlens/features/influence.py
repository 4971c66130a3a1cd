"""Influence on the logits in an attribution graph: the normalised adjacency and its power series.

circuit-tracer ranks nodes by how much of the logits' weight reaches them along every path:
``Â = |A| / rowsum(|A|)`` (rows are targets), and a node's **influence** is ``w @ (Â + Â² + …)``
with ``w`` the logit nodes' probabilities (zero elsewhere). `countlens.features.prune` prunes by it;
`countlens.features.graph` uses circuit-tracer's partial form (`partial_influence`, over the rows
computed so far) to choose which features to visit when a graph keeps at most ``max_features`` of them.
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


#: Entries of one transient block while `partial_influence` reads the known rows (float32: 256 MiB):
#: the rows are read a block at a time, never copied whole.
BLOCK_ELEMENTS = 2**26

#: circuit-tracer's ``attribute(update_interval=4)``: feature batches visited between two rankings.
UPDATE_INTERVAL = 4


def partial_influence(
    rows: torch.Tensor,
    row_nodes: torch.Tensor,
    logit_probs: torch.Tensor,
    n_features: int,
    row_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """circuit-tracer's ``compute_partial_influences`` on the rows computed so far, read at the feature
    columns: (``n_features``,) the influence of each feature on the logits.

    ``rows`` (k, n_sources): the known target rows of the adjacency (all source columns: features,
    errors, embeddings); ``row_nodes`` (k,): each row's node (a feature ``j < n_features``, or logit
    ``i`` as ``n_sources + i``); ``logit_probs``: the logit nodes' probabilities; ``row_sums``: each
    row's ``Σ|A|`` if already known. The rule: ``Â = |rows| / rowsum`` (each sum clamped to ≥ 1e-8),
    ``p₀`` the logit probabilities, ``p_{t+1} = p_t[row_nodes] @ Â`` until it is zero, influence
    ``Σ_{t≥1} p_t`` (the direct influence once). Computed as ``(Σ_t r_t) @ Â`` with ``r_t =
    p_t[row_nodes]`` iterated on the (k, k) block of the known rows' own columns (the same sum), so
    only one pass reads the rows, a block at a time."""
    k, n_src = rows.shape
    sums = rows.abs().sum(1) if row_sums is None else row_sums
    scale = 1 / sums.float().clamp_min(1e-8)
    is_feature = row_nodes < n_features
    feature_rows = is_feature.nonzero().flatten()
    r = torch.zeros(k)
    r[~is_feature] = logit_probs.float().cpu()[row_nodes[~is_feature] - n_src]
    block = rows[:, row_nodes[feature_rows]].abs() * scale[:, None]  # Â at the known rows' own nodes
    total, current = r.clone(), r
    for _ in range(MAX_ITERATIONS):
        step = torch.zeros(k)
        step[feature_rows] = current @ block
        if not step.any():
            break
        total += step
        current = step
    else:
        raise InputError(
            f"influence did not vanish after {MAX_ITERATIONS} terms: the rows have a cycle, which an attribution "
            "graph (edges from earlier to later only) cannot have; build it with attribution_graph"
        )
    weights = total * scale
    out = torch.zeros(n_features)
    span = max(1, BLOCK_ELEMENTS // max(n_features, 1))
    for i in range(0, k, span):
        w = weights[i : i + span]
        if w.any():
            out += w @ rows[i : i + span, :n_features].abs()
    return out


def next_features(influences: torch.Tensor, visited: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` unvisited features of largest influence, largest first (circuit-tracer's
    ``argsort(influences, descending=True)`` without the visited; ties in index order)."""
    rank = torch.argsort(influences, descending=True, stable=True)
    return rank[~visited[rank]][:size]
