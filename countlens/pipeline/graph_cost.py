"""What an attribution graph costs before it is built: nodes, bytes, backward passes, FLOPs, time.

`attribution_graph` (`countlens.features.graph`) builds a dense graph over every active feature of
a prompt, so its cost grows with layers × positions × k, squared. `graph_cost` counts it from a
model's widths alone (a loaded model, `countlens.model.memory.Widths`, or a model built on the meta device
by `countlens.model.loading.meta_vlm`: config and processor, no weights), following graph.py step by step:

**Nodes.** ``F = layers × seq × k`` active features (a TopK transcoder keeps k per token; a kept
pre-activation ≤ 0 is zeroed by its ReLU, so F is an upper bound that trained transcoders meet),
``layers × seq`` error nodes, ``seq`` embedding nodes and ``n_logits`` logit nodes; with
``max_features`` the graph keeps ``min(F, max_features)`` features. Sources: ``S = F + layers × seq
+ seq``.

**Bytes** (the adjacency and its work arrays are float32, `ADJACENCY_BYTES`, whatever the model's
dtype; they live on the host: graph.py makes them with ``torch.zeros``):

- ``adjacency``: the returned graph's ``n × n``;
- ``feature_rows``: graph.py fills ``F × S`` rows for *every* active feature before it drops the
  unvisited ones, so ``max_features`` does not shrink it;
- ``full_adjacency``: the ``(S + n_logits)²`` square the rows are copied into, again before the drop;
- ``selection``: with ``max_features < F``, each chunk's choice (`countlens.features.influence.feature_order`)
  builds ``(F + n_logits) × F`` and ``(F + n_logits)²`` matrices and normalises the square (two more
  of that size): `SELECTION_SQUARES` squares;
- ``transcoders``: ``layers × (2 × width × d_model + width + d_model)`` parameters;
- ``kept``: the one frozen forward over ``batch_rows`` copies that every backward reuses; per copy,
  position and layer, `KEPT_PER_LAYER` d_model-wide vectors (the write leaf graph.py makes per
  layer, the two frozen norms' outputs autograd saves, the attention output ``o_proj`` saves) plus
  two for the embedding leaf and the final norm;
- ``backward``: one pass's transient: the gradient of every leaf (``layers + 1`` vectors per copy
  and position), one target layer's injected gradient, and the ``batch_rows × seq × width`` float32
  product with ``W_dec`` that gives every feature column of a layer at once.

**Passes.** ``ceil(n_logits / batch_rows)`` backward passes for the logit rows, then
``ceil(min(F, max_features) / batch_rows)`` for the feature rows.

**FLOPs.** The forwards are `countlens.pipeline.costs.forward_flops`'s (two of one row: the clean run
and the all-sources-zero run; one of ``batch_rows`` rows with the vision tower per copy). A backward
runs only through what the local replacement model keeps live — per layer ``v_proj``, the frozen
attention pattern and ``o_proj`` (MLPs, ``q``/``k`` and norm scales are constants), about
``2 · rows · seq · d_model · (heads + kv_heads) · d_head + 2 · rows · heads · d_head · seq²`` — then
graph.py turns the gradients into edges: ``2 · targets · seq · d_model · width`` per layer (the
``W_dec`` product, by far the largest term at real widths) plus the error and embedding dot products.

**Time** = FLOPs / ``flops_per_second`` + the ``max_features`` selection. `CPU_FLOPS` is this
project's calibration: one backward pass of the organism timed on one CPU thread
(``bench/graph_cost.py``); it predicts the organism's whole graph (no ``max_features``) within 1.2×.
`GPU_FLOPS` is an assumption, not a measurement. The selection is not FLOP-bound: per chunk it
allocates, copies and normalises the ``(F + n_logits)²`` square and runs an influence series over it,
on the host whatever the model's device (graph.py's arrays are CPU tensors), so it is timed as
`SELECTION_SECONDS` per square entry per chunk, calibrated on the organism on one thread.
"""

from __future__ import annotations

import math

from countlens.datasets.tasks import MIN_OBJECT_SIZE, count_task_sample, object_sizes
from countlens.errors import InputError
from countlens.model.memory import Widths, widths
from countlens.model.vlm import VLM
from countlens.pipeline.costs import Forward, forward_flops
from countlens.validate import require_count

