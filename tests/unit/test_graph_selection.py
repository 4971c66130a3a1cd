"""`attribution_graph`'s ``max_features`` selection against circuit-tracer's published rule
(decoderesearch/circuit-tracer, ``attribute`` and ``compute_partial_influences``), re-implemented
here independently in float64 from its definition:

- the known rows (logit rows first, then features as visited; ``row_to_node_index``) are normalised
  ``|A| / rowsum(|A|)`` over ALL their columns (features, errors, embeddings), each sum clamped to
  ≥ 1e-8;
- ``prod`` starts as the logit probabilities at the logit nodes; ``prod = prod[row_to_node_index] @ Â``
  until it is zero; the influence is the sum of the ``prod``s (the direct influence once);
- the next queue is the ``update_interval × batch_size`` unvisited features of largest influence.

On random partial graphs (the next picks equal, in order) and on the organism (the whole selection
replayed on the full graph's rows equals the one attribution_graph made, a tie at a queue's cut
(`TIE`) followed either way; 200 features a feature batch of 8 at a time, enough rows known for the
indirect influence to move the picks; each visited row is the full
graph's row; max_features ≥ the active count is the full graph), and the refusals before any forward.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close, scale_of

from countlens.datasets.tasks import count_task_sample
from countlens.errors import InputError
from countlens.features import attribution_graph
from countlens.features.influence import next_features, partial_influence

WIDTH, K = 32, 4


def reference_influence(known: torch.Tensor, logit_p: torch.Tensor, row_to_node: torch.Tensor) -> torch.Tensor:
    """circuit-tracer's rule on ``known`` (rows × all nodes, logit nodes last), in float64."""
    a = known.double().abs()
    a = a / a.sum(1, keepdim=True).clamp(min=1e-8)
    prod = torch.zeros(a.shape[1], dtype=torch.float64)
    prod[-len(logit_p) :] = logit_p.double()
    total = torch.zeros_like(prod)
    for _ in range(128):
        prod = prod[row_to_node] @ a
        if not prod.any():
            return total
        total += prod
    raise AssertionError("no convergence")


def reference_queue(influence: torch.Tensor, visited: torch.Tensor, size: int) -> list[int]:
    order = sorted(range(len(visited)), key=lambda j: (-float(influence[j]), j))
    return [j for j in order if not visited[j]][:size]


#: Influences within this share of the largest one are a tie: the graph's rows are float32 at its
#: own batch size (the replay's are the full graph's, at 64, in float64), and another CPU's kernels
#: round them otherwise, so a tie at a queue's cut may fall either way. A real difference in the rule
#: (the direct influence counted twice, rows normalised over the feature columns only) moves the
#: influences by far more than this.
TIE = 1e-4


def queue_through_ties(influence: torch.Tensor, visited: torch.Tensor, size: int, chosen) -> list[int]:
    """`reference_queue`, but where the cut falls among features within `TIE` of it (a tie), the tied
    features in ``chosen`` (what the implementation picked) are taken first; every feature clearly
    above the cut is taken whatever was chosen."""
    ranked = reference_queue(influence, visited, len(visited))
    cut, tol = float(influence[ranked[size - 1]]), TIE * float(influence.abs().max())
    sure = [j for j in ranked[:size] if influence[j] > cut + tol]
    tied = [j for j in ranked if abs(float(influence[j]) - cut) <= tol]  # in rank order
    tied.sort(key=lambda j: j not in chosen)  # stable: the chosen first, then by rank
    return sure + tied[: size - len(sure)]


