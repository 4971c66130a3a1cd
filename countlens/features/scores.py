"""How much of an attribution graph is explained by its features: circuit-tracer's two graph scores.

circuit-tracer (decoderesearch/circuit-tracer, ``compute_graph_scores`` in ``circuit_tracer/graph.py``;
Ameisen et al. 2025, "Circuit Tracing") reports two scores for every graph. Both read the same
quantities as pruning (`countlens.features.prune`): the adjacency ``A`` (rows targets, columns
sources), its row-normalised form ``Â = |A| / rowsum(|A|)`` (a row sum below 1e-10 counts as
1e-10, so an empty row stays all zero), the logit weights ``w`` (each logit node's probability, 0
on other nodes) and each node's influence ``i = w @ (Â + Â² + …)``.

**Replacement score**: the share of the logits' influence that reaches the inputs (the embedding
nodes) rather than stopping at an error node::

    replacement = Σ_{embeddings} i / (Σ_{embeddings} i + Σ_{errors} i)

Embeddings and errors are the graph's only sources with no inputs, so every path from a logit ends
at one or the other: 1.0 when no path ends at an error (the features explain the answer from the
tokens), 0.0 when every path does. A strict score: a single error on a path takes its whole share.

**Completeness score**: the share of each node's normalised inputs that do not come from error
nodes, averaged with weight ``i + w`` (its influence, plus the logit's own weight for a logit node)::

    completeness = Σ_n (1 − Σ_{e ∈ errors} Â[n, e]) · (i_n + w_n) / Σ_n (i_n + w_n)

over every node ``n``. A node with no inputs (an error, an embedding, or a node whose row is empty)
counts as complete (its share is 1 − 0). Partial credit: a node mostly explained by features counts
mostly, where the replacement score would charge it whole.

Both are in [0, 1], 1 the best. **Caveats.** On a graph built with ``max_features``, the features
not visited are no nodes and their edges are lost (as in circuit-tracer): the scores are those of the
graph, which no longer holds every path. On a pruned graph (`prune`) the scores are the pruned
graph's: ``Â`` renormalised over the kept edges, the dropped errors and their edges gone, so they
say how much of the *drawn* circuit rests on errors, and are usually higher than the full graph's;
circuit-tracer reports the scores of the unpruned graph.
"""

from __future__ import annotations

from countlens.errors import InputError
from countlens.features.graph import AttributionGraph
from countlens.features.influence import influence, normalized
from countlens.features.prune import logit_weights


def graph_scores(graph: AttributionGraph) -> dict[str, float]:
    """circuit-tracer's ``{"replacement": …, "completeness": …}`` of ``graph`` (see the module's
    docstring). The replacement score is NaN where no influence reaches an embedding or an error
    (logit nodes with no inputs). A graph without logit nodes is refused: both scores are shares of
    the logits' influence."""
    if not isinstance(graph, AttributionGraph):
        raise InputError(f"graph_scores takes an AttributionGraph (attribution_graph(...)), got {graph!r:.60}")
    if graph.n_logits == 0:
        raise InputError(
            "the graph has no logit nodes, and both graph scores are shares of the logits' influence: give the "
            "graph attribution_graph returned (it keeps the most probable logits), or a prune(...) of it"
        )
    w = logit_weights(graph)
    a = normalized(graph.adjacency.float())
    i = influence(a, w)
    errors = slice(graph.start("error"), graph.start("embedding"))
    tokens = float(i[graph.start("embedding") : graph.start("logit")].sum())
    error = float(i[errors].sum())
    replacement = tokens / (tokens + error) if tokens + error > 0 else float("nan")
    weight = i + w
    complete = 1 - a[:, errors].sum(1)
    completeness = float((complete * weight).sum() / weight.sum())
    return {"replacement": replacement, "completeness": completeness}
