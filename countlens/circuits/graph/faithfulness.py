"""Faithfulness: do the components a method names, together, carry the behaviour?

Patching one component at a time (`patch_heads`, `attribution_patch`) ranks components; a circuit
claim needs more: that the top of the ranking, kept while everything else is ablated, still does
the task, and that little outside it matters. This module measures that, following the circuit
localisation track of the MIB benchmark (Mueller et al. 2025).

**Nodes.** A node is one component's output over every position: a head's z (its slice of the
attention output projection's input, `Arch.o_proj`), a layer's MLP output (on a mixture-of-experts
layer, the whole MoE block's), or an input: the image tokens' embeddings and the other tokens'
embeddings (the input of layer 0 at those positions; on a cross-attention model the image node is the
image states every cross-attention layer reads, `CrossAttentionSpec.states`). ``nodes`` chooses which
kinds form the node set N; a ranking scores some of them (`node_scores`).

**The circuit at size s.** Rank the nodes of N by |score| (ties in node order), keep the top
⌊s·|N|⌋ (MIB's rounding) as the circuit C and ablate every other node of N, in one forward of the
clean input: an ablated node's output is overwritten by the corrupt input's output of the same node
(``ablation="patch"``, counterfactual patching: the corrupt run's activations, recorded once), or by
its mean over the clean and corrupt inputs of the pairs in the same chunk, per position
(``ablation="mean"``, countlens's choice of reference set). Nodes of C are recomputed in that forward
from what reaches them. Components outside N (e.g. the MLPs when N is the heads) are never ablated.

**The metric.** m = Σ over pairs of the metric M (`countlens.circuits.metrics`; default the logit
difference LD = logit(clean answer) − logit(corrupt answer)) at the read position (`patching`: the first
token where the two answers differ). f(C) = (m(C) − m(∅)) / (m(N) − m(∅)): m(N) is the clean run, m(∅)
the forward with every node of N ablated. So f = 1 with every node kept and f = 0 with none, by
construction; with N every node kind and counterfactual patching, m(∅) is the corrupt run itself (every
component's output is the corrupt one), except where the image also enters inside the decoder
(Qwen3-VL's DeepStack, Gemma 4's per-layer inputs), which no node here covers. Any metric applies: KL
from the clean run reads the clean run's logits, those of the forward that ablates nothing (m(N) = 0
there). m(N) − m(∅) is refused where it is within the pairs' own noise (`normaliser`'s rule).

**Areas.** Over the sizes (default MIB's 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100 % of N), with x the
fraction of N kept (⌊s·|N|⌋ / |N|) on a linear axis, trapezoids: CPR = ∫ f dx (higher is better),
CMD = ∫ |1 − f| dx (lower is better). MIB's code offers a log axis over counts too; countlens uses the
linear fraction because on small models the smallest sizes keep 0 nodes (log 0 is undefined), and a
fraction keeps models of different sizes on one scale. These are countlens's own measurements: no
paper's CPR or CMD is comparable without the same models, tasks and node set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.metrics import metric_for, normalised
from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.graph import edge_ablation, edges
from countlens.circuits.graph.nodes import (
    NODE_KINDS,
    Node,
    ablated_logits,
    graph_nodes,
    image_positions,
    kind_of,
    mean_of,
    node_key,
    record_nodes,
)
from countlens.errors import InputError
from countlens.labels import expert_label, head_label
from countlens.model.arguments import require_vlm
from countlens.results import provenance
from countlens.validate import (
    require_choice,
    require_finite_scores,
    require_fractions,
    require_integer,
    require_seed,
    require_share,
)

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: MIB's circuit sizes: fractions of the node set kept.
SIZES: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ABLATIONS: tuple[str, ...] = ("patch", "mean")
LEVELS: tuple[str, ...] = ("node", "edge")
#: Random rankings drawn as the baseline by default (their mean and spread are reported).
RANDOM_DRAWS = 5
#: A curve result's own variables: the per-pair values, named after the metric, take none of these names.
CURVE_VARIABLES: tuple[str, ...] = (
    "faithfulness",
    "metric",
    "cpr",
    "cmd",
    "cpr_std",
    "cmd_std",
    "kept",
    "kept_fraction",
)


def node_scores(vlm: VLM, scores, kinds: Sequence[str] | None = None) -> dict[Node, float]:
    """A ranking's score per node. ``scores``: a DataArray over (layer, head) (a head ranking:
    `patch_heads`' or `attribution_patch`'s ``effect``, an ablation drop) or over (layer, expert)
    (`patch_experts`' ``effect``), or a mapping from node label (``L3H1``, ``MLP3``, ``IN.image``,
    ``L1E3``) to score. ``kinds``: the node set; by default the kinds the
    ranking scores. A node of the set the ranking does not score is refused by name."""
    if isinstance(scores, xr.Dataset):
        raise InputError(
            "scores is a Dataset; give its scores as a DataArray over (layer, head), e.g. result.effect "
            "(or result.logp_drop.sel(task='count', drop=True) of an ablation scan), or {node label: score}"
        )
    if isinstance(scores, xr.DataArray):
        unit = next((u for u in ("head", "expert") if set(scores.dims) == {"layer", u}), None)
        if unit is None:
            raise InputError(
                f"scores over {scores.dims}: give a DataArray over (layer, head) or (layer, expert), "
                "or {node label: score}"
            )
        label = head_label if unit == "head" else expert_label
        # NaN: no head there (beyond a layer's own heads, e.g. Qwen3.5's linear layers have more).
        values = {
            label((int(la), int(h))): float(scores.sel({"layer": la, unit: h}))
            for la in scores["layer"].values
            for h in scores[unit].values
            if not math.isnan(float(scores.sel({"layer": la, unit: h})))
        }
    elif isinstance(scores, Mapping):
        try:
            values = {str(k): float(v) for k, v in scores.items()}
        except (TypeError, ValueError) as err:
            raise InputError(f"scores must map node labels to numbers ({err})") from None
    else:
        raise InputError(f"scores of type {type(scores).__name__}: give a DataArray over (layer, head) or a mapping")
    require_finite_scores(values, "the ranking")
    every = {n.label: n for n in graph_nodes(vlm)}
    if vlm.arch.expert_layers:
        every.update({n.label: n for n in graph_nodes(vlm, ("expert",))})
    unknown = sorted(set(values) - set(every))
    if unknown:
        raise InputError(
            f"scores name {unknown[:5]}, which are no nodes of {vlm.name}; node labels look like L0H1, MLP0, "
            "IN.image, L1E3 (an expert)"
        )
    if kinds is None:
        kinds = tuple(k for k in NODE_KINDS if any(kind_of(every[label]) == k for label in values))
    chosen = graph_nodes(vlm, kinds)
    missing = [n.label for n in chosen if n.label not in values or math.isnan(values[n.label])]
    if missing:
        raise InputError(
            f"the ranking scores no {missing[:5]}{' …' if len(missing) > 5 else ''} of the node set {list(kinds)}; "
            "score every node of the set, or choose the kinds it scores"
        )
    return {n: values[n.label] for n in chosen}


def circuit_sizes(n_nodes: int, sizes: Sequence[float] = SIZES) -> list[int]:
    """Nodes kept at each size: ⌊s·|N|⌋, as MIB rounds (small sizes of a small model keep none).
    ``sizes``: fractions of the node set, non-empty and increasing."""
    sizes = require_fractions(sizes, "sizes")
    return [int(s * n_nodes + 1e-9) for s in sizes]


def areas(kept: Sequence[float], f: Sequence[float]) -> tuple[float, float]:
    """(CPR, CMD): trapezoid areas of f and of |1 − f| over the fraction kept (see the module docstring)."""
    x, y = np.asarray(kept, dtype=float), np.asarray(f, dtype=float)
    dx = np.diff(x)
    cpr = float((dx * (y[:-1] + y[1:]) / 2).sum())
    cmd = float((dx * (np.abs(1 - y[:-1]) + np.abs(1 - y[1:])) / 2).sum())
    return cpr, cmd


def smallest_faithful(ds: xr.Dataset, level: float = 0.8) -> xr.DataArray:
    """Per ranking, the smallest fraction of the node set whose circuit reaches ``level`` faithfulness
    (NaN where none does); ``level`` is a fraction (0.8, not 80)."""
    require_share(level, "level")
    if not isinstance(ds, xr.Dataset) or "faithfulness" not in ds or "kept_fraction" not in ds:
        raise InputError("smallest_faithful reads a faithfulness_curves result (a Dataset with faithfulness)")
    reached = ds.faithfulness >= level
    kept = ds.kept_fraction.broadcast_like(ds.faithfulness).where(reached)
    return kept.min("size", skipna=True)


def faithfulness(
    vlm: VLM,
    pairs: Sequence,
    scores,
    sizes: Sequence[float] = SIZES,
    ablation: str = "patch",
    nodes: Sequence[str] | None = None,
    batch_size: int = 16,
    level: str = "node",
    metric=None,
) -> xr.Dataset:
    """The faithfulness curve of one ranking (see the module docstring for the definition):
    ``faithfulness`` and ``metric`` over ``size``, with ``kept`` / ``kept_fraction`` and per pair the
    ``metric``'s values (`countlens.circuits.metrics`, named after it: ``logit_diff`` by default);
    ``cpr`` and ``cmd`` in its attrs. One ranking of `faithfulness_curves`."""
    require_vlm(vlm, "faithfulness")
    ds = faithfulness_curves(
        vlm, pairs, {"scores": scores}, sizes, ablation, nodes, batch_size, random_draws=0, level=level, metric=metric
    )
    out = ds.sel(ranking="scores", drop=True)
    out.attrs.update(cpr=float(out.cpr), cmd=float(out.cmd))
    return out.drop_vars(["cpr", "cmd"])


def faithfulness_curves(
    vlm: VLM,
    pairs: Sequence,
    rankings: Mapping[str, object],
    sizes: Sequence[float] = SIZES,
    ablation: str = "patch",
    nodes: Sequence[str] | None = None,
    batch_size: int = 16,
    random_draws: int = RANDOM_DRAWS,
    seed: int = 0,
    level: str = "node",
    graph: edges.EdgeGraph | None = None,
    metric=None,
) -> xr.Dataset:
    """Faithfulness curves of several rankings over one node set (``level="node"``) or over every
    edge (``level="edge"``: rankings are `edge_attribution` results or {edge label: score}; ``nodes``
    does not apply), from one corrupt recording per chunk of pairs: ``faithfulness``, ``metric``
    (ranking × size), ``cpr`` / ``cmd`` per ranking. With ``random_draws`` > 0, that many random
    rankings (a permutation each, seeded by ``seed``) as rankings ``random0`` …, and ``random`` =
    their mean curve (its CPR / CMD the draws' mean; their standard deviation in ``cpr_std`` /
    ``cmd_std``; per-pair values are then left out). ``graph``: at ``level="edge"``, the model's
    `edge_graph` when the caller has built (and checked) it already. ``metric``: what m sums
    (`countlens.circuits.metrics`; default the logit difference), any metric; the per-pair values are named
    after it."""
    require_vlm(vlm, "faithfulness_curves")
    check_pair_sweep(pairs, batch_size, "faithfulness")
    require_choice(ablation, "ablation", ABLATIONS, InputError)
    require_choice(level, "level", LEVELS, InputError)
    if not isinstance(rankings, Mapping):
        raise InputError(f"rankings must map a name to scores, e.g. {{'exact': result.effect}}; got {rankings!r:.60}")
    require_integer(random_draws, "random_draws", low=0)
    require_seed(seed)
    sizes = require_fractions(sizes, "sizes")  # checked once, kept as the list checked (a generator reads once)
    if not rankings and random_draws <= 0:
        raise InputError("no ranking to evaluate: give rankings={name: scores} or random_draws > 0")
    if graph is not None and level != "edge":
        raise InputError("graph= is the edge graph of level='edge'; at level='node' leave it unset")
    metric = metric_for(vlm, pairs, metric, "faithfulness")
    metric.refuse_clash([*CURVE_VARIABLES, "size", "ranking", "pair"], "faithfulness")
    if level == "edge":
        if nodes is not None:
            raise InputError("nodes= chooses a node set; at level='edge' every edge is ranked: leave nodes unset")
        graph = edges.edge_graph(vlm) if graph is None else edges.require_graph(vlm, graph)
        scored = {name: edge_ablation.edge_scores(graph, s) for name, s in rankings.items()}
        items = list(range(len(graph.edges)))
        unit = "edge"
        run = _edge_chunk(vlm, graph, ablation)
    else:
        scored = {name: node_scores(vlm, s, nodes) for name, s in rankings.items()}
        items = list(next(iter(scored.values()))) if scored else graph_nodes(vlm, nodes or ("head",))
        for name, s in scored.items():
            if list(s) != items:
                raise InputError(
                    f"ranking {name!r} scores another node set than the others; give every ranking the same kinds"
                )
        unit = ",".join(dict.fromkeys(kind_of(node) for node in items))
        run = _node_chunk(vlm, items, ablation)
    ds = _curves(vlm, pairs, items, scored, sizes, batch_size, random_draws, seed, run, metric)
    ds.attrs.update(ablation=ablation, level=level, nodes=unit)
    if level == "edge":
        ds.attrs["x_axis"] = "fraction of the edges kept, linear"
    return ds


ChunkRun = Callable[[object, list[frozenset]], torch.Tensor]


def _node_chunk(vlm: VLM, order: list[Node], ablation: str) -> ChunkRun:
    """Per chunk of pairs: last-position logits with each set's nodes ablated."""

    def run(pb, sets):
        values = record_nodes(vlm, pb.corrupt, order)
        if ablation == "mean":
            values = mean_of(record_nodes(vlm, pb.clean, order), values)
        return ablated_logits(vlm, pb.clean, sets, values, image_positions(vlm, pb.clean))

    return run