def random_graph(seed: int, n_f=300, n_e=40, n_m=10, n_logits=3, layers=5):
    """A random attribution-graph-shaped adjacency (rows targets): features in ``layers`` layers read
    earlier layers' features and any error or embedding; logits read everything; sources only below."""
    g = torch.Generator().manual_seed(seed)
    n = n_f + n_e + n_m + n_logits
    layer = torch.randint(0, layers, (n_f,), generator=g).sort().values
    a = torch.randn(n, n, generator=g) * (torch.rand(n, n, generator=g) < 0.3)
    a[:, n_f + n_e + n_m :] = 0  # no logit is a source
    a[n_f : n_f + n_e + n_m] = 0  # errors and embeddings are sources only
    a[:n_f, :n_f] *= layer[None, :] < layer[:, None]
    probs = torch.rand(n_logits, generator=g).softmax(0)
    return a, probs, n_f, n_logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_next_picks_on_a_partial_random_graph_are_circuit_tracers(seed):
    a, probs, n_f, n_logits = random_graph(seed)
    n = a.shape[0]
    n_src = n - n_logits
    g = torch.Generator().manual_seed(100 + seed)
    known = torch.randperm(n_f, generator=g)[:80]  # features visited so far, in visiting order
    row_to_node = torch.cat([torch.arange(n_src, n), known])
    rows = a[row_to_node]
    visited = torch.zeros(n_f, dtype=torch.bool)
    visited[known] = True
    mine = partial_influence(rows[:, :n_src], row_to_node, probs, n_f)
    want = reference_influence(rows, probs, row_to_node)[:n_f]
    assert_close(mine, want, scale=scale_of(want), what="partial influence")
    queue = next_features(mine, visited, 64).tolist()
    assert set(queue) == set(queue_through_ties(want, visited, 64, set(queue)))
    tol = TIE * float(want.abs().max())  # largest first, but where two are tied
    assert all(want[a] >= want[b] - tol for a, b in zip(queue, queue[1:]))
    # Only the logit rows known: the direct influence alone, once.
    logit_only = partial_influence(rows[:n_logits, :n_src], row_to_node[:n_logits], probs, n_f)
    direct = probs.double() @ (a[n_src:].double().abs() / a[n_src:].double().abs().sum(1, keepdim=True))
    assert_close(logit_only, direct[:n_f], scale=1.0, what="direct influence")


def test_row_sums_are_over_all_columns_and_clamped():
    """A feature whose only known row is all zero gets nothing; one whose reader's row is mostly error
    gets a share of that row's whole sum, not of its feature columns."""
    n_f, n_src = 3, 5  # features 0..2, error 3, embedding 4; one logit (node 5)
    rows = torch.zeros(3, n_src)
    rows[0, [1, 3]] = torch.tensor([1.0, 3.0])  # the logit: feature 1 (¼), the error (¾)
    rows[1] = 0.0  # feature 1's row: empty (sum clamped, no division by zero)
    rows[2, 0] = -2.0  # feature 2's row reads feature 0, but feature 2 has no influence
    nodes = torch.tensor([5, 1, 2])
    got = partial_influence(rows, nodes, torch.tensor([1.0]), n_f)
    assert_close(got, torch.tensor([0.0, 0.25, 0.0]), scale=1.0, what="influences")


@pytest.fixture(scope="module")
def organism(small_transcoders, loaded):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    vlm = loaded("toy")
    tcs = small_transcoders
    sample = count_task_sample(3, 0)
    full = attribution_graph(vlm, tcs, sample, max_logits=3, batch_size=64)
    yield vlm, tcs, sample, full
    torch.set_num_threads(before)


def replay(full, max_features: int, batch: int, interval: int, kept: set[int]) -> list[int]:
    """circuit-tracer's whole selection, replayed on the full graph's rows (the reference rule), in
    float64. Where a queue's cut falls among features whose influences are within `TIE` of it (a tie),
    the tied features that the graph ``kept`` are taken first, so the replay follows the graph through a
    tie and compares the rest; every feature clearly above the cut is taken whatever the graph did."""
    n_f, n = full.n_features, full.n_nodes
    logits = torch.arange(full.start("logit"), n)
    visited = torch.zeros(n_f, dtype=torch.bool)
    order: list[int] = []
    while len(order) < max_features:
        row_to_node = torch.cat([logits, torch.tensor(order, dtype=torch.long)])
        influence = reference_influence(full.adjacency[row_to_node], full.logit_probs, row_to_node)[:n_f]
        queue = queue_through_ties(influence, visited, min(interval * batch, max_features - len(order)), kept)
        order += queue
        visited[queue] = True
    return order


