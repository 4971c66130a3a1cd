"""circuit-tracer's graph scores (`countlens.features.scores.graph_scores`) against a hand computation on a
six-node graph, the boundary cases, and the refusals. (That `graph_dataset` carries them on a real
organism graph: tests/unit/test_attribution_graph.py, whose module fixture builds one.)"""

from __future__ import annotations

import math

import pytest
import torch

from countlens.errors import InputError
from countlens.features.graph import AttributionGraph
from countlens.features.scores import graph_scores

# Nodes: feature F (0), errors E0 (1) and E1 (2), embeddings T0 (3) and T1 (4), logit L (5).
F, E0, E1, T0, T1, L = range(6)
P = 0.8  # the logit's probability (its weight w_L)
TOL = 1e-6  # float32 arithmetic on numbers of order 1


def tiny(edges: dict[tuple[int, int], float], with_logit: bool = True) -> AttributionGraph:
    """The six-node graph (five without the logit) with ``A[target, source]`` from ``edges``."""
    n = 6 if with_logit else 5
    a = torch.zeros(n, n)
    for (t, s), v in edges.items():
        a[t, s] = v
    return AttributionGraph(
        adjacency=a,
        features=torch.tensor([[0, 1, 5]]),
        activations=torch.tensor([1.0]),
        errors=torch.tensor([[0, 0], [0, 1]]),
        embeddings=torch.tensor([0, 1]),
        logit_tokens=torch.tensor([7] if with_logit else [], dtype=torch.long),
        logit_probs=torch.tensor([P] if with_logit else []),
        values=torch.full((n,), float("nan")),
        constant=torch.zeros(n),
        tokens=torch.tensor([3, 4]),
        token_strings=["a", "b"],
        cells=torch.full((2, 2), -1),
        objects=torch.full((2,), -1),
        n_layers=1,
    )


def test_both_scores_match_a_hand_computation():
    # L reads F (+2), E1 (−1), T1 (+1): |row| sums to 4, so Â[L] = F 0.5, E1 0.25, T1 0.25.
    # F reads T0 (+3), E0 (−1): Â[F] = T0 0.75, E0 0.25.
    g = tiny({(L, F): 2.0, (L, E1): -1.0, (L, T1): 1.0, (F, T0): 3.0, (F, E0): -1.0})
    # Influence i = w Â + w Â² (w = 0.8 at L): w Â = F 0.4, E1 0.2, T1 0.2; (w Â) Â = F's 0.4 → T0 0.3, E0 0.1.
    i = {F: 0.4, E0: 0.1, E1: 0.2, T0: 0.3, T1: 0.2, L: 0.0}
    replacement = (i[T0] + i[T1]) / (i[T0] + i[T1] + i[E0] + i[E1])  # 0.5 / 0.8 = 0.625
    # Completeness: weights i + w = F 0.4, E0 0.1, E1 0.2, T0 0.3, T1 0.2, L 0.8 (sum 2.0); non-error shares
    # F 1 − 0.25, L 1 − 0.25, the sources 1 (no inputs): (0.4·0.75 + 0.1 + 0.2 + 0.3 + 0.2 + 0.8·0.75) / 2.0.
    completeness = (0.4 * 0.75 + 0.1 + 0.2 + 0.3 + 0.2 + 0.8 * 0.75) / 2.0  # 1.7 / 2.0 = 0.85
    got = graph_scores(g)
    assert set(got) == {"replacement", "completeness"}
    assert got["replacement"] == pytest.approx(0.625, abs=TOL) == replacement
    assert got["completeness"] == pytest.approx(0.85, abs=TOL) == completeness


def test_a_graph_without_error_edges_scores_one_on_both():
    g = tiny({(L, F): 2.0, (L, T1): -1.0, (F, T0): 3.0})
    assert graph_scores(g) == pytest.approx({"replacement": 1.0, "completeness": 1.0}, abs=TOL)


def test_a_graph_whose_input_all_comes_through_errors_has_replacement_zero():
    g = tiny({(L, E1): 2.0, (F, T0): 3.0})  # F reaches no logit: only E1 carries influence (0.8)
    got = graph_scores(g)
    assert got["replacement"] == 0.0
    # L's inputs are all error (share 0), E1 has no inputs (share 1): (0.8·0 + 0.8·1) / (0.8 + 0.8).
    assert got["completeness"] == pytest.approx(0.5, abs=TOL)


def test_a_logit_with_no_inputs_has_no_replacement_score():
    got = graph_scores(tiny({(F, T0): 3.0}))
    assert math.isnan(got["replacement"]) and got["completeness"] == pytest.approx(1.0, abs=TOL)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: tiny({(F, T0): 3.0}, with_logit=False), "no logit nodes"),
        (lambda: None, "AttributionGraph"),
        (lambda: tiny({(L, F): 2.0}).adjacency, "AttributionGraph"),
    ],
)
def test_bad_graphs_are_refused(bad, message):
    with pytest.raises(InputError, match=message):
        graph_scores(bad())
