"""What an attribution graph costs before it is built: nodes, host and device bytes, passes, FLOPs, time.

`graph_cost` counts `attribution_graph` (`countlens.features.graph`) from a model's widths alone (a
loaded model, `countlens.model.memory.Widths`, or a model built on the meta device by
`countlens.model.loading.meta_vlm`: config and processor, no weights), following graph.py step by step:

**Nodes.** ``F = layers × seq × k`` active features (a TopK transcoder keeps k per token; a kept
pre-activation ≤ 0 is zeroed by its ReLU, so F is an upper bound that trained transcoders meet),
``layers × seq`` error nodes, ``seq`` embedding nodes and ``n_logits`` logit nodes; the graph keeps
``M = min(F, max_features)`` features. Sources: ``S = F + layers × seq + seq``.

**Host** (float32, `ADJACENCY_BYTES`, whatever the model's dtype):

- ``buffer``: circuit-tracer's ``edge_matrix``, ``(M + n_logits) × S``, filled row by row;
- ``selection`` (only when ``M < F``): the last ranking's ``(M + n_logits) × M`` block of the known
  rows' own columns (one: `partial_influence` makes its absolute values and scales them in place), and,
  alive beside it, one block of the pass over the rows' feature columns (`BLOCK_ELEMENTS`, or
  ``(M + n_logits) × F`` if fewer);
- ``adjacency``: the graph's ``n × n`` over the kept nodes, filled from the buffer a block at a time
  (one `BLOCK_ELEMENTS` block);
- ``rows``: one backward's rows on their way into the buffer, ``batch_rows × S``, twice (the rows and
  their absolute values for the row sums).

The host peak is the buffer plus the largest of the others (they are not alive at once).

**Device** (the model's): the weights; the transcoders (``layers × (2 × width × d_model + width +
d_model)`` parameters); the clean run's ``records`` (per layer the MLP input, output, error and write,
``seq × d_model`` each, and the pre-activations and activations, ``seq × width`` each, in the
transcoders' dtype); the ``decoders``, every active feature's ``a_f W_dec[f]`` padded by position,
``F × d_model`` float32; ``kept``: the frozen forward over ``batch_rows`` copies that every backward
reuses, `KEPT_PER_LAYER` d_model-wide vectors per copy, position and layer plus `KEPT_FIXED`; then the larger
of ``forward``, that forward's own transient (`countlens.pipeline.costs.forward_bytes`: a layer's
live set, the vision tower's, the logits), and ``backward``, one pass's transient: every leaf's
gradient (``layers + 1``), the injected gradients (one per target layer, at most ``min(layers,
batch_rows)``), a layer's gradient in float32 and the rows, twice.
On the CPU the device is the host: the peak is their sum.

**Passes.** ``ceil(n_logits / batch_rows)`` backward passes for the logit rows, then
``ceil(M / batch_rows)`` for the feature rows; ``ceil(M / (update_interval × batch_rows))`` rankings.

**FLOPs.** The forwards are `countlens.pipeline.costs.forward_flops`'s (two of one row: the clean run
and the all-sources-zero run; one of ``batch_rows`` rows with the vision tower per copy). A backward
runs only through what the local replacement model keeps live — per layer ``v_proj``, the frozen
attention pattern and ``o_proj`` — about ``2 · rows · seq · d_model · (heads + kv_heads) · d_head + 2 ·
rows · heads · d_head · seq²``; then each target row's edges: ``2 · F · d_model`` (the batched product
with the padded decoders) plus ``2 · (layers + 1) · seq · d_model`` (errors and embeddings).

**Time** = FLOPs / ``flops_per_second`` + `PASS_SECONDS` per backward pass and layer + the rankings,
which run on the host whatever the model's device (the buffer lives there) and are memory-bound:
each reads its known rows once (``k × S`` entries, ``k`` the rows known) and iterates on their
``k × M`` block (``layers + 1`` times at most), timed at `SELECTION_SECONDS` per entry. `CPU_FLOPS`,
`PASS_SECONDS` and `SELECTION_SECONDS` are calibrated on one CPU thread here (``bench/graph_rehearsal.py``,
``bench/graph_cost.py``); `GPU_FLOPS` is an assumption, not a measurement, and so is `PASS_SECONDS`
on a GPU.
"""

from __future__ import annotations

import math

