"""The cost model under `countlens plan`: a stage's forwards, their FLOPs and peak memory.

Nothing runs on the model: a `Planner` reads the model's widths, prepares one batch of a stage's own
samples to learn its sequence length, and each stage counts its forwards with it.

**FLOPs** of a forward: 2 × every ``Linear`` weight × the tokens it sees (decoder layers: every
token; vision blocks: every patch; projector: every image token; ``lm_head``: the positions whose
logits are kept; patch embedding: every patch) plus attention, 4·S²·(heads·d_head) per decoder layer
and row and 4·P²·width per vision block and image (full attention: an upper bound for windowed
blocks; a class token's position is not counted). Exact against torch's FLOP counter on eager
attention for Qwen2-VL (``tests/unit/test_plan.py``). A forward whose hooks compute products of their
own (an edge-ablated forward) adds them as ``extra_flops``, counted by the stage that runs it.

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

Row sizing of the sweeps (`rows_per_forward`, `Widths`) lives in `countlens.model.memory`; each stage's
own plan lives beside its computation (`countlens.pipeline.stages`), and `countlens.pipeline.plan`
puts them together for one model.

**Rows per chunk.** A stage whose peak grows with the pairs or samples of one chunk (the gradient
stages' backward, the edge stage's attributions, candidate scoring) takes as many a chunk as
`FREE_SHARE` of the free memory holds, at most the batch size asked (`fit_rows`). The plan and the
run choose by the same rule from the same bytes a row (the stage's own ``row_bytes``): the plan from
the device's memory less the weights (`Planner.chunk`), the run from the memory free when the stage
starts (`run_rows`), so a run on the device the plan was for takes the plan's rows. Where not one
row fits, the plan flags the stage (``StagePlan.fits``) and the run refuses before its forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from countlens.analysis.evaluate import candidate_sets
from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.errors import ConfigError, CountlensError
from countlens.model.answers import read_rows
from countlens.model.memory import (
    FREE_SHARE,
    MAX_ROWS,
    Widths,
    logit_bytes,
    model_free_bytes,
    replica_copy_bytes,
    rows_per_forward,
    widths,
)
from countlens.pipeline.config import resolved_prompt
from countlens.pipeline.inputs import stage_inputs

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


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
    extra_flops: float = 0.0  # further FLOPs of one such forward (hooks' own products)


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
    return float(text + head + vision + f.extra_flops)


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
    logits = logit_bytes(w, f.rows, f.keep)
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
    batch: int = 0  # pairs or samples a chunk: the batch size, or fewer where the stage's rows are chosen
    notes: list[str] = field(default_factory=list)
    fits: bool = True  # False: not even one row a chunk fits the memory (`Planner.chunk`)
    knob: str = "lower --batch-size or give a device with more memory"  # what makes it fit when over


def chunk_sizes(n: int, size: int) -> dict[int, int]:
    """{chunk length: how many chunks} of ``n`` items in chunks of ``size``."""
    sizes = {size: n // size} if n >= size else {}
    if n % size:
        sizes[n % size] = 1
    return sizes


def stacked(
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


def sweep_rows(w: Widths, seq: int, free: int, kept: int, keep: int, patches: int) -> int:
    return rows_per_forward(w, seq, max(0, free - kept), keep, patches)


#: What makes a stage fit whose chunk is already one row (its floor): the knob a plan and a run name.
FLOOR_KNOB = (
    "give a device with more memory (or several: device_map='auto'), a smaller dtype, "
    "or smaller images (--image-size, where the processor takes another size)"
)
GIB = 1 << 30


def fit_rows(row_bytes: int, free: int | None, asked: int, cap: int = MAX_ROWS) -> int:
    """The most rows (pairs or samples) one chunk of a stage may take: `FREE_SHARE` of ``free`` bytes
    over ``row_bytes`` (what one row adds to the stage's peak, kept and transient), at most ``asked``
    (the batch size) and ``cap``; ``free`` None (a remote model, whose memory is not this machine's):
    ``asked``. 0 where not even one row fits."""
    if free is None:
        return asked
    return max(0, min(asked, cap, int(FREE_SHARE * max(0, free)) // max(1, row_bytes)))


def run_rows(vlm: VLM, stage: str, row_bytes: int, asked: int, unit: str = "pair", cap: int = MAX_ROWS) -> int:
    """`fit_rows` at run time, from the memory free on ``vlm``'s devices now: the rows a chunk of
    ``stage`` takes. Refused (ConfigError, before the stage's first forward) where one does not fit."""
    free = model_free_bytes(vlm)
    n = fit_rows(row_bytes, free, asked, cap)
    if n == 0:
        raise ConfigError(
            f"{stage}: one {unit} a chunk needs {row_bytes / GIB:.2f} GiB, over {FREE_SHARE:.0%} of the "
            f"{free / GIB:.2f} GiB free on {vlm.name}'s device; {FLOOR_KNOB}"
        )
    return n


def pair_shape(vlm: VLM, pairs, asked: int) -> tuple[int, int]:
    """(tokens a row, vision patches an image) of the first chunk of ``pairs``: what a pair stage's
    ``row_bytes`` reads, at run time and in the plan alike."""
    clean = prepare_pairs(vlm, pairs[:asked]).clean
    return int(clean.inputs["input_ids"].shape[1]), clean.patches(widths(vlm).merge)


def score_shape(vlm: VLM, samples) -> tuple[int, int]:
    """(rows a sample, forced tokens a row) of candidate scoring ``samples`` (`countlens.analysis.evaluate.score`
    with its default candidates): (1, 0) where every answer is one token (the prompt's own logits)."""
    if all(len(vlm.answer_ids(str(s.answer))) == 1 for s in samples):
        return 1, 0
    sets = {tuple(sorted(c)) for c in candidate_sets(samples, None)}
    prefixes = [read_rows([vlm.answer_ids(t) for t in cands]) for cands in sets]
    return max(len(p) for p in prefixes), max(len(x) for p in prefixes for x in p)


def score_forwards(w: Widths, n: int, seq: int, per: int, width: int, count: int = 1) -> list[Forward]:
    """``count`` chunks of ``n`` samples scored: the prompt (with a KV cache where candidates are forced)
    and, where they are, the ``per`` rows a sample of ``width`` forced tokens after the repeated cache."""
    if not width:
        return [Forward(n, seq, count=count)]
    return [
        Forward(n, seq, count=count, cache=True),
        Forward(n * per, width, count=count, keep=width, images=0, context=seq, extra=n * per * width * w.vocab * 8),
    ]


def score_row_bytes(w: Widths, seq: int, per: int, width: int, patches: int) -> int:
    """What one more sample adds to a scoring chunk's peak (`score_forwards`)."""
    return max(forward_bytes(w, f, patches) for f in score_forwards(w, 1, seq, per, width))


def score_rows(vlm: VLM, stage: str, samples, asked: int) -> int:
    """The samples a chunk of ``stage``'s candidate scoring takes at run time (`run_rows`): the batch size
    asked, or fewer where the memory free now holds fewer (`score_row_bytes`)."""
    if vlm.remote or not samples:
        return asked
    w = widths(vlm)
    per, width = score_shape(vlm, samples)
    batch = vlm.prepare_samples(list(samples[:asked]))
    seq = int(batch.inputs["input_ids"].shape[1])
    row = score_row_bytes(w, seq, per, width, batch.patches(w.merge))
    return run_rows(vlm, stage, row, asked, unit="sample", cap=max(1, MAX_ROWS // per))


class Planner:
    """What every stage's cost reads: the model's widths, the memory left for rows, the batch size, the
    stage's own samples (made once: several stages share them) and their sequence lengths. Each stage
    builds its `StagePlan` from these (`countlens.pipeline.stages`)."""

    def __init__(self, vlm: VLM, config, free: int, memory: int = 0):
        self.vlm, self.c, self.free, self.memory = vlm, config, free, memory
        self.w = widths(vlm)
        self._make = stage_inputs(vlm, config, resolved_prompt(vlm, config))
        self._made: dict[str, object] = {}
        self._seqs: dict[tuple, tuple[list, int]] = {}
        self.bs = config.batch_size
        with self._drawn("pairs"):
            first = self.samples("pairs")[0].clean
            self.patches = vlm.prepare([first.image], [first.question]).patches(self.w.merge)
            pairs = self.samples("pairs")
            self.pair_seq = int(prepare_pairs(vlm, pairs[: self.bs]).clean.inputs["input_ids"].shape[1])

    def samples(self, name: str):
        """A stage's samples (`countlens.pipeline.discover.stage_inputs`), made once: several stages share them."""
        if name not in self._made:
            with self._drawn(name):
                self._made[name] = self._make[name]()
        return self._made[name]

    @contextmanager
    def _drawn(self, name: str):
        """Around making (and drawing) the ``name`` inputs: a refusal says at which image size, the
        plan's own choice (scenes too small for their objects, a case's grid too small for its count)."""
        try:
            yield
        except CountlensError as err:
            side = self.vlm.geometry.image_height
            raise ConfigError(
                f"the {name} inputs cannot be made at {side} px images ({err}); where the image size is the "
                "cause, plan at a larger --image-size (image_size of meta_vlm)"
            ) from None

    def seq(self, samples, forced: bool = False) -> int:
        """The padded length of the first batch of ``samples``; prepared once per chunk (stages and the
        plans for several memories ask for the same ones)."""
        chunk = list(samples[: self.bs])
        key = (tuple(map(id, chunk)), forced)
        if key not in self._seqs:  # the chunk is kept with its length: its ids stay its own
            batch = self.vlm.prepare_samples(chunk, teacher_force=forced)
            self._seqs[key] = (chunk, int(batch.inputs["input_ids"].shape[1]))
        return self._seqs[key][1]

    def chunk(self, name: str, row_bytes: int, unit: str = "pair", cap: int = MAX_ROWS) -> tuple[int, list[str], bool]:
        """(rows a chunk of stage ``name`` takes, the plan's note saying so, whether one row fits): the
        batch size, or fewer where this plan's free memory holds fewer (`fit_rows`, as `run_rows` chooses
        at run time). Not one fitting: 1, flagged, the note naming the knob."""
        n = fit_rows(row_bytes, self.free, self.bs, cap)
        at = f"{self.memory / GIB:.1f} GiB" if self.memory else "the memory"
        if n == 0:
            note = f"over {at} even at 1 {unit} a chunk ({row_bytes / GIB:.2f} GiB a {unit}): {FLOOR_KNOB}"
            return 1, [note], False
        if n < self.bs and n == cap and fit_rows(row_bytes, self.free, self.bs, MAX_ROWS) > n:
            return n, [f"{n} {unit}s a chunk ({self.bs} asked): at most {MAX_ROWS} rows a forward"], True
        asked = f"{self.bs} asked" if n < self.bs else "as asked"
        return n, [f"{n} {unit}s a chunk ({asked}) to fit {at}"], True

    def score(self, name: str, samples, times: int = 1) -> StagePlan:
        """Candidate scoring of ``samples`` (``times`` over), in chunks of as many samples as fit (`chunk`)."""
        w, seq = self.w, self.seq(samples)
        per, width = score_shape(self.vlm, samples)
        step, notes, fits = self.chunk(
            name, score_row_bytes(w, seq, per, width, self.patches), "sample", cap=max(1, MAX_ROWS // per)
        )
        chunks = chunk_sizes(len(samples), step).items()
        fw = [f for n, k in chunks for f in score_forwards(w, n, seq, per, width, k * times)]
        what = f"candidate scoring: {per} rows a sample, {width} forced tokens" if width else "single-token scoring"
        return StagePlan(name, fw, batch=step, notes=[what, *notes], fits=fits, knob=FLOOR_KNOB)

    def patching(self, name: str, firsts: list[int]) -> StagePlan:
        w, b, seq = self.w, self.w.act_bytes, self.pair_seq
        pairs = self.samples("pairs")
        n0 = min(self.bs, len(pairs))
        dz = w.n_heads * w.d_head
        starts = len({f for f in firsts if f >= 1})
        kept = lambda n: n * seq * ((w.n_layers + 1) * w.d_model + w.n_layers * dz + starts * w.d_model) * b  # noqa: E731
        rows = sweep_rows(w, seq, self.free, kept(n0), 1, self.patches)
        fw = []
        for n, k in chunk_sizes(len(pairs), self.bs).items():
            fw += [Forward(n, seq, count=3 * k)]  # corrupt cache, clean logits, the clean pre-pass
            fw += stacked(w, firsts, n, seq, rows, 1, k, self.patches)
        return StagePlan(name, fw, kept=kept(n0), rows=rows, batch=self.bs)
