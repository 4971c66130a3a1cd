"""Is it a circuit of edges? Faithfulness of the top edges that EAP-IG and EAP rank.

The model's edge graph (`countlens.circuits.edges`: inputs, heads and MLPs into each head's q, k and
v, each MLP's input and the logits) is scored by EAP-IG (`EDGE_STEPS` steps) and by EAP (the clean
run's gradient), and each ranking's circuits at MIB's sizes keep their top edges while every other
edge reads the corrupt run's value (`countlens.circuits.edge_ablation`); five random rankings give the
baseline. On a model whose layers do not add their outputs to the residual stream unchanged the graph
is undefined: the stage records why (``refused``) and the report says so. The faithfulness section
shows the curves and the CPR / CMD table beside the head rankings'.
"""

from __future__ import annotations

import xarray as xr

from countlens.circuits import edges
from countlens.circuits.edge_ablation import edge_row_bytes
from countlens.circuits.edge_attribution import edge_attribution
from countlens.circuits.faithfulness import SIZES, circuit_sizes, faithfulness_curves
from countlens.circuits.pair_batch import prepare_pairs
from countlens.errors import InputError
from countlens.memory import rows_per_forward
from countlens.pipeline.costs import Forward, Planner, StagePlan, chunk_sizes
from countlens.pipeline.stages.base import RunContext, Stage

#: EAP-IG's steps on edges (the MIB authors' default family of settings; as the node stage's).
EDGE_STEPS = 5
#: Random edge rankings drawn as the baseline.
RANDOM_DRAWS = 5
#: The rankings this stage evaluates, in the report's order.
RANKINGS = ("EAP-IG edges", "EAP edges")


def _compute(run: RunContext) -> xr.Dataset:
    try:
        graph = edges.edge_graph(run.vlm)
        edges.check_additive(run.vlm, graph, prepare_pairs(run.vlm, run.pairs[: run.batch_size]).clean)
    except InputError as refused:  # the graph is undefined on this model: nothing to measure
        return xr.Dataset(attrs={"refused": str(refused)})
    ig = edge_attribution(run.vlm, run.pairs, "eap-ig", steps=EDGE_STEPS, batch_size=run.batch_size)
    eap = edge_attribution(run.vlm, run.pairs, "eap", batch_size=run.batch_size)
    ds = faithfulness_curves(
        run.vlm,
        run.pairs,
        dict(zip(RANKINGS, (ig, eap))),
        batch_size=run.batch_size,
        random_draws=RANDOM_DRAWS,
        seed=run.config.seed,
        level="edge",
    )
    ds["eap_ig_effect"] = ig.effect
    ds["eap_effect"] = eap.effect
    ds.attrs["steps"] = EDGE_STEPS
    return ds


def edge_count(n_layers: int, heads: int, kv_heads: int) -> int:
    """Edges of a model of uniform layers with separate q, k and v (`countlens.circuits.edges`)."""
    total, upstream = 0, 2
    for _ in range(n_layers):
        total += (heads + 2 * kv_heads) * upstream
        upstream += heads
        total += upstream  # the MLP reads its own layer's heads too
        upstream += 1
    return total + upstream  # the logits


def _plan(p: Planner) -> StagePlan:
    """Per chunk of pairs: two attributions (two recordings each, then EAP-IG's steps and EAP's one
    forward-and-backward), then the corrupt run recorded and every distinct circuit as stacked copies
    of the clean batch, each copy holding the ablation values and its differences from them."""
    w, b, seq = p.w, p.w.act_bytes, p.pair_seq
    pairs = p.samples("pairs")
    n0 = min(p.bs, len(pairs))
    n_edges = edge_count(w.n_layers, w.n_heads, w.n_kv_heads)
    circuits = (len(RANKINGS) + RANDOM_DRAWS) * len(set(circuit_sizes(n_edges, SIZES))) + 2
    per_layer = n0 * seq * (4 * w.d_model + (w.n_heads + 2 * w.n_kv_heads) * w.d_head) * b
    kept = 2 * (2 * w.n_layers + 1) * n0 * seq * w.d_model * b  # a chunk's two recordings of the nodes
    extra = edge_row_bytes(w, seq, w.n_heads + 2 * w.n_kv_heads + 1)
    rows = rows_per_forward(w, seq, max(0, p.free - kept), 1, p.patches, extra=extra)
    fw = []
    for n, k in chunk_sizes(len(pairs), p.bs).items():
        per = max(1, rows // n)
        # per attribution two recordings and two logit-difference forwards; one recording for the circuits;
        # the first chunk's additivity check (one forward per check: stage, EAP-IG, EAP, circuits)
        fw += [Forward(n, seq, count=9 * k + 4)]
        fw += [Forward(n, seq, count=(EDGE_STEPS + 1) * k, grad=True, extra=w.n_layers * per_layer)]
        full, rest = divmod(circuits, per)
        fw += [Forward(per * n, seq, count=k * full, extra=per * n * extra)] if full else []
        fw += [Forward(rest * n, seq, count=k, extra=rest * n * extra)] if rest else []
    return StagePlan("edge_faithfulness", fw, kept=kept, rows=rows, batch=p.bs)


EDGE_FAITHFULNESS = Stage(
    "edge_faithfulness",
    inputs=("pairs",),
    compute=_compute,
    plan=_plan,
    variables={"faithfulness": ("ranking", "size"), "cpr": ("ranking",), "cmd": ("ranking",)},
)