from countlens.datasets.tasks import MIN_OBJECT_SIZE, count_task_sample, object_sizes
from countlens.errors import InputError
from countlens.features.influence import BLOCK_ELEMENTS, UPDATE_INTERVAL
from countlens.model.memory import Widths, widths_of
from countlens.model.vlm import VLM
from countlens.pipeline.costs import Forward, forward_bytes, forward_flops
from countlens.validate import require_count

#: Bytes of one buffer or adjacency entry: graph.py builds every row and the adjacency in float32.
ADJACENCY_BYTES = 4

#: d_model-wide vectors per (copy, position, layer) that the frozen forward keeps for the backward
#: passes: the layer's write leaf, the frozen norms' outputs, what attention saves (q, k and v
#: repeated to every head, its output and o_proj's input) and the allocator's slack: fitted on
#: bench/graph_rehearsal.py's depth 1 → 2 growth at 7B widths (about 9 named, 12 measured).
KEPT_PER_LAYER = 12

#: d_model-wide vectors per (copy, position) kept whatever the depth: the embedding leaf, the final
#: norm's output, the copies' prepared inputs and the vision tower's merged output: fitted on
#: bench/graph_rehearsal.py's depth-1 peak at 7B widths.
KEPT_FIXED = 10

#: Floating-point operations per second of one CPU thread here at 7B widths: bench/graph_rehearsal.py's
#: graphs at depths 1 and 2 (two runs on the shared 2-core CPU, planned FLOPs over measured seconds:
#: 73–94 GFLOP/s, their mean).
CPU_FLOPS = 7.9e10

#: Seconds per backward pass and layer besides the FLOPs (hooks, Python, small kernels): the organism's
#: feature pass (bench/graph_cost.py, 6 layers, one thread) less its FLOPs at `CPU_FLOPS`, 0.8–3.8 ms
#: over two runs on the shared CPU. It is what makes the organism's small matrices slower per FLOP.
PASS_SECONDS = 2e-3

