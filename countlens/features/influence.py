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
from countlens.validate import require_integer, require_tensor

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
    only one pass reads the rows, a block at a time. Mismatched shapes, a node that is no row's
    (an error or embedding, or out of range) and ``n_features`` outside ``[0, n_sources]`` are refused."""
    k, n_src = _check_partial(rows, row_nodes, logit_probs, n_features, row_sums)
    sums = rows.abs().sum(1) if row_sums is None else row_sums
    scale = 1 / sums.float().clamp_min(1e-8)
    is_feature = row_nodes < n_features
    feature_rows = is_feature.nonzero().flatten()
    r = torch.zeros(k)
    r[~is_feature] = logit_probs.float().cpu()[row_nodes[~is_feature] - n_src]
    block = rows[:, row_nodes[feature_rows]]  # a copy (advanced indexing): Â at the known rows' own nodes,
    block.abs_().mul_(scale[:, None])  # made in place, so one (k, known features) block is alive
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
    ``argsort(influences, descending=True)`` without the visited; ties in index order). ``influences``
    and ``visited`` (bool) are (n_features,) each; ``size`` ≥ 0."""
    require_tensor(influences, "influences", ndim=1)
    require_tensor(visited, "visited", ndim=1)
    if visited.dtype != torch.bool or visited.shape != influences.shape:
        raise InputError(
            f"visited must be a bool tensor shaped like influences {tuple(influences.shape)}, got {visited.dtype} "
            f"{tuple(visited.shape)}: give one True or False per feature (True: already visited)"
        )
    require_integer(size, "size (features to return)", low=0)
    rank = torch.argsort(influences, descending=True, stable=True)
    return rank[~visited[rank]][:size]


def _check_partial(rows, row_nodes, logit_probs, n_features, row_sums) -> tuple[int, int]:
    """`partial_influence`'s arguments (shapes and node ranges only: the rows are not scanned)."""
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or not rows.is_floating_point():
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise InputError(f"rows must be a 2-D float tensor (k known rows × n_sources), got {shape}")
    k, n_src = rows.shape
    require_integer(n_features, "n_features", low=0)
    if n_features > n_src:
        raise InputError(
            f"n_features={n_features} is more than the rows' {n_src} source columns; the feature columns come "
            "first among the sources: give n_features ≤ rows.shape[1]"
        )
    require_tensor(logit_probs, "logit_probs", ndim=1)
    require_tensor(row_nodes, "row_nodes", ndim=1)
    if row_nodes.is_floating_point() or row_nodes.dtype == torch.bool or len(row_nodes) != k:
        raise InputError(
            f"row_nodes must be an integer tensor with one node per row ({k} rows), got {row_nodes.dtype} "
            f"of length {len(row_nodes)}: give each row's node (a feature j < n_features, logit i as n_sources + i)"
        )
    feature = row_nodes < n_features
    logit = (row_nodes >= n_src) & (row_nodes < n_src + len(logit_probs))
    bad = ~((row_nodes >= 0) & feature | logit)
    if bad.any():
        first = int(row_nodes[bad][0])
        raise InputError(
            f"row_nodes holds {int(bad.sum())} node(s) that are no row's (first: {first}): a row is a feature's "
            f"(0 ≤ j < n_features = {n_features}) or a logit's (n_sources + i = {n_src} + i, i < "
            f"{len(logit_probs)} logit_probs); errors and embeddings are sources only"
        )
    if row_sums is not None:
        require_tensor(row_sums, "row_sums", ndim=1)
        if len(row_sums) != k:
            raise InputError(f"row_sums must have one sum per row ({k}), got {len(row_sums)}; or leave it None")
    return k, n_src