@pytest.mark.parametrize("max_features, batch, interval", [(200, 8, 1), (25, 4, 4)])
def test_the_organisms_selection_replays_circuit_tracers_and_its_rows_are_the_full_graphs(
    organism, max_features, batch, interval
):
    vlm, tcs, sample, full = organism
    small = attribution_graph(
        vlm, tcs, sample, max_logits=3, max_features=max_features, batch_size=batch, update_interval=interval
    )
    index = {tuple(f): i for i, f in enumerate(full.features.tolist())}
    kept = [index[tuple(f)] for f in small.features.tolist()]
    assert kept == sorted(replay(full, max_features, batch, interval, set(kept)))
    # Each visited row (and the logit rows) is the full graph's, at the kept columns.
    rest = list(range(full.n_features, full.start("logit")))
    cols = kept + rest
    mine = small.adjacency[:, : small.start("logit")]
    rows = kept + list(range(full.start("logit"), full.n_nodes))
    want = full.adjacency[rows][:, cols]
    mine_rows = torch.cat([mine[: small.n_features], mine[small.start("logit") :]])
    assert_close(mine_rows, want, scale=scale_of(want), what="visited rows against the full graph's")
    assert_close(small.values[: small.n_features], full.values[kept], what="kept features' values")
    assert_close(small.constant[: small.n_features], full.constant[kept], what="kept features' constants")


def test_max_features_at_or_above_the_active_count_is_the_full_graph(organism):
    vlm, tcs, sample, full = organism
    most = vlm.arch.n_layers * len(full.tokens) * K  # what could ever be active: accepted, above it refused
    for cap in sorted({full.n_features, full.n_features + 1, most} - {most + 1}):
        same = attribution_graph(vlm, tcs, sample, max_logits=3, batch_size=64, max_features=cap)
        assert torch.equal(same.features, full.features)
        assert torch.equal(same.adjacency, full.adjacency)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_features": 0}, "max_features must be an integer ≥ 1"),
        ({"max_features": 10**6}, "give max_features ≤"),
        ({"max_features": -1}, "max_features must be an integer ≥ 1"),
        ({"batch_size": 0}, "batch_size must be an integer ≥ 1"),
        ({"update_interval": 0}, "update_interval must be an integer ≥ 1"),
    ],
)
def test_bad_max_features_and_batch_size_are_refused_before_any_forward(organism, monkeypatch, kwargs, words):
    vlm, tcs, sample, _ = organism

    def boom(*args, **kwargs):
        raise AssertionError("a forward ran before the arguments were checked")

    monkeypatch.setattr(vlm.hf, "forward", boom)
    with pytest.raises(InputError, match=words):
        attribution_graph(vlm, tcs, sample, **kwargs)


def _small_rows():
    rows = torch.zeros(3, 5)  # features 0..2, error 3, embedding 4; one logit (node 5)
    rows[0, 1] = 1.0
    return rows, torch.tensor([5, 1, 2]), torch.tensor([1.0])


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda r, n, p: (r, n[:2], p, 3), "one node per row"),
        (lambda r, n, p: (r, n.float(), p, 3), "integer tensor"),
        (lambda r, n, p: (r, torch.tensor([5, 1, 7]), p, 3), "no row's .first: 7"),
        (lambda r, n, p: (r, torch.tensor([5, -1, 2]), p, 3), "no row's .first: -1"),
        (lambda r, n, p: (r, torch.tensor([5, 3, 2]), p, 3), "errors and embeddings are sources only"),
        (lambda r, n, p: (r, n, p, 6), "n_features ≤ rows.shape"),
        (lambda r, n, p: (r, n, p, -1), "n_features must be an integer ≥ 0"),
        (lambda r, n, p: (r[0], n, p, 3), "rows must be a 2-D float tensor"),
    ],
)
def test_partial_influence_refuses_mismatched_rows_and_nodes(change, words):
    rows, nodes, probs, n_f = change(*_small_rows())
    with pytest.raises(InputError, match=words):
        partial_influence(rows, nodes, probs, n_f)


def test_partial_influence_refuses_row_sums_of_another_length():
    rows, nodes, probs = _small_rows()
    with pytest.raises(InputError, match="one sum per row"):
        partial_influence(rows, nodes, probs, 3, row_sums=torch.ones(2))


@pytest.mark.parametrize(
    "args, words",
    [
        ((torch.ones(3), torch.zeros(3, dtype=torch.bool), -1), "size .features to return. must be an integer ≥ 0"),
        ((torch.ones(3), torch.zeros(3, dtype=torch.bool), 1.5), "must be an integer"),
        ((torch.ones(3), torch.zeros(2, dtype=torch.bool), 1), "shaped like influences"),
        ((torch.ones(3), torch.zeros(3), 1), "bool tensor"),
    ],
)
def test_next_features_refuses_a_negative_size_and_mismatched_visited(args, words):
    with pytest.raises(InputError, match=words):
        next_features(*args)