#: Seconds per planned entry of a max_features ranking on one CPU thread (the known rows' absolute
#: values and their product with the weights, a block at a time; the series on their own block):
#: bench/graph_cost.py's ranking calibration (bench/graph_cost.json's ``ranking_calibration``, the
#: median of three calls each): 1.33e-9 and 1.44e-9 at 7B's source count (k 4096 and 2048 rows known),
#: rounded up; 0.83e-9 at the organism's (an earlier run of step 3 alone: 1.26–1.50e-9 at all three).
SELECTION_SECONDS = 1.4e-9

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
    update_interval: int = UPDATE_INTERVAL,
) -> dict:
    """The cost of `attribution_graph` on a prompt of ``seq`` tokens (see the module's docstring).

    ``widths_or_vlm``: a `Widths` or a `countlens.VLM` (loaded or meta). ``k``: active features per
    token (TopK); ``transcoder_width``: features per layer; ``max_features``, ``n_logits`` (logit nodes:
    graph.py's ``max_logits``, or fewer where ``logit_prob`` is reached first), ``batch_rows``
    (graph.py's ``batch_size``) and ``update_interval`` as `attribution_graph` takes them.
    ``dtype_bytes``: the model's and the transcoders' element size (4 float32, 2 bfloat16).
    ``patches``: vision patches per image (0: the forwards' vision FLOPs left out). Returns a flat
    dict: node counts, bytes (``host_bytes``, ``device_bytes``, ``peak_bytes`` their sum), passes,
    FLOPs, seconds.
    """
    w = widths_of(widths_or_vlm, "graph_cost")
    seq = require_count(seq, "seq (tokens of the prompt)")
    k = require_count(k, "k (active features per token)")
    width = require_count(transcoder_width, "transcoder_width (features per layer)")
    if k > width:
        raise InputError(f"k={k} is more than transcoder_width={width}; give k ≤ width")
    if max_features is not None:
        require_count(max_features, "max_features")
    n_logits = require_count(n_logits, "n_logits")
    rows = require_count(batch_rows, "batch_rows")
    interval = require_count(update_interval, "update_interval")
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
    n = kept_f + n_e + n_m + n_logits
    logit_passes, feature_passes = -(-n_logits // rows), -(-kept_f // rows)

    buffer = (kept_f + n_logits) * n_src * a
    selection = ((kept_f + n_logits) * kept_f + min(BLOCK_ELEMENTS, (kept_f + n_logits) * n_f)) * a
    selection = selection if dropped else 0
    adjacency = n * n * a
    assembly = min(BLOCK_ELEMENTS, (kept_f + n_logits) * n) * a
    row_bytes = 2 * rows * n_src * a
    host = buffer + max(selection, adjacency + assembly, row_bytes)

    transcoders = L * (2 * width * d + width + d) * b
    records = L * seq * (4 * d + 2 * width) * b + seq * d * b
    decoders = n_f * d * 4
    kept = rows * seq * d * b * (L * KEPT_PER_LAYER + KEPT_FIXED)
    grads = rows * seq * d * b * (L + 1 + min(L, rows))
    backward = grads + rows * seq * d * 4 + row_bytes
    forward = forward_bytes(w, Forward(rows, seq), patches)
    device = w.weight_bytes + transcoders + records + decoders + kept + max(forward, backward)

    forwards = 2 * forward_flops(w, Forward(1, seq), patches) + forward_flops(w, Forward(rows, seq), patches)
    per_backward = L * rows * (2 * seq * d * (w.n_heads + w.n_kv_heads) * w.d_head + 2 * w.n_heads * w.d_head * seq**2)
    targets = n_logits + kept_f
    edges = targets * (2 * n_f * d + 2 * (L + 1) * seq * d)
    rankings = -(-kept_f // (rows * interval)) if dropped else 0
    known = [n_logits + i * rows * interval for i in range(rankings)]  # rows known at each ranking
    entries = sum(r * n_src + (L + 1) * r * min(kept_f, r) for r in known)
    choose = entries * SELECTION_SECONDS
    flops = forwards + (logit_passes + feature_passes) * per_backward + edges
    return {
        "n_layers": L,
        "d_model": d,
        "seq": seq,
        "k": k,
        "transcoder_width": width,
        "batch_rows": rows,
        "update_interval": interval,
        "dtype_bytes": b,
        "active_features": n_f,
        "features": kept_f,
        "errors": n_e,
        "embeddings": n_m,
        "logits": n_logits,
        "nodes": n,
        "sources": n_src,
        "buffer_bytes": buffer,
        "selection_bytes": selection,
        "adjacency_bytes": adjacency,
        "host_bytes": host,
        "weights_bytes": w.weight_bytes,
        "transcoder_bytes": transcoders,
        "records_bytes": records,
        "decoder_bytes": decoders,
        "kept_bytes": kept,
        "forward_bytes": forward,
        "backward_bytes": backward,
        "device_bytes": device,
        "peak_bytes": host + device,
        "logit_passes": logit_passes,
        "feature_passes": feature_passes,
        "backward_passes": logit_passes + feature_passes,
        "rankings": rankings,
        "forward_flops": forwards,
        "backward_flops": per_backward,
        "edge_flops": edges,
        "flops": flops,
        "flops_per_second": float(flops_per_second),
        "selection_seconds": choose,
        "pass_seconds": (logit_passes + feature_passes) * L * PASS_SECONDS,
        "seconds": flops / flops_per_second + (logit_passes + feature_passes) * L * PASS_SECONDS + choose,
    }


#: The command-line option of each knob `fitting_knob` names (``features plan`` and ``features graph``).
OPTIONS = {"batch_rows": "--batch-size", "max_features": "--max-features"}


def fitting_knob(plan: dict, limit: float, key: str = "device_bytes") -> str:
    """What makes the plan ``graph_cost(**plan)`` fit ``limit`` bytes of ``key`` (``host_bytes``,
    ``device_bytes`` or ``peak_bytes``): the first of --max-features (the host's row buffer) and
    --batch-size (``batch_rows``: the device's kept forward and backward pass), for the host in that
    order, else the other, halved until it fits; or that neither does. Knobs are named as
    ``countlens features plan`` and ``features graph`` take them."""
    c = graph_cost(**plan)
    now = {"batch_rows": c["batch_rows"], "max_features": c["features"]}
    knobs = ("max_features", "batch_rows") if key == "host_bytes" else ("batch_rows", "max_features")
    for knob in knobs:
        value = now[knob]
        while value > 1:
            value //= 2
            if graph_cost(**{**plan, **now, knob: value})[key] <= limit:
                return f"it fits with {OPTIONS[knob]} {value}"
    floor = "its smallest buffers are over" if key == "host_bytes" else "the weights and transcoders alone are over"
    return f"no --batch-size or --max-features makes it fit ({floor}): more memory"


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