#: Bytes of one adjacency entry: graph.py builds every row and the square in float32.
ADJACENCY_BYTES = 4

#: d_model-wide vectors per (copy, position, layer) that the frozen forward keeps for the backward
#: passes: the layer's write leaf, the two frozen norms' outputs and the attention output.
KEPT_PER_LAYER = 4

#: (F + n_logits)-square float32 matrices alive while a max_features chunk is chosen: the square
#: itself, the rectangle copied into it, its absolute value and its row-normalised copy.
SELECTION_SQUARES = 4

#: Floating-point operations per second of the organism's graph on one CPU thread here, from one timed
#: backward pass (bench/graph_cost.py, which records the measurement it came from).
CPU_FLOPS = 5.2e10

#: Seconds per entry of the (F + n_logits)² square per max_features chunk, on one CPU thread: the
#: organism's max_features 2000 and 500 graphs (bench/graph_cost.py), less their planned FLOP time.
SELECTION_SECONDS = 3.0e-8

#: An assumed sustained rate on one H200 in bf16: 40 % of its 989 TFLOP/s dense peak (as
#: bench/plan_rehearsal.py assumes); not calibrated (no GPU run of attribution_graph yet).
GPU_FLOPS = 0.4 * 989e12


def graph_cost(
    widths_or_vlm: Widths | VLM,
    seq: int,
    k: int,
    max_features: int | None = None,
    n_logits: int = 10,
    batch_rows: int = 64,
    dtype_bytes: int = 4,
    transcoder_width: int = 512,
    patches: int = 0,
    flops_per_second: float = CPU_FLOPS,
) -> dict:
    """The cost of `attribution_graph` on a prompt of ``seq`` tokens (see the module's docstring).

    ``widths_or_vlm``: a `Widths` or a `countlens.VLM` (loaded or meta). ``k``: active features per
    token (TopK); ``transcoder_width``: features per layer; ``max_features``, ``n_logits`` (logit nodes:
    graph.py's ``max_logits``, or fewer where ``logit_prob`` is reached first) and ``batch_rows``
    (graph.py's ``batch_size``) as `attribution_graph` takes them. ``dtype_bytes``: the model's and the
    transcoders' element size (4 float32, 2 bfloat16). ``patches``: vision patches per image (0: the
    forwards' vision FLOPs left out). Returns a flat dict: node counts, bytes, passes, FLOPs, seconds.
    """
    w = _widths(widths_or_vlm)
    seq = require_count(seq, "seq (tokens of the prompt)")
    k = require_count(k, "k (active features per token)")
    width = require_count(transcoder_width, "transcoder_width (features per layer)")
    if k > width:
        raise InputError(f"k={k} is more than transcoder_width={width}; give k ≤ width")
    if max_features is not None:
        require_count(max_features, "max_features")
    n_logits = require_count(n_logits, "n_logits")
    rows = require_count(batch_rows, "batch_rows")
    if dtype_bytes not in (1, 2, 4, 8):
        raise InputError(f"dtype_bytes must be an element size, 1, 2, 4 or 8 (bfloat16: 2), got {dtype_bytes!r}")
    if isinstance(patches, bool) or not isinstance(patches, int) or patches < 0:
        raise InputError(f"patches must be an integer ≥ 0 (vision patches per image), got {patches!r}")
    if not (isinstance(flops_per_second, (int, float)) and math.isfinite(flops_per_second) and flops_per_second > 0):
        raise InputError(f"flops_per_second must be a finite number > 0, got {flops_per_second!r}")
    from dataclasses import replace

    w = replace(w, act_bytes=dtype_bytes)
    L, d, b, a = w.n_layers, w.d_model, dtype_bytes, ADJACENCY_BYTES
    n_f = L * seq * k
    n_e, n_m = L * seq, seq
    n_src = n_f + n_e + n_m
    kept_f = n_f if max_features is None else min(n_f, max_features)
    dropped = kept_f < n_f
    n_all, n = n_src + n_logits, kept_f + n_e + n_m + n_logits
    logit_passes, feature_passes = -(-n_logits // rows), -(-kept_f // rows)

    feature_rows = n_f * n_src * a
    full = n_all * n_all * a
    square = (n_f + n_logits) ** 2 * a
    selection = SELECTION_SQUARES * square if dropped else 0
    select_copy = (n * n_all + n * n) * a if dropped else 0
    transcoders = L * (2 * width * d + width + d) * b
    kept = rows * seq * d * b * (L * KEPT_PER_LAYER + 2)
    grads = rows * seq * d * (L + 2) * (b + (4 if b != 4 else 0))
    backward = grads + rows * seq * width * 4
    host = feature_rows + max(selection, full + select_copy)
    device = w.weight_bytes + transcoders + kept + backward

    forwards = 2 * forward_flops(w, Forward(1, seq), patches) + forward_flops(w, Forward(rows, seq), patches)
    per_backward = L * rows * (2 * seq * d * (w.n_heads + w.n_kv_heads) * w.d_head + 2 * w.n_heads * w.d_head * seq**2)
    targets = n_logits + kept_f
    edges = targets * L * seq * (2 * d * width + 2 * d) + targets * 2 * seq * d
    chunks = feature_passes if dropped else 0
    choose = chunks * (n_f + n_logits) ** 2 * SELECTION_SECONDS
    flops = forwards + (logit_passes + feature_passes) * per_backward + edges
    return {
        "n_layers": L,
        "d_model": d,
        "seq": seq,
        "k": k,
        "transcoder_width": width,
        "batch_rows": rows,
        "dtype_bytes": b,
        "active_features": n_f,
        "features": kept_f,
        "errors": n_e,
        "embeddings": n_m,
        "logits": n_logits,
        "nodes": n,
        "sources": n_src,
        "adjacency_bytes": n * n * a,
        "filled_rows_bytes": (kept_f + n_logits) * n_src * a,
        "feature_rows_bytes": feature_rows,
        "full_adjacency_bytes": full,
        "selection_bytes": selection,
        "host_bytes": host,
        "weights_bytes": w.weight_bytes,
        "transcoder_bytes": transcoders,
        "kept_bytes": kept,
        "backward_bytes": backward,
        "device_bytes": device,
        "peak_bytes": host + device,
        "logit_passes": logit_passes,
        "feature_passes": feature_passes,
        "backward_passes": logit_passes + feature_passes,
        "forward_flops": forwards,
        "backward_flops": per_backward,
        "edge_flops": edges,
        "flops": flops,
        "flops_per_second": float(flops_per_second),
        "selection_seconds": choose,
        "seconds": flops / flops_per_second + choose,
    }


def min_scene_side() -> int:
    """The smallest image side (px) a graph's counting scene can be seen at: its objects scale with the
    image (`countlens.datasets.tasks.object_sizes`) and must keep `MIN_OBJECT_SIZE` px (32 px), so a
    plan at a smaller ``--image-size`` is of a graph that cannot be built."""
    return math.ceil(MIN_OBJECT_SIZE / object_sizes(1)[0])


def prompt_length(vlm: VLM, count: int = 3, seed: int = 0) -> tuple[int, int]:
    """(tokens, vision patches) of the counting scene ``countlens features graph`` draws
    (`countlens.datasets.tasks.count_task_sample`), prepared by ``vlm``'s own processor — a meta model's
    too, so a plan reads a real checkpoint's sequence length at its image size without weights."""
    batch = vlm.prepare_samples([count_task_sample(count, seed)])
    return int(batch.inputs["input_ids"].shape[1]), int(batch.patches(vlm.arch.merge_size))


def _widths(widths_or_vlm) -> Widths:
    if isinstance(widths_or_vlm, Widths):
        return widths_or_vlm
    if isinstance(widths_or_vlm, VLM):
        return widths(widths_or_vlm)
    raise InputError(
        f"graph_cost takes a Widths (countlens.model.memory.widths(vlm)) or a countlens.VLM (countlens.load, or "
        "countlens.model.loading.meta_vlm for a checkpoint's config without weights); got "
        f"{type(widths_or_vlm).__name__}"
    )