def _edge_chunk(vlm: VLM, graph, ablation: str) -> ChunkRun:
    """Per chunk of pairs: last-position logits with each set's edges ablated."""

    def run(pb, sets):
        if not graph.checked:
            edges.check_additive(vlm, graph, pb.clean)
        values = record_nodes(vlm, pb.corrupt, graph.nodes)
        if ablation == "mean":
            values = mean_of(record_nodes(vlm, pb.clean, graph.nodes), values)
        return edge_ablation.edge_ablated_logits(vlm, graph, pb.clean, sets, values, image_positions(vlm, pb.clean))

    return run


def _curves(vlm, pairs, items, scored, sizes, batch_size, random_draws, seed, run: ChunkRun, metric) -> xr.Dataset:
    """The curves of ``scored`` rankings over ``items`` (nodes or edge indices), ``run`` ablating sets of
    them in each chunk of pairs, under ``metric`` (bound)."""
    n = len(items)
    position = {item: i for i, item in enumerate(items)}
    kept = circuit_sizes(n, sizes)
    orders: dict[str, list] = {
        name: sorted(items, key=lambda item, s=s: (-abs(s[item]), position[item])) for name, s in scored.items()
    }
    rng = np.random.default_rng(seed)
    for d in range(random_draws):
        orders[f"random{d}"] = [items[i] for i in rng.permutation(n)]
    circuits = {(name, k): frozenset(o[:k]) for name, o in orders.items() for k in kept}
    key = node_key if items and not isinstance(items[0], int) else int  # nodes, or edge indices
    distinct = sorted(set(circuits.values()), key=lambda c: (len(c), sorted(map(key, c))))
    middle = [c for c in distinct if 0 < len(c) < n]
    lds = {c: [] for c in distinct}
    full_ld, empty_ld = [], []
    every = frozenset(items)
    for start in range(0, len(pairs), batch_size):
        pb = prepare_pairs(vlm, pairs[start : start + batch_size])
        # The full and empty circuits, then every other distinct circuit, in stacked forwards (the sets
        # each ablates); a circuit of every item or of none is the full or empty run itself.
        logits = run(pb, [frozenset(), every, *(every - c for c in middle)])
        # A metric that reads the clean run's logits reads those of the forward that ablates nothing.
        pb = metric.at_clean(pb, logits[0])
        ld = [metric(rows, pb).cpu() for rows in logits]
        full_ld.append(ld[0])
        empty_ld.append(ld[1])
        for c in distinct:
            lds[c].append(ld[0] if len(c) == n else ld[1] if not c else ld[2 + middle.index(c)])
    # Sums in float64 over the float32 per-pair values: m(N) and m(∅) are read the way every m(C) is.
    m_full, m_empty = (float(torch.cat(ld).double().sum()) for ld in (full_ld, empty_ld))
    if m_full == m_empty:
        raise InputError(
            f"ablating everything changes no {metric.name} (m(N) = m(∅)): the set carries nothing of "
            "these pairs; give pairs whose answers differ, or a larger node set"
        )
    # m(N) − m(∅) is this curve's normaliser: refused below the pairs' noise (`normaliser`'s rule).
    differences = (torch.cat(full_ld).double() - torch.cat(empty_ld).double()).numpy()
    _, noted = normalised(m_empty, m_full, differences, metric)
    methods = list(orders)
    per_pair = np.stack([[torch.cat(lds[circuits[(m, k)]]).numpy() for k in kept] for m in methods])
    summed = per_pair.astype(np.float64).sum(-1)
    faith = (summed - m_empty) / (m_full - m_empty)
    # The end points are definitions, not measurements: every item kept is the clean run itself (f = 1),
    # none kept the run with every item ablated (f = 0). Dividing a sum by itself is 1 only where both sums
    # run the same reduction; another CPU's kernels may round one of them otherwise.
    faith[:, np.asarray(kept) == n] = 1.0
    faith[:, np.asarray(kept) == 0] = 0.0
    fraction = np.asarray(kept, dtype=float) / n
    cpr, cmd = zip(*(areas(fraction, f) for f in faith))
    ds = xr.Dataset(
        {
            "faithfulness": (("ranking", "size"), faith),
            "metric": (("ranking", "size"), summed),
            metric.name: (("ranking", "size", "pair"), per_pair),
            "cpr": ("ranking", np.asarray(cpr)),
            "cmd": ("ranking", np.asarray(cmd)),
            "kept": ("size", np.asarray(kept)),
            "kept_fraction": ("size", fraction),
        },
        coords={"ranking": methods, "size": np.asarray(sizes, dtype=float), "pair": np.arange(len(pairs))},
    )
    if random_draws > 0:
        draws = ds.sel(ranking=[f"random{d}" for d in range(random_draws)])
        mean = draws[["faithfulness", "metric", "cpr", "cmd"]].mean("ranking").expand_dims(ranking=["random"])
        ds = xr.concat([ds.drop_vars(metric.name), mean], dim="ranking", data_vars="minimal")
        ds["cpr_std"] = xr.full_like(ds.cpr, np.nan).where(ds.ranking != "random", float(draws.cpr.std()))
        ds["cmd_std"] = xr.full_like(ds.cmd, np.nan).where(ds.ranking != "random", float(draws.cmd.std()))
    ds.attrs.update(
        provenance(vlm.name, vlm.arch.name, dataset={"pairs": len(pairs)}, samples=pairs),
        method="faithfulness",
        n_nodes=n,
        metric_full=m_full,
        metric_empty=m_empty,
        **noted,
        x_axis="fraction of the node set kept, linear",
    )
    return ds
