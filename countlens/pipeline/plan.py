"""A memory and time plan for `countlens discover`: per stage, its forwards, peak memory and FLOPs.

Nothing runs on the model: the plan reads the model's modules (a loaded model, or one built on the
meta device from a checkpoint's config), prepares one batch of each stage's own samples to learn
its sequence length, and counts.

**FLOPs** of a forward: 2 × every ``Linear`` weight × the tokens it sees (decoder layers: every
token; vision blocks: every patch; projector: every image token; ``lm_head``: the positions whose
logits are kept; patch embedding: every patch) plus attention, 4·S²·(heads·d_head) per decoder layer
and row and 4·P²·width per vision block and image (full attention: an upper bound for windowed
blocks; a class token's position is not counted). Exact against torch's FLOP counter on eager
attention for Qwen2-VL (``tests/unit/test_plan.py``).

**Memory** of a stage: weights + the runtime's base + what the stage keeps across its forwards
(corrupt caches, saved activations, edit values) + the largest transient of one of its forwards.
A decoder forward of R rows × S tokens holds about R·S·(3·d_ff + 4·d_model) activations at once
(the MLP's three d_ff-wide tensors beside the residual stream); eager attention adds
R·heads·S² scores (in the model's dtype and as float32); the kept logits R·keep·vocab twice (dtype
and float32); a KV cache 2·layers·R·S·kv_heads·d_head; a backward pass the activations each
layer saves for it, about R·S·(4·d_ff + 6·d_model) per layer; a batch-expanded forward, per row,
the stacked input of its first layer and (its vision tower skipped) the row's pixel values and a
copy of the tower's output. The vision tower's transient is the same count as a decoder layer's at
its own widths over the batch's patches. These are countlens's own estimates; the
7B-width rehearsal (``bench/plan_rehearsal.py``) measures them against peak RSS.

Row sizing of the sweeps (`rows_per_forward`, `Widths`) lives in `countlens.memory`; this module
plans the stages above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from countlens.analysis.evaluate import candidate_sets
from countlens.answers import answer_window, read_rows
from countlens.circuits.pair_batch import prepare_pairs
from countlens.errors import ConfigError
from countlens.memory import MAX_ROWS, Widths, free_bytes, replica_copy_bytes, resident_bytes, rows_per_forward, widths
from countlens.pipeline.config import DiscoverConfig, resolved_prompt
from countlens.pipeline.discover import check, stage_inputs

if TYPE_CHECKING:
    from countlens.vlm import VLM


@dataclass(frozen=True)
class Forward:
    """One kind of forward a stage runs ``count`` times: ``rows`` × ``seq`` tokens through ``layers``
    decoder layers (None: all), logits kept at ``keep`` positions, ``images`` images through the
    vision tower (None: one per row; 0 when a sweep feeds the tower's output back in)."""

    rows: int
    seq: int
    count: int = 1
    keep: int = 1
    layers: int | None = None
    images: int | None = None
    eager: bool = False
    cache: bool = False  # builds a KV cache
    context: int = 0  # earlier positions attended through a KV cache (continuations)
    grad: bool = False  # activations kept for a backward pass
    extra: int = 0  # further transient bytes (e.g. logits post-processing)


def forward_flops(w: Widths, f: Forward, patches: int) -> float:
    """FLOPs of one forward (``patches``: vision patches per image)."""
    layers = w.n_layers if f.layers is None else f.layers
    images = f.rows if f.images is None else f.images
    tokens = f.rows * f.seq
    text = 2 * w.layer_linear * layers / w.n_layers * tokens
    text += 4 * f.rows * f.seq * (f.seq + f.context) * w.n_heads * w.d_head * layers
    head = 2 * w.lm_head * f.rows * f.keep
    merged = patches // (w.merge * w.merge)
    vision = images * (
        2 * (w.vision_linear + w.patch_embed) * patches
        + 2 * w.projector_linear * merged
        + 4 * patches**2 * w.vision_width * w.vision_blocks
    )
    if f.grad:  # backward through activations only: about twice the forward's matmuls
        text, head = 3 * text, 3 * head
    return float(text + head + vision)


def forward_bytes(w: Widths, f: Forward, patches: int) -> int:
    """Peak transient bytes of one forward: the largest of its layers' live sets, plus logits,
    cache and what a backward pass keeps."""
    b, tokens = w.act_bytes, f.rows * f.seq
    layer = tokens * (3 * w.d_ff + 4 * w.d_model) * b
    if f.eager:
        scores = f.rows * w.n_heads * f.seq * (f.seq + f.context) * (2 * b + 4)
        layer = max(layer, tokens * 4 * w.d_model * b + scores)
    images = f.rows if f.images is None else f.images
    vision = images * patches * (3 * w.vision_ff + 4 * w.vision_width) * b
    logits = f.rows * f.keep * w.vocab * (b + 4)
    cache = 2 * w.n_layers * f.rows * (f.seq + f.context) * w.n_kv_heads * w.d_head * b if f.cache or f.context else 0
    saved = (w.n_layers if f.layers is None else f.layers) * tokens * (4 * w.d_ff + 6 * w.d_model) * b if f.grad else 0
    return int(max(layer, vision) + logits + cache + saved + f.extra)


@dataclass
class StagePlan:
    """A stage's forwards and what it keeps across them, on the device and on the host."""

    name: str
    forwards: list[Forward]
    kept: int = 0  # bytes held across the stage's forwards, on the model's device
    host: int = 0  # bytes held in host memory (on a CPU model: the same memory)
    rows: int = 0  # rows per stacked forward (the sweeps)
    batch: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """Per-stage plans for one model, configuration and memory budget (`plan`)."""

    model: str
    widths: Widths
    image_size: int
    patches: int  # vision patches per image
    base: int  # the runtime's own memory (CPU: the resident set less the weights)
    free: int  # memory the sweeps' rows were sized from
    device: str
    stages: list[StagePlan]
    memory: int  # the device's memory in all

    def over(self) -> list[str]:
        """Stages whose planned peak exceeds the device's memory."""
        return [s.name for s in self.stages if self.peak(s) > self.memory]

    def peak(self, s: StagePlan) -> int:
        """Peak bytes of stage ``s`` on the model's device (on the CPU, host memory included)."""
        transient = max(forward_bytes(self.widths, f, self.patches) for f in s.forwards)
        host = s.host if self.device == "cpu" else 0
        return self.widths.weight_bytes + self.base + s.kept + host + transient

    def flops(self, s: StagePlan) -> float:
        return sum(f.count * forward_flops(self.widths, f, self.patches) for f in s.forwards)

    def table(self):
        """A pandas DataFrame, one row per stage."""
        import pandas as pd

        gib = 1 << 30
        rows = [
            {
                "stage": s.name,
                "forwards": sum(f.count for f in s.forwards),
                "rows": max(f.rows for f in s.forwards),
                "tokens": max(f.seq for f in s.forwards),
                "batch": s.batch,
                "kept_gib": round(s.kept / gib, 3),
                "host_gib": round(s.host / gib, 3),
                "peak_gib": round(self.peak(s) / gib, 2),
                "tflop": round(self.flops(s) / 1e12, 3),
            }
            for s in self.stages
        ]
        return pd.DataFrame(rows).set_index("stage")

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {
            "model": self.model,
            "device": self.device,
            "memory_bytes": self.memory,
            "image_size": self.image_size,
            "patches": self.patches,
            "weights_bytes": self.widths.weight_bytes,
            "base_bytes": self.base,
            "free_bytes": self.free,
            "widths": asdict(self.widths),
            "stages": {
                s.name: {
                    "peak_bytes": self.peak(s),
                    "flops": self.flops(s),
                    "kept_bytes": s.kept,
                    "host_bytes": s.host,
                    "rows": max(f.rows for f in s.forwards),
                    "forwards": sum(f.count for f in s.forwards),
                    "notes": s.notes,
                }
                for s in self.stages
            },
        }


def _chunk_sizes(n: int, size: int) -> dict[int, int]:
    """{chunk length: how many chunks} of ``n`` items in chunks of ``size``."""
    sizes = {size: n // size} if n >= size else {}
    if n % size:
        sizes[n % size] = 1
    return sizes


def _stacked(
    w: Widths,
    firsts: list[int],
    n: int,
    seq: int,
    rows: int,
    keep: int,
    count: int,
    patches: int,
    extra_per_row: int = 0,
) -> list[Forward]:
    """The stacked forwards of `run_edits` over replicas whose lowest edited layers are ``firsts``:
    sorted, ``rows // n`` replicas a pass, layers below a pass's first edit skipped."""
    per_pass = max(1, rows // n)
    order = sorted(firsts)
    out = []
    for i in range(0, len(order), per_pass):
        k = len(order[i : i + per_pass])
        out.append(
            Forward(
                k * n,
                seq,
                count=count,
                keep=keep,
                layers=w.n_layers - max(0, order[i]),
                images=0,
                extra=k * n * (extra_per_row + replica_copy_bytes(w, seq, patches)),
            )
        )
    return out


def _sweep_rows(w: Widths, seq: int, free: int, kept: int, keep: int, patches: int) -> int:
    return rows_per_forward(w, seq, max(0, free - kept), keep, patches)


class _Planner:
    """Builds each discover stage's `StagePlan` from the stage's own samples."""

    def __init__(self, vlm: VLM, config, free: int):
        self.vlm, self.c, self.free = vlm, config, free
        self.w = widths(vlm)
        self._make = stage_inputs(vlm, config, resolved_prompt(vlm, config))
        self._made: dict[str, object] = {}
        self.bs = config.batch_size
        first = self.samples("pairs")[0].clean
        self.patches = vlm.prepare([first.image], [first.question]).patches(self.w.merge)
        pairs = self.samples("pairs")
        self.pair_seq = int(prepare_pairs(vlm, pairs[: self.bs]).clean.inputs["input_ids"].shape[1])

    def samples(self, name: str):
        """A stage's samples (`countlens.pipeline.discover.stage_inputs`), made once: several stages share them."""
        if name not in self._made:
            self._made[name] = self._make[name]()
        return self._made[name]

    def _seq(self, samples, forced: bool = False) -> int:
        chunk = samples[: self.bs]
        batch = self.vlm.prepare_samples(chunk, teacher_force=forced)
        return int(batch.inputs["input_ids"].shape[1])

    def score(self, name: str, samples, times: int = 1) -> StagePlan:
        vlm, w, seq = self.vlm, self.w, self._seq(samples)
        if all(len(vlm.answer_ids(str(s.answer))) == 1 for s in samples):
            fw = [Forward(n, seq, count=k * times) for n, k in _chunk_sizes(len(samples), self.bs).items()]
            return StagePlan(name, fw, batch=self.bs, notes=["single-token scoring"])
        sets = {tuple(sorted(c)) for c in candidate_sets(samples, None)}
        prefixes = [read_rows([vlm.answer_ids(t) for t in cands]) for cands in sets]
        per = max(len(p) for p in prefixes)
        width = max(len(x) for p in prefixes for x in p)
        step = max(1, min(self.bs, MAX_ROWS // per))
        fw = []
        for n, k in _chunk_sizes(len(samples), step).items():
            fw.append(Forward(n, seq, count=k * times, cache=True))
            if width:
                fw.append(
                    Forward(
                        n * per,
                        width,
                        count=k * times,
                        keep=width,
                        images=0,
                        context=seq,
                        extra=n * per * width * w.vocab * 8,
                    )
                )
        return StagePlan(name, fw, batch=step, notes=[f"candidate scoring: {per} rows a sample, {width} forced tokens"])

    def _patching(self, name: str, firsts: list[int]) -> StagePlan:
        w, b, seq = self.w, self.w.act_bytes, self.pair_seq
        pairs = self.samples("pairs")
        n0 = min(self.bs, len(pairs))
        dz = w.n_heads * w.d_head
        starts = len({f for f in firsts if f >= 1})
        kept = lambda n: n * seq * ((w.n_layers + 1) * w.d_model + w.n_layers * dz + starts * w.d_model) * b  # noqa: E731
        rows = _sweep_rows(w, seq, self.free, kept(n0), 1, self.patches)
        fw = []
        for n, k in _chunk_sizes(len(pairs), self.bs).items():
            fw += [Forward(n, seq, count=3 * k)]  # corrupt cache, clean logits, the clean pre-pass
            fw += _stacked(w, firsts, n, seq, rows, 1, k, self.patches)
        return StagePlan(name, fw, kept=kept(n0), rows=rows, batch=self.bs)

    def vap(self) -> StagePlan:
        return self._patching("vap", [la for la in range(-1, self.w.n_layers) for _ in range(3)])

    def heads(self) -> StagePlan:
        return self._patching("heads", [la for la in range(self.w.n_layers) for _ in range(self.w.n_heads)])

    def atp(self) -> StagePlan:
        w, b, seq = self.w, self.w.act_bytes, self.pair_seq
        pairs = self.samples("pairs")
        n0 = min(self.bs, len(pairs))
        per_layer = n0 * seq * (w.d_model + w.n_heads * w.d_head) * b
        fw = []
        for n, k in _chunk_sizes(len(pairs), self.bs).items():
            fw += [Forward(n, seq, count=k), Forward(n, seq, count=k, grad=True, extra=2 * w.n_layers * per_layer)]
        return StagePlan("atp", fw, kept=w.n_layers * per_layer, batch=self.bs)

    def lens(self) -> StagePlan:
        w, samples = self.w, self.samples("tasks")["count"]
        seq = self._seq(samples, forced=True)
        a = max(len(self.vlm.answer_ids(s.answer)) for s in samples)
        fw = [
            Forward(n, seq, count=k, extra=n * a * w.vocab * 12) for n, k in _chunk_sizes(len(samples), self.bs).items()
        ]
        return StagePlan("lens", fw, batch=self.bs)

    def headlens(self) -> StagePlan:
        w, b = self.w, self.w.act_bytes
        fit, decode = self.samples("headlens_fit"), self.samples("tasks")["count"]
        seq = self._seq(fit)
        n0 = min(self.bs, len(fit))
        fw = [Forward(n, seq, count=k) for n, k in _chunk_sizes(len(fit), self.bs).items()]
        fw += [
            Forward(n, self._seq(decode), count=k, extra=n * w.n_heads * w.vocab * 8)
            for n, k in _chunk_sizes(len(decode), self.bs).items()
        ]
        tokens = n0 * seq  # one batch's positions, an upper bound: padding is dropped
        # float64 sums: XᵀX and Xᵀy of the fitting and held-out positions per layer, one product being
        # added, and the solve's matrices at the end; one batch's y and one layer's x with its two parts.
        host = (4 * w.n_layers + 5) * w.d_model**2 * 8 + 4 * tokens * w.d_model * 8
        return StagePlan("headlens", fw, kept=(w.n_layers + 1) * n0 * seq * w.d_model * b, host=host, batch=self.bs)

    def attention(self) -> StagePlan:
        samples = self.samples("tasks")["count"]
        seq = self._seq(samples)
        fw = [Forward(n, seq, count=k, eager=True) for n, k in _chunk_sizes(len(samples), self.bs).items()]
        return StagePlan("attention", fw, batch=self.bs)

    def attention_metrics(self) -> StagePlan:
        samples = self.samples("attention_metrics")
        seq = self._seq(samples)
        scored = self.score("attention_metrics", samples)
        fw = [Forward(n, seq, count=k, eager=True) for n, k in _chunk_sizes(len(samples), self.bs).items()]
        return StagePlan("attention_metrics", fw + scored.forwards, batch=self.bs, notes=scored.notes)

    def ablation(self) -> StagePlan:
        w, b = self.w, self.w.act_bytes
        dz = w.n_heads * w.d_head
        firsts = [la for la in range(w.n_layers) for _ in range(w.n_heads)]
        fw, kept, host, rows = [], 0, 0, 0
        for samples in self.samples("tasks").values():
            seq = self._seq(samples, forced=True)
            keep = answer_window([self.vlm.answer_ids(s.answer) for s in samples[: self.bs]])
            n0 = min(self.bs, len(samples))
            task_kept = w.n_layers * n0 * seq * dz * b  # the means pass saves every layer's z
            edit_values = w.n_layers * n0 * seq * (dz * 4 + w.n_heads)  # float32 values and masks, per head
            rows = _sweep_rows(
                w, seq, self.free - (edit_values if self.vlm.device.type == "cpu" else 0), 0, keep, self.patches
            )
            kept, host = max(kept, task_kept), max(host, edit_values)
            for n, k in _chunk_sizes(len(samples), self.bs).items():
                fw += [Forward(n, seq, count=k), Forward(n, seq, count=k, keep=keep)]
                fw += _stacked(w, firsts, n, seq, rows, keep, k, self.patches, extra_per_row=keep * w.vocab * 4)
        return StagePlan("ablation", fw, kept=kept, host=host, rows=rows, batch=self.bs)


def plan(vlm: VLM, config=None, memory: int | None = None, device: str | None = None, base: int | None = None) -> Plan:
    """The `Plan` of `countlens discover` on ``vlm`` with ``config`` (a `DiscoverConfig`).

    ``vlm`` may be loaded (the plan of running here, now) or built on the meta device (`meta_vlm`:
    the plan for a device that has ``memory`` bytes in all). ``memory``: the device's total memory
    (default: a loaded model's free memory now plus its weights; for a meta model, this host's
    available memory). ``device``: "cpu" or "cuda", where a meta model would run (default "cpu").
    ``base``: the runtime's own bytes (default: on the CPU this process's resident set less the
    loaded weights; on a GPU 0, the CUDA context being outside the allocator's count).
    """
    c = config or DiscoverConfig()
    check(c)
    w = widths(vlm)
    loaded = vlm.device.type != "meta"
    where = device or ("cpu" if vlm.device.type in ("cpu", "meta") else vlm.device.type)
    if where not in ("cpu", "cuda"):
        raise ConfigError(f"device {where!r}: plan for 'cpu' or 'cuda'")
    if base is None:
        base = max(0, resident_bytes() - (w.weight_bytes if loaded else 0)) if where == "cpu" else 0
    if memory is None:
        memory = (
            free_bytes(vlm.device if loaded else "cpu") + (w.weight_bytes if loaded else 0) + (base if loaded else 0)
        )
    free = memory - w.weight_bytes - base
    if free <= 0:
        raise ConfigError(
            f"{vlm.name}'s weights ({w.weight_bytes / 2**30:.1f} GiB) and the runtime "
            f"({base / 2**30:.1f} GiB) do not fit {memory / 2**30:.1f} GiB; give a device with more "
            "memory, a smaller dtype, or several devices (device_map='auto')"
        )
    p = _Planner(vlm, c, free)
    stages = [
        p.score("cases", p.samples("cases")),
        p.score("conflict_std", p.samples("conflict_std")),
        p.score("conflict", p.samples("conflict")),
        p.vap(),
        p.heads(),
        p.atp(),
        p.lens(),
        p.headlens(),
        p.attention(),
        p.attention_metrics(),
        p.ablation(),
        p.score("temperature", p.samples("temperature"), times=2),
    ]
    return Plan(vlm.name, w, vlm.geometry.image_height, p.patches, base, free, where, stages, memory)
