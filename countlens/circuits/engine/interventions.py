"""Interventions as values: what is written at a site, at which positions.

Each intervention names a site (`countlens.circuits.sites`: `Residual`, `HeadZ`, `Q` / `K` / `V`,
`MlpIn`, `MlpOut`, `Expert`, `ImageStates`), positions (`countlens.circuits.sites.positions`: a token
group's name, `Cells`, `Objects`, a `Mask`) and what it writes there, given the value x the forward
has at each chosen position (Float[Tensor, "k d"], d the site's width):

- `Patch` — the value a donor run has there: in `countlens.circuits.effect` the pair's corrupt
  run; under `countlens.circuits.intervene` the ``values`` given (Float[Tensor, "batch seq d"], from
  `countlens.circuits.record`, which marks each row with its sample; ``into=`` names the samples the
  rows are written into). Each forward's row takes its own sample's row, whatever the batching and
  order (`countlens.circuits.sites.positions.row_index`).
- `Resample` — the value a donor sample has there, a random one of ``donors`` (samples, recorded once)
  per row: drawn from the seed and the row's sample, so the same at any batching and order.
- `Mean` — the mean of x over a reference set: ``reference`` samples (the mean at the same positions
  of their forwards) or a vector.
- `Zero` — 0.
- `Add` — x + α·v (steering; `countlens.circuits.mean_difference` gives v).
- `Scale` — β·x (on `Q`, head temperature: β scales the head's attention logits).
- `Apply` — fn(x), any function of Float[Tensor, "k d"] to the same shape, finite where x is.
- `Replace` — fn(what other sites hold in this same forward): ``reads=`` names them, each computed
  before the site (`MlpIn` of the layer for its `MlpOut`: a transcoder in place of the MLP), or the
  site itself (its value before the write). Under `countlens.circuits.intervene` only.

One intervention has no site: `Block` (attention knockout) removes the attention from chosen query
positions to chosen key positions at one layer (one head, or every head), by adding −inf to those
attention logits before the softmax. Under `countlens.circuits.intervene` only.

A list of interventions applies together, in the forward's order. Patch and Resample write a
donor's values, so they never act on tokens generated after the prompt (no donor has them); the
others act wherever their positions reach (`countlens.circuits.sites.positions` says where new tokens
belong).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from countlens.circuits.engine.record import mean_activation, record
from countlens.circuits.sites import Site, check_site
from countlens.circuits.sites.positions import (
    AS_POSITIONS,
    Frame,
    Objects,
    as_positions,
    given_sample_keys,
    layout_of,
    row_index,
    sample_digest,
    sample_keys,
    samples_of,
)
from countlens.errors import InputError, LayerError
from countlens.model.arch import text_config
from countlens.model.vlm import check_samples
from countlens.validate import require_finite, require_integer, require_seed

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

SITE_KINDS = ("Residual", "HeadZ", "Q", "K", "V", "MlpIn", "MlpOut", "Expert", "ImageStates")
#: The sites a `Replace` reads: those a torch hook records at a module's input or output.
READ_KINDS = ("Residual", "HeadZ", "Q", "K", "V", "MlpIn", "MlpOut")
#: Every intervention, as error messages name them.
NAMES = "Patch, Resample, Mean, Zero, Add, Scale, Apply, Replace or Block"


@dataclass(frozen=True, eq=False)
class Intervention:
    """The base: a site and positions. Subclasses say what is written (``op``, or a donor's values)."""

    site: Site
    positions: Any = field(default="all", kw_only=True)
    donor: ClassVar[bool] = False

    def __post_init__(self):
        if type(self.site).__name__ == "Pattern":
            raise InputError(
                f"{self.site} is read only (record(vlm, batch, [Pattern(layer, head)])); to change a head's "
                "attention, Scale its Q (head temperature), write its Q / K, or knock out attention from some "
                "positions to others with Block(layer, head, queries=..., keys=...)"
            )
        if type(self.site).__name__ not in SITE_KINDS:
            raise InputError(
                f"{type(self).__name__} takes a site ({', '.join(SITE_KINDS)} from countlens.circuits), "
                f"got {self.site!r}"
            )
        object.__setattr__(self, "positions", as_positions(self.positions))

    def check(self, vlm: VLM) -> None:
        """Refuse, before any forward, a site this model lacks (`countlens.circuits.sites.check_site`),
        positions it cannot have, a value of the wrong width."""
        check_site(vlm, self.site)  # the site's own check: every entry point runs this one
        self.positions.check(vlm)
        self.check_values(vlm)

    def check_values(self, vlm: VLM) -> None:
        pass

    def check_samples(self, pairs: Sequence) -> None:
        """Refuse object positions that a pair's scene (edited: clean; donor: corrupt) does not have,
        before any forward."""
        if not isinstance(self.positions, Objects):
            return
        side = "corrupt" if self.positions.of == "donor" else "clean"
        for k, p in enumerate(pairs):
            self.positions.scene_of(getattr(p, side), f"pair {k}'s {side} sample", AS_POSITIONS)

    def resolved(self, vlm: VLM) -> Intervention:
        """This intervention with anything that needs a forward (a reference mean, donors) computed."""
        return self

    def op(self) -> Callable[[Tensor], Tensor] | None:
        """What is written, as a function of what the forward has there; None: a donor's values."""
        return None

    def donor_layout(self) -> tuple[Frame, Tensor | None] | None:
        """A donor's: the `Frame` of the batch its values were recorded on, with each values row's row of
        that batch (None: the same rows), or None where unknown (`countlens.circuits.engine.donors`)."""
        return None

    def _width(self, vlm: VLM, value: Tensor, what: str) -> None:
        width = self.site.width(vlm.arch)
        if not isinstance(value, Tensor) or value.ndim == 0 or value.shape[-1] != width:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise InputError(f"{type(self).__name__}'s {what} is {shape}; {self.site} is {width} wide")
        if not torch.isfinite(value).all():
            raise InputError(f"{type(self).__name__}'s {what} holds NaN or ±inf")


@dataclass(frozen=True, eq=False)
class Patch(Intervention):
    """Write a donor run's values: the pair's corrupt run in `effect`; ``values`` (batch, seq, d) under
    `intervene`. Values know their rows' samples (`record` marks them; ``into`` says them: row i of
    ``values`` is written into sample ``into[i]``), and each forward's row takes its own sample's row,
    at any batch size and order; a forward of a sample they lack is refused
    (`countlens.circuits.sites.positions.row_index`). Values without samples have exactly the forward's rows,
    or one row for every row.

    Values recorded on a batch of another token layout (another prompt length or task: the colour task's
    49 tokens into the count task's 52) are written by position name: ``last``, a token group, `Cells` or
    `Objects` resolved in each run (the donor's in the batch `record` marks them with), position by
    position in order; a row whose donor holds another number of those positions, or lacks them, is
    refused naming both (`countlens.circuits.engine.donors`)."""

    values: Tensor | None = field(default=None, repr=False)
    into: Sequence | None = field(default=None, repr=False)
    keys: tuple | None = field(default=None, init=False, repr=False)
    donor: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.into is not None and self.values is None:
            raise InputError("Patch's into= names the samples of its values' rows; give values= too")
        samples = samples_of(self.values) if self.into is None else self.into
        if samples is not None:
            check_samples(samples, "Patch into")
            keys = sample_keys(samples) if self.into is None else given_sample_keys(samples, "Patch into=")
            object.__setattr__(self, "keys", keys)

    def check_values(self, vlm: VLM) -> None:
        if self.values is not None:
            self._width(vlm, self.values, "values")
            if self.values.ndim != 3:
                raise InputError(f"Patch values are Float[Tensor, 'batch seq d'], got shape {tuple(self.values.shape)}")
            if self.keys is not None and len(self.keys) != self.values.shape[0]:
                raise InputError(
                    f"Patch values of {self.values.shape[0]} rows, into {len(self.keys)} samples; give one sample "
                    "per row"
                )

    def rows_for(self, frame: Frame) -> Tensor:
        """Each of ``frame``'s rows' row of ``values``: by sample (`row_index`)."""
        return row_index(frame, self.keys, self.values.shape[0], f"{self.site}'s Patch values")

    def donor_layout(self) -> tuple[Frame, None] | None:
        frame = layout_of(self.values)
        return None if frame is None or len(frame.input_ids) != len(self.values) else (frame, None)


@dataclass(frozen=True, eq=False)
class Resample(Intervention):
    """Write donor samples' values, a random donor per row. Where the forward knows its rows' samples
    (batches from `VLM.prepare_samples`: `score`, `generate`, `effect`), each sample's donor is drawn
    from ``seed`` and the sample's content alone, so a sample gets the same donor at any batch size, in
    any order, and chunks of a long run draw from every donor. Elsewhere (a batch prepared by hand) row b
    takes donor ``order[b mod n]``, a permutation drawn from ``seed``. Donors of another token layout are
    written by position name, as a `Patch`'s recorded values are."""

    donors: Sequence = ()
    seed: int = 0
    values: Tensor | None = field(default=None, repr=False)
    recorded_on: tuple | None = field(default=None, repr=False)  # (the donors' batch's Frame, each row's row of it)
    donor: ClassVar[bool] = True

    def check_values(self, vlm: VLM) -> None:
        check_samples(self.donors, "Resample donors")
        require_seed(self.seed)

    def resolved(self, vlm: VLM) -> Resample:
        recorded = record(vlm, vlm.prepare_samples(self.donors), [self.site])[self.site]
        order = torch.from_numpy(np.random.default_rng(self.seed).permutation(len(self.donors)))
        return replace(self, values=recorded[order], recorded_on=(layout_of(recorded), order))

    def donor_layout(self) -> tuple[Frame, Tensor] | None:
        return None if self.recorded_on is None or self.recorded_on[0] is None else self.recorded_on

    def rows_for(self, frame: Frame) -> Tensor:
        """Each row's donor (a random draw by design, not a sample's own row): by the row's sample where
        the forward knows it, else ``order[b mod n]``."""
        n, samples = self.values.shape[0], frame.row_samples()
        if samples is None:
            return torch.arange(frame.input_ids.shape[0]) % n
        seed = f"{int(self.seed)}:".encode()
        draws = [int.from_bytes(hashlib.sha256(seed + sample_digest(s)).digest()[:8], "little") % n for s in samples]
        return torch.tensor(draws)


@dataclass(frozen=True, eq=False)
class Zero(Intervention):
    """Write 0."""

    def op(self):
        return torch.zeros_like


@dataclass(frozen=True, eq=False)
class Mean(Intervention):
    """Write the mean over ``reference``: samples (the mean of the site at the same positions of their
    forwards, `countlens.circuits.mean_activation`) or a vector (d,)."""

    reference: Any = field(default=None, repr=False)

    def check_values(self, vlm: VLM) -> None:
        if isinstance(self.reference, Tensor):
            self._width(vlm, self.reference, "reference vector")
            if self.reference.ndim != 1:
                raise InputError(f"Mean's reference vector is (d,), got shape {tuple(self.reference.shape)}")
        else:
            check_samples(self.reference, "Mean reference")

    def resolved(self, vlm: VLM) -> Mean:
        if isinstance(self.reference, Tensor):
            return self
        return replace(self, reference=mean_activation(vlm, self.reference, self.site, self.positions))

    def op(self):
        vector = self.reference
        return lambda x: vector.to(x.device, x.dtype).expand_as(x).clone()


@dataclass(frozen=True, eq=False)
class Add(Intervention):
    """Write x + α·``vector`` (steering)."""

    vector: Tensor | None = field(default=None, repr=False)
    alpha: float = 1.0

    def check_values(self, vlm: VLM) -> None:
        self._width(vlm, self.vector, "vector")
        if self.vector.ndim != 1:
            raise InputError(f"Add's vector is (d,), got shape {tuple(self.vector.shape)}")
        require_finite(self.alpha, "Add's alpha")

    def op(self):
        vector, alpha = self.vector, float(self.alpha)
        return lambda x: x + alpha * vector.to(x.device, x.dtype)


@dataclass(frozen=True, eq=False)
class Scale(Intervention):
    """Write β·x."""

    beta: float = 1.0

    def check_values(self, vlm: VLM) -> None:
        require_finite(self.beta, "Scale's beta")

    def op(self):
        beta = float(self.beta)
        return lambda x: x * beta


@dataclass(frozen=True, eq=False)
class Apply(Intervention):
    """Write fn(x): ``fn`` maps Float[Tensor, "k d"] to the same shape."""

    fn: Callable[[Tensor], Tensor] | None = field(default=None, repr=False)

    def check_values(self, vlm: VLM) -> None:
        if not callable(self.fn):
            raise InputError(f"Apply takes a function of Float[Tensor, 'k d'], got {type(self.fn).__name__}")

    def op(self):
        fn, where = self.fn, f"Apply at {self.site} ({getattr(self.fn, '__name__', repr(self.fn))})"

        def apply(x: Tensor) -> Tensor:
            return checked_result(where, fn(x), tuple(x.shape), torch.isfinite(x))

        return apply


def checked_result(where: str, out, shape: tuple, finite: Tensor) -> Tensor:
    """``out``, a function's result, refused unless it is a tensor of ``shape`` that is finite where
    ``finite`` (Bool, broadcast to ``shape``: where its inputs were) holds."""
    if not isinstance(out, Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise InputError(f"{where}: the function returned {got}; {shape} is written there (the positions × the width)")
    if out.is_floating_point() and bool((finite & ~torch.isfinite(out)).any()):
        raise InputError(f"{where}: the function returned NaN or ±inf where its input was finite; return finite values")
    return out


@dataclass(frozen=True, eq=False)
class Replace(Intervention):
    """Write fn(the values of ``reads`` in this same forward) at the site's positions. ``reads`` is a
    site or a tuple of sites (`READ_KINDS`), each computed before ``site`` in the forward — a lower
    layer, or in one layer q, k, v → z → the MLP's input → its output → the layer's output (each site's
    ``stage``) — or ``site`` itself (its value before this write). ``fn`` takes one Float[Tensor,
    "k d_read"] per read (the k chosen positions) and returns Float[Tensor, "k d"], d the site's width,
    finite where the reads are. It is called once before any forward, on random rows, so that a wrong
    width or a NaN is refused up front. ``Replace(MlpOut(l), transcoder, reads=MlpIn(l))``: the MLP's
    output rewritten from its input."""

    fn: Callable[..., Tensor] | None = field(default=None, repr=False)
    reads: Any = None

    def __post_init__(self):
        super().__post_init__()
        reads = tuple(self.reads) if isinstance(self.reads, (tuple, list)) else (self.reads,)
        if self.reads is None or not reads:
            raise InputError(
                f"Replace at {self.site} takes reads=: the site(s) fn reads, e.g. Replace(MlpOut(3), fn, "
                "reads=MlpIn(3)); to rewrite a site from its own value use Apply"
            )
        for read in reads:
            if type(read).__name__ not in READ_KINDS:
                raise InputError(f"Replace reads sites ({', '.join(READ_KINDS)} from countlens.circuits), got {read!r}")
            if read == self.site or type(self.site).__name__ not in READ_KINDS:
                continue
            here, there = (self.site.layer, self.site.stage), (read.layer, read.stage)
            if there >= here:
                when = "at the same step as" if there == here else "after"
                raise InputError(
                    f"Replace at {self.site} reads {read}, which the forward computes {when} {self.site}: a site "
                    "reads only what comes before it in the same forward (a lower layer; within a layer q, k, v, "
                    "then z, the MLP's input, its output, the layer's output); read an earlier site"
                )
        object.__setattr__(self, "reads", reads)

    def check_values(self, vlm: VLM) -> None:
        if not callable(self.fn):
            raise InputError(f"Replace takes a function of the reads' values, got {type(self.fn).__name__}")
        for read in self.reads:
            check_site(vlm, read)
        # One call on random rows before any forward: a wrong width or a NaN is refused here.
        gen, device, dtype = torch.Generator().manual_seed(0), vlm.device, vlm.hf.dtype
        probes = [torch.randn(2, read.width(vlm.arch), generator=gen).to(device, dtype) for read in self.reads]
        with torch.no_grad():
            self.written(probes, self.site.width(vlm.arch))

    def written(self, values: Sequence[Tensor], width: int) -> Tensor:
        """fn(*values), refused unless it is (k, ``width``) and finite where every read's row is."""
        where = f"Replace at {self.site} ({getattr(self.fn, '__name__', repr(self.fn))})"
        try:
            out = self.fn(*values)
        except InputError:
            raise
        except Exception as err:
            shapes = ", ".join(str(tuple(v.shape)) for v in values)
            raise InputError(f"{where}: the function failed on values of shapes {shapes}: {err}") from err
        finite = torch.stack([torch.isfinite(v).all(-1) for v in values]).all(0)[:, None].to(out.device)
        return checked_result(where, out, (values[0].shape[0], width), finite)

    def op(self):
        raise InputError(f"{self!r} reads other sites in the same forward: run it under intervene")


@dataclass(frozen=True, eq=False, init=False, repr=False)
class Block(Intervention):
    """Attention knockout: at ``layer`` (head ``head``; None: every head) the attention from the
    ``queries`` positions to the ``keys`` positions is removed — those attention logits are set to −inf
    before the softmax, so each query's probabilities renormalise over the keys it still sees. A
    softmax self-attention layer under eager or sdpa attention; a query left no key is refused. Under a
    KV cache (generation) the keys are the prompt's and the new tokens' (a new token is a key of
    ``last`` and ``all``)."""

    layer: int = 0
    head: int | None = None
    keys: Any = None

    def __init__(self, layer: int, head: int | None = None, *, queries, keys):
        object.__setattr__(self, "site", None)
        object.__setattr__(self, "layer", require_integer(layer, "Block's layer", low=0))
        object.__setattr__(self, "head", None if head is None else require_integer(head, "Block's head", low=0))
        object.__setattr__(self, "positions", as_positions(queries))
        object.__setattr__(self, "keys", as_positions(keys))

    @property
    def queries(self):
        return self.positions

    def __repr__(self) -> str:
        return f"Block(layer={self.layer}, head={self.head}, queries={self.positions!r}, keys={self.keys!r})"

    def check(self, vlm: VLM) -> None:
        arch, layer = vlm.arch, self.layer
        arch.layer(layer)  # a LayerError naming the model's layers
        try:
            arch.require_softmax(layer, "Block (attention knockout)")
        except LayerError as err:
            raise InputError(str(err)) from err
        if arch.kind(layer) == "cross":
            raise InputError(
                f"layer {layer} of {arch.name} is a cross-attention layer: its keys are the image states, not "
                f"positions of the sequence; Block a self-attention layer ({arch.softmax_layers})"
            )
        n = arch.heads(layer)
        if self.head is not None and self.head >= n:
            raise InputError(f"head {self.head} out of range: layer {layer} of {arch.name} has heads 0..{n - 1}")
        kernel = text_config(vlm.hf.config, arch.spec)._attn_implementation
        if kernel not in ("eager", "sdpa"):
            raise InputError(
                f"Block adds −inf to the attention mask that eager and sdpa attention read; {vlm.name} runs "
                f"{kernel!r} attention: load it with attn_implementation='sdpa'"
            )
        self.positions.check(vlm)
        self.keys.check(vlm)


def as_interventions(vlm: VLM, interventions) -> list[Intervention]:
    """``interventions`` (one or a list) checked on ``vlm``, before any forward."""
    items = [interventions] if isinstance(interventions, Intervention) else interventions
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise InputError(
            f"give an intervention or a non-empty list of them ({NAMES} from countlens.circuits); got {interventions!r}"
        )
    for item in items:
        if not isinstance(item, Intervention):
            raise InputError(f"{item!r} is no intervention; use {NAMES}")
        item.check(vlm)
    return list(items)
