"""Is it a circuit of edges? Faithfulness of the top edges that EAP-IG and EAP rank.

The model's edge graph (`countlens.circuits.graph.edges`: inputs, heads and MLPs into each head's q, k and
v, each MLP's input and the logits), built and checked once, is scored by the registry's edge methods
(`countlens.circuits.methods.registry`): EAP-IG (its `IG_STEPS` steps) and EAP (the clean run's gradient:
EAP-IG's last, so both come from one pass), and each ranking's circuits at MIB's sizes keep their top
edges while every other edge reads the corrupt run's value (`countlens.circuits.graph.edge_ablation`); the
registry's `RANDOM_DRAWS` random rankings give the baseline. On a model whose layers
do not add their outputs to the residual stream unchanged the graph is undefined: the stage records
why (``refused``) and the report says so. The faithfulness section shows the curves and the CPR / CMD
table beside the head rankings'.
"""

from __future__ import annotations

import xarray as xr

from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.graph import edges
from countlens.circuits.graph.edge_ablation import edge_max_rows, edge_row_bytes
from countlens.circuits.graph.edge_attribution import edge_attributions
from countlens.circuits.graph.faithfulness import SIZES, circuit_sizes, faithfulness_curves
from countlens.circuits.methods.registry import IG_STEPS, RANDOM_DRAWS, method
from countlens.errors import InputError
from countlens.model.memory import Widths, rows_per_forward, widths
from countlens.pipeline.costs import FLOOR_KNOB, Forward, Planner, StagePlan, chunk_sizes, forward_bytes, run_rows
from countlens.pipeline.stages.base import RunContext, Stage

#: The registry's edge methods this stage ranks with, in the report's order: each with the name of its
#: ranking in ``edge_faithfulness.nc`` and the report, and the variable that keeps its scores there
#: (both as runs have always written them).
EDGE_RANKINGS: dict[str, tuple[str, str]] = {
    "eap_ig_edges": ("EAP-IG edges", "eap_ig_effect"),
    "eap_edges": ("EAP edges", "eap_effect"),
}
#: Those methods' registry entries (whose ``variant`` `edge_attributions` computes).
METHODS_RANKED = tuple(method(name) for name in EDGE_RANKINGS)
#: The rankings this stage evaluates, in the report's order.
RANKINGS = tuple(ranking for ranking, _ in EDGE_RANKINGS.values())
#: The one pass both come from costs the integrated method's forwards (`countlens.circuits.methods.registry.Cost`).
PASS = method("eap_ig_edges")


def _compute(run: RunContext) -> xr.Dataset:
    first = prepare_pairs(run.vlm, run.pairs[: run.batch_size]).clean
    try:  # the graph is built and checked once, and handed to each step
        graph = edges.checked_graph(run.vlm, first)
    except InputError as refused:  # the graph is undefined on this model: nothing to measure
        return xr.Dataset(attrs={"refused": str(refused)})
    # A circuit's rows are the chunk's pairs: where one circuit's copy of the batch would not fit,
    # the curves take fewer pairs a chunk (the same sums).
    curve_batch = max(1, min(run.batch_size, edge_max_rows(run.vlm, graph, first)))
    variants = tuple(m.variant for m in METHODS_RANKED)
    scores = edge_attributions(
        run.vlm, run.pairs, variants, steps=IG_STEPS, batch_size=attribution_rows(run, first), graph=graph
    )
    ds = faithfulness_curves(
        run.vlm,
        run.pairs,
        {ranking: scores[v] for ranking, v in zip(RANKINGS, variants, strict=True)},
        batch_size=curve_batch,
        random_draws=RANDOM_DRAWS,
        seed=run.config.seed,
        level="edge",
        graph=graph,
    )
    for (_, variable), v in zip(EDGE_RANKINGS.values(), variants, strict=True):
        ds[variable] = scores[v].effect
    ds.attrs["steps"] = IG_STEPS
    ds.attrs["curve_batch"] = curve_batch
    return ds


def edge_count(n_layers: int, heads: int, kv_heads: int) -> int:
    """Edges of a model of uniform layers with separate q, k and v (`countlens.circuits.graph.edges`)."""
    total, upstream = 0, 2
    for _ in range(n_layers):
        total += (heads + 2 * kv_heads) * upstream
        upstream += heads
        total += upstream  # the MLP reads its own layer's heads too
        upstream += 1
    return total + upstream  # the logits


def _uniform(w: Widths) -> tuple[int, int, list[int]]:
    """(receivers of a layer's attention, upstream nodes of the graph, prefix of each layer's attention
    receivers) of a model of uniform layers with separate q, k and v."""
    prefixes = [2 + layer * (w.n_heads + 1) for layer in range(w.n_layers)]
    return w.n_heads + 2 * w.n_kv_heads, 2 + w.n_layers * (w.n_heads + 1), prefixes


def edge_forward_flops(w: Widths, seq: int, rows: int) -> float:
    """FLOPs an edge-ablated forward of ``rows`` × ``seq`` tokens adds to a plain one, every node live
    (`countlens.circuits.graph.edge_ablation`): each layer's heads' differences mapped to the residual stream
    (an o_proj), the masked sums of its attention receivers and of its MLP over the nodes upstream,
    the receivers' q, k and v columns recomputed from their own normed copies, and the logits' sum."""
    receivers, nodes, prefixes = _uniform(w)
    qkv = (w.n_heads + 2 * w.n_kv_heads) * w.d_head
    per_token = sum(
        2 * w.n_heads * w.d_head * w.d_model  # the heads' residual-space differences
        + 2 * receivers * p * w.d_model  # the attention receivers' masked sums
        + 2 * (p + w.n_heads) * w.d_model  # the MLP's
        + 2 * qkv * w.d_model  # q, k and v of the receivers' copies
        for p in prefixes
    )
    return float(rows * seq * (per_token + 2 * nodes * w.d_model))


