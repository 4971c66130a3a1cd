"""What training transcoders costs before it runs: time, device memory, host and disk bytes.

`countlens.features.train_transcoders` trains one TopK transcoder per layer, one layer after the
other, from the MLP activations of a data mix. `transcoder_cost` counts it from a model's widths
alone (a `countlens.model.memory.Widths`, a loaded model, or a model built on the meta device by
`countlens.model.loading.meta_vlm`), following train.py step by step. With ``d`` the model's width,
``W`` the transcoder's (features), ``B`` = ``batch_tokens``, ``L`` the layers trained:

**Device memory** (the transcoder's dtype, float32 as train.py trains): the parameters
``P = 2·W·d + W + d``, their gradients and Adam's two moments: ``4·P`` elements; one step's work,
`STEP_WIDE` ``(B, W)`` arrays (the pre-activations, the TopK output and the zeros it is scattered into,
AuxK's masked copy, its zeros and output, and the gradients of the three that need one) and
`STEP_NARROW` ``(B, d)`` ones (the batch's inputs and outputs, the reconstruction, AuxK's error
and their gradients). Only one layer's transcoder is on the device at a time.

**Host memory.** In memory (while that is ≤ ``max_memory``): both splits, every layer, float32:
``tokens × (1 + held_out) × 2 × L × d × 4``. Streamed: while collecting, at most
``max_memory`` plus one collection batch of every layer, in the store's dtype; while training, one
layer of one chunk as float32.

**Disk** (streamed only): the store, both splits, every layer, in the store's dtype (the model's
where it is bfloat16 or float16, else float32): ``tokens × (1 + held_out) × 2 × L × d × bytes``;
training reads about ``steps × B × 2 × d × bytes`` of it per layer (a chunk per visit,
``ceil(chunk tokens / B)`` steps per visit).

**FLOPs** per step: the encoder and the dense decoder, forward ``4·B·d·W``, backward ``6·B·d·W``
(``W_dec``, the activations, ``W_enc``): `STEP_FLOPS_PER` ``= 10`` × ``B·d·W``; from step
``DEAD_AFTER + 1`` (51) on, AuxK's decoder product adds forward ``2·B·d·W`` and backward ``4·B·d·W``,
`AUXK_FLOPS_PER` ``= 6`` × ``B·d·W`` (counted on every such step: an upper bound, it runs while any
feature is dead). Adam and the decoder's renormalisation are ``O(P)``, below 1 % at ``B`` ≥ 512,
left out. The collection's forwards are `countlens.pipeline.costs.forward_flops`'s, one
per sample of each split, logits at every position (as the collection's plain forward computes them).

**Time** = training FLOPs / the step rate + collection FLOPs / the forward rate. `CPU_STEP_FLOPS` and
`CPU_FORWARD_FLOPS` are measured (``bench/transcoder_rehearsal.py``, on one thread of this project's
CPU: a step at 7B widths with AuxK, one forward of a 7B-width depth-1 model); `GPU_STEP_FLOPS` and the
forwards' GPU rate (`countlens.pipeline.graph_cost.GPU_FLOPS`) are assumptions, not measurements: no
transcoder has trained on a GPU here. Disk reads are not timed (the rehearsal measures them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from countlens.errors import InputError
from countlens.features.activation_store import MAX_MEMORY, in_memory_bytes, require_memory, streams
from countlens.features.activations import check_mix, encode_texts, held_out_mix, mix_samples
from countlens.features.train import BATCH_TOKENS, DEAD_AFTER, STEPS
from countlens.model.memory import Widths, widths, widths_of
from countlens.model.vlm import VLM
from countlens.pipeline.costs import Forward, forward_flops
from countlens.pipeline.graph_cost import GPU_FLOPS
from countlens.progress import duration_text
from countlens.validate import require_count, require_integer, require_share

#: ``(B, W)`` float32 arrays alive at a training step's peak (the module's docstring).
STEP_WIDE = 8
#: ``(B, d)`` float32 arrays alive at a training step's peak.
STEP_NARROW = 8
#: FLOPs of one step, per ``B·d·W``: encoder and decoder forward 4, backward 6.
STEP_FLOPS_PER = 10
#: AuxK's FLOPs per ``B·d·W`` on a step after `DEAD_AFTER`: forward 2, backward 4.
AUXK_FLOPS_PER = 6
#: Training-step FLOP/s on one CPU thread here: a float32 step at d_model 3,584, width 16,384, 512
#: tokens, AuxK on (bench/transcoder_rehearsal.json's ``rate``: 8.2e10–8.4e10 in two runs; 8.1e10–8.6e10
#: at smaller widths).
CPU_STEP_FLOPS = 8.3e10
#: Forward FLOP/s on one CPU thread here: one float32 forward of a counting scene through a depth-1
#: Qwen2.5-VL at 7B widths, 448 px (bench/transcoder_rehearsal.json's ``forward_rate``: 9.2e10; a
#: whole collection of the run before gave 9.0e10, kept).
CPU_FORWARD_FLOPS = 9.0e10
#: An assumed float32 rate of one H100/H200 for the step (no TF32: torch's default for float32
#: matmuls): 40 % of the 67 TFLOP/s FP32 peak. Not measured.
GPU_STEP_FLOPS = 0.4 * 67e12
GIB = 2**30


def transcoder_cost(
    widths_or_vlm: Widths | VLM,
    tokens: int,
    width: int = 16384,
    k: int = 16,
    steps: int = STEPS,
    batch_tokens: int = BATCH_TOKENS,
    layers: int | None = None,
    held_out: float = 0.25,
    max_memory: float = MAX_MEMORY,
    collection_flops: float = 0.0,
    store_bytes: int | None = None,
    device: str = "cpu",
    collect_batch: int = 32,
    seq: int = 0,
    held_out_tokens: int | None = None,
) -> dict:
    """The cost of `train_transcoders` (see the module's docstring) on ``tokens`` training tokens.

    ``layers``: how many layers are trained (None: every layer). ``collection_flops``: the forwards of
    both splits (`mix_forwards`). ``store_bytes``: the store's element size (None: the model's, 2 for
    bfloat16 and float16, else 4). ``device``: "cpu" (calibrated rates) or "cuda" (assumed rates).
    ``collect_batch`` × ``seq``: one collection batch's tokens (the collection's host peak).
    ``held_out_tokens``: the held-out split's tokens (`mix_forwards`; None: ``ceil(tokens × held_out)``).
    Returns a flat dict of counts, bytes, FLOPs and seconds."""
    w = widths_of(widths_or_vlm, "transcoder_cost")
    tokens = require_count(tokens, "tokens (training tokens)")
    width = require_count(width, "width (features per layer)")
    k = require_count(k, "k (active features per token)")
    if k > width:
        raise InputError(f"k={k} is more than width={width}; give k ≤ width")
    steps, b = require_count(steps, "steps"), require_count(batch_tokens, "batch_tokens")
    n_layers = w.n_layers if layers is None else require_count(layers, "layers (how many)")
    if n_layers > w.n_layers:
        raise InputError(f"layers={n_layers} is more than the model's {w.n_layers}; give at most {w.n_layers}")
    require_share(held_out, "held_out", below_one=True, above_zero=True)
    max_memory = require_memory(max_memory)
    require_count(collect_batch, "collect_batch (samples per collection forward)")
    require_integer(seq, "seq (tokens of the longest sample: mix_forwards; 0 leaves the batch out)", low=0)
    if device not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda' (the rate the time is planned at), got {device!r}")
    if not (isinstance(collection_flops, (int, float)) and 0 <= collection_flops < math.inf):
        raise InputError(f"collection_flops must be a finite number ≥ 0 (mix_forwards), got {collection_flops!r}")
    e = (2 if w.act_bytes == 2 else 4) if store_bytes is None else store_bytes
    if e not in (2, 4):
        raise InputError(f"store_bytes must be 2 (bfloat16, float16) or 4 (float32), got {store_bytes!r}")
    d, L = w.d_model, n_layers
    params = 2 * width * d + width + d
    state = 4 * params * 4
    work = (STEP_WIDE * b * width + STEP_NARROW * b * d) * 4
    held = math.ceil(tokens * held_out) if held_out_tokens is None else held_out_tokens
    if isinstance(held, bool) or not isinstance(held, int) or held < 0:
        raise InputError(f"held_out_tokens must be an integer ≥ 0 (mix_forwards), got {held_out_tokens!r}")
    all_tokens = tokens + held
    per_token = 2 * L * d
    streamed = streams(all_tokens, L, d, max_memory)  # train_transcoders' own rule
    store = all_tokens * per_token * e if streamed else 0
    batch = collect_batch * seq * per_token * e
    chunk_tokens = math.ceil((max_memory + batch) / (per_token * e))
    chunk = min(chunk_tokens, tokens) * 2 * d * 4
    host = max(max_memory + batch, chunk) if streamed else in_memory_bytes(all_tokens, L, d)
    step_flops = STEP_FLOPS_PER * b * d * width
    aux_steps = max(0, steps - DEAD_AFTER)
    train_flops = L * (steps * step_flops + aux_steps * AUXK_FLOPS_PER * b * d * width)
    step_rate = GPU_STEP_FLOPS if device == "cuda" else CPU_STEP_FLOPS
    forward_rate = GPU_FLOPS if device == "cuda" else CPU_FORWARD_FLOPS
    return {
        "d_model": d,
        "layers": L,
        "width": width,
        "k": k,
        "steps": steps,
        "batch_tokens": b,
        "tokens": tokens,
        "held_out_tokens": all_tokens - tokens,
        "streamed": streamed,
        "params": params,
        "state_bytes": state,
        "step_bytes": work,
        "device_bytes": state + work,
        "chunk_bytes": chunk if streamed else 0,
        "host_bytes": host,
        "store_bytes": store,
        "read_bytes_per_layer": steps * b * 2 * d * e if streamed else 0,
        "step_flops": step_flops,
        "train_flops": train_flops,
        "collection_flops": float(collection_flops),
        "train_seconds": train_flops / step_rate,
        "collection_seconds": collection_flops / forward_rate,
        "seconds": train_flops / step_rate + collection_flops / forward_rate,
        "step_rate": step_rate,
        "forward_rate": forward_rate,
    }


def mix_forwards(vlm: VLM, mix: Mapping[str, int] | None = None, seed: int = 0, held_out: float = 0.25) -> dict:
    """The training and held-out splits' tokens, both splits' forward FLOPs and the longest sample (tokens) of
    ``mix`` (default `countlens.features.activations.DEFAULT_MIX`) at ``vlm``'s processor, from the
    first sample of each kind (processor only: a meta model's works)."""
    mix = check_mix(mix)
    w = widths(vlm)
    scenes, texts = mix_samples({kind: min(n, 1) for kind, n in mix.items()}, seed)
    per = {}
    for s in scenes:
        batch = vlm.prepare_samples([s])
        per[s.task] = (int(batch.inputs["attention_mask"].sum()), int(batch.patches(vlm.arch.merge_size)))
    if texts:
        per["text"] = (int(encode_texts(vlm, texts[:1])["attention_mask"].sum()), 0)
    both = {kind: n + held_out_mix(mix, held_out)[kind] for kind, n in mix.items()}
    flops = sum(
        n * forward_flops(w, Forward(1, per[kind][0], keep=per[kind][0], images=int(kind != "text")), per[kind][1])
        for kind, n in both.items()
        if n
    )
    tokens = sum(n * per[kind][0] for kind, n in mix.items() if n)
    held = sum(n * per[kind][0] for kind, n in held_out_mix(mix, held_out).items() if n)
    return {"tokens": tokens, "held_out_tokens": held, "flops": flops, "seq": max(seq for seq, _ in per.values())}


def training_plan_lines(
    vlm: VLM,
    width: int = 16384,
    k: int = 16,
    steps: int = STEPS,
    batch_tokens: int = BATCH_TOKENS,
    layers: int | None = None,
    device: str = "cpu",
    max_memory: float = MAX_MEMORY,
    mix: Mapping[str, int] | None = None,
) -> list[str]:
    """Printable lines of `transcoder_cost` for ``vlm`` (meta or loaded) on ``mix``'s tokens: what
    ``countlens features plan`` shows of training transcoders."""
    data = mix_forwards(vlm, mix)
    c = transcoder_cost(
        vlm,
        data["tokens"],
        width=width,
        k=k,
        steps=steps,
        batch_tokens=batch_tokens,
        layers=layers,
        max_memory=max_memory,
        collection_flops=data["flops"],
        device=device,
        seq=data["seq"],
        held_out_tokens=data["held_out_tokens"],
    )
    rate = "an assumed rate, not measured" if device == "cuda" else "calibrated on one CPU thread"
    gib = lambda n: f"{n / GIB:,.1f} GiB"  # noqa: E731
    lines = [
        f"transcoders: {c['layers']} layers × {c['width']:,} features (k {c['k']}) on d_model {c['d_model']:,}; "
        f"{c['steps']:,} steps of {c['batch_tokens']:,} tokens per layer",
        f"  data: {c['tokens']:,} training tokens + {c['held_out_tokens']:,} held out; "
        + (
            f"streamed from disk: a store of {gib(c['store_bytes'])} ({gib(c['store_bytes'] / c['layers'])} per "
            f"layer: fewer layers per run need less), {gib(c['read_bytes_per_layer'])} read per layer"
            if c["streamed"]
            else "held in memory"
        ),
        f"  device: {gib(c['device_bytes'])} (transcoder, gradients and Adam {gib(c['state_bytes'])}; "
        f"one step's work {gib(c['step_bytes'])})",
        f"  host: {gib(c['host_bytes'])} of activations"
        + (f" (max_memory {gib(max_memory)}; one chunk of one layer {gib(c['chunk_bytes'])})" if c["streamed"] else ""),
        f"  time ({device}, {rate}): training {duration_text(c['train_seconds'])} "
        f"({c['train_flops']:.2e} FLOPs), collection {duration_text(c['collection_seconds'])} "
        f"({c['collection_flops']:.2e} FLOPs)",
    ]
    return lines