def attribution_flops(w: Widths, seq: int, rows: int, steps: int) -> float:
    """FLOPs of `edge_attributions`' products beyond its forwards and backwards, one chunk of ``rows``
    pairs: per gradient, the node differences (an o_proj per layer; formed once for all gradients
    where one product covers every position, so this is an upper bound) and Σ over edges of one
    d_model-wide product per token (float64)."""
    n_edges = edge_count(w.n_layers, w.n_heads, w.n_kv_heads)
    per_token = 2 * w.n_layers * w.n_heads * w.d_head * w.d_model + 2 * n_edges * w.d_model
    return float(steps * rows * seq * per_token)


def _kept_bytes(w: Widths, n: int, seq: int) -> tuple[int, int]:
    """(one recording of the nodes, one step's gradients) of ``n`` pairs of ``seq`` tokens."""
    values = (2 * w.n_layers + 1) * n * seq * w.d_model * w.act_bytes
    gradients = w.n_layers * n * seq * (4 * w.d_model + (w.n_heads + 2 * w.n_kv_heads) * w.d_head) * w.act_bytes
    return values, gradients


def attribution_row_bytes(w: Widths, seq: int, patches: int) -> int:
    """What one more pair adds to the attributions' peak (`_plan`): its recording held across the chunk,
    and its forward with a backward pass holding two recordings and one step's gradients."""
    values, gradients = _kept_bytes(w, 1, seq)
    return values + forward_bytes(w, Forward(1, seq, grad=True, extra=2 * values + gradients), patches)


def attribution_rows(run: RunContext, first) -> int:
    """The pairs a chunk of the attributions takes in this run (``first``: the first chunk's clean batch):
    the batch size, or fewer where the memory free now holds fewer (`countlens.pipeline.costs.run_rows`,
    the rule the plan chose by)."""
    if run.vlm.remote:
        return run.batch_size
    w = widths(run.vlm)
    row = attribution_row_bytes(w, int(first.inputs["input_ids"].shape[1]), first.patches(w.merge))
    return run_rows(run.vlm, "edge_faithfulness", row, run.batch_size)


def _plan(p: Planner) -> StagePlan:
    """Per chunk of pairs: both attributions from one pass (two recordings, EAP-IG's steps of one
    forward and backward each, one step's gradients kept for its products), in chunks of as many pairs
    as fit (`Planner.chunk`), then the corrupt run recorded and every distinct circuit as stacked copies
    of the clean batch, each copy holding its live nodes' differences from the ablation values; the graph
    checked once, on the first chunk."""
    w, seq = p.w, p.pair_seq
    pairs = p.samples("pairs")
    chunk, notes, fits = p.chunk("edge_faithfulness", attribution_row_bytes(w, seq, p.patches))
    n0 = min(p.bs, len(pairs))
    n_edges = edge_count(w.n_layers, w.n_heads, w.n_kv_heads)
    circuits = (len(RANKINGS) + RANDOM_DRAWS) * len(set(circuit_sizes(n_edges, SIZES))) + 2
    values, _ = _kept_bytes(w, n0, seq)  # the curves' recording of the nodes
    receivers, _, _ = _uniform(w)
    extra = edge_row_bytes(w, seq, receivers)
    rows = rows_per_forward(w, seq, max(0, p.free - values), 1, p.patches, extra=extra)
    fw = [Forward(n0, seq)]  # the additivity check
    for n, k in chunk_sizes(len(pairs), chunk).items():
        recorded, gradients = _kept_bytes(w, n, seq)
        # two recordings for the attributions
        fw += [Forward(n, seq, count=PASS.cost.plain(w.n_layers) * k)]
        steps = PASS.cost.grad(w.n_layers)
        fw += [
            Forward(
                n,
                seq,
                count=steps * k,
                grad=True,
                extra=2 * recorded + gradients,
                extra_flops=attribution_flops(w, seq, n, steps) / steps,
            )
        ]
    # the curves: chunks of at most as many pairs as one circuit's rows fit (`_compute`); their recording
    # of the nodes is the stage's kept bytes where the attributions' chunk is as large, else the rest of
    # it is held beside each of their forwards
    kept = _kept_bytes(w, min(chunk, n0), seq)[0]
    for n, k in chunk_sizes(len(pairs), max(1, min(p.bs, rows))).items():
        per = max(1, rows // n)
        fw += [Forward(n, seq, count=k, extra=values - kept)]  # the corrupt run recorded
        full, rest = divmod(circuits, per)
        for m, count in ((per, k * full), (rest, k if rest else 0)):
            if count:
                fw += [
                    Forward(
                        m * n,
                        seq,
                        count=count,
                        extra=m * n * extra + values - kept,
                        extra_flops=edge_forward_flops(w, seq, m * n),
                    )
                ]
    return StagePlan(
        "edge_faithfulness", fw, kept=kept, rows=rows, batch=chunk, notes=notes, fits=fits, knob=FLOOR_KNOB
    )


EDGE_FAITHFULNESS = Stage(
    "edge_faithfulness",
    inputs=("pairs",),
    compute=_compute,
    plan=_plan,
    variables={"faithfulness": ("ranking", "size"), "cpr": ("ranking",), "cmd": ("ranking",)},
)
