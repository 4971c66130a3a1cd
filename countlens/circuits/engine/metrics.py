"""What a patching number measures: a metric of each pair's logits at its read position.

Every effect, grid, faithfulness curve and attribution in countlens reads a pair's run through one
scalar per pair, the **metric** M. The patching effect of an edit is then

    effect = (Σ M_edited − Σ M_clean) / (Σ M_corrupt − Σ M_clean)

over the pairs: 0 where the edit changes nothing, 1 where it moves the clean run as far as the
corrupt run is. A pair is read at one position: after the prompt and the two answers' shared prefix
(`countlens.model.answers.divergence`), where the clean and corrupt answers' tokens first differ
(`PairBatch.clean_id`, `PairBatch.corrupt_id`). A metric maps that position's logits ``(pairs, vocab)``
and the `PairBatch` to ``(pairs,)``.

Built in (each a `Metric`, by name or called with its parameters):

- ``logit_diff()`` — the clean answer's logit minus the corrupt answer's (the default). Linear in the
  logits.
- ``log_prob(answer="clean")`` — the log-probability of the clean (or corrupt) answer's token there,
  given the shared prefix.
- ``prob_mass(answers)`` — the probability that the next token begins one of ``answers`` (strings,
  e.g. the counts ≥ 5), given the pair's shared prefix. An answer of several tokens counts by its token
  after that prefix; answers the prefix rules out count zero. *countlens defines this* (the papers use the
  logit difference only): it is the answers' exact probability mass where each such token begins answers
  of the set only, which is checked against every count 0–20 and the pairs' own answers, and refused
  otherwise. Write the answers as the model writes them (the samples' answer format, e.g. "circle: 5").
- ``kl()`` — KL(p_clean ‖ p_edited) over the vocabulary at the read position: 0 on the clean run.

Any callable ``f(logits, pair_batch) -> (pairs,)`` is a metric too (its ``__name__`` names it; wrap it in
`Metric` for a name, parameters or its properties). A metric's name and parameters go into every
result's provenance (``attrs["metric"]``). Two properties gate the methods that rely on them:
``linear`` (RelP's relevance is conserved only for a metric linear in the logits) and ``stationary``
(a metric whose gradient vanishes at the clean run, like KL from it, gives a first-order method such as
AtP nothing but zeros).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import Tensor

from countlens.circuits.engine.pair_batch import batch_pairs, normaliser, normaliser_stats
from countlens.circuits.engine.pair_batch import logit_diff as pair_logit_diff
from countlens.errors import InputError
from countlens.model.adapt import module_of
from countlens.model.answers import CHECKED_COUNTS, divergence

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.circuits.engine.pair_batch import PairBatch
    from countlens.model.vlm import VLM

#: Names a metric cannot take: a result's other variables (the per-pair values are named after the metric).
RESERVED = ("effect", "overwrite", "to_corrupt", "clean_correct", "pair")


@dataclass(frozen=True)
class Metric:
    """A scalar per pair from its read position's logits: ``fn(logits, pair_batch) -> (pairs,)``.

    ``name`` names the result's per-pair variables (``logit_diff``, ``clean_logit_diff``, …);
    ``params`` (JSON-able) go into provenance with it. ``linear``: linear in the logits. ``stationary``:
    its gradient is zero at the clean run. ``reads_clean``: it reads ``pair_batch.clean_logits``."""

    name: str
    fn: Callable[[Tensor, PairBatch], Tensor] = field(repr=False, compare=False)
    params: Mapping = field(default_factory=dict)
    linear: bool = False
    stationary: bool = False
    reads_clean: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier() or set(self.variables) & set(RESERVED):
            raise InputError(
                f"metric name {self.name!r} must be a Python identifier that, alone or after clean_ / corrupt_, is "
                f"none of {', '.join(RESERVED)} (it names the result's per-pair variables); give Metric(name=...)"
            )
        if not callable(self.fn):
            raise InputError(f"metric {self.name!r}: fn must be a callable (logits, pair_batch) -> (pairs,)")
        for flag in ("linear", "stationary", "reads_clean"):
            if not isinstance(getattr(self, flag), bool):
                raise InputError(f"metric {self.name!r}: {flag} must be True or False, not {getattr(self, flag)!r}")
        try:
            json.dumps(dict(self.params))
        except (TypeError, ValueError) as e:
            raise InputError(f"metric {self.name!r}: its params must be JSON data for provenance ({e})") from None

    @property
    def variables(self) -> tuple[str, str, str]:
        """The names of a result's per-pair variables under this metric: edited, clean and corrupt runs."""
        return self.name, f"clean_{self.name}", f"corrupt_{self.name}"

    def refuse_clash(self, taken, method: str) -> None:
        """Refuse this metric where its variables' names are among ``taken`` (a result's other variables, its
        dims): one would hide the other."""
        clash = sorted(set(self.variables) & set(taken))
        if clash:
            raise InputError(
                f"{method}: the metric {self.name!r} names its per-pair variables {', '.join(self.variables)}, and "
                f"{', '.join(clash)} is already a name of the result (a variable or a dim); rename the metric "
                "(Metric(name=...))"
            )

    def bind(self, vlm: VLM) -> Metric:
        """This metric for ``vlm`` (a built-in that reads the tokenizer binds here); most return themselves."""
        return self

    def for_pairs(self, vlm: VLM, pairs: Sequence) -> Metric:
        """This metric checked against every pair before any forward (tokenisation only); most return
        themselves. `prob_mass` checks each pair's prefix here and reads every pair's answers."""
        return self

    def __call__(self, logits: Float[Tensor, "pairs vocab"], pb: PairBatch) -> Float[Tensor, " pairs"]:
        """The metric per pair, checked: one finite value per pair, else an error naming the metric."""
        out = self.fn(logits, pb)
        n = len(logits)
        if not isinstance(out, Tensor) or tuple(out.shape) != (n,) or not out.is_floating_point():
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            kind = f" of {out.dtype}" if isinstance(out, Tensor) else ""
            raise InputError(
                f"metric {self.name!r} returned {shape}{kind} for {n} pairs; a metric gives one value per pair, "
                "a float tensor shaped (pairs,)"
            )
        bad = ~torch.isfinite(out)
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            raise InputError(
                f"metric {self.name!r} gave {float(out[k])} for pair {k}; a metric must be finite on every pair "
                "(a log of a zero probability? clamp it, or read log-probabilities with log_softmax)"
            )
        return out

    def probe(self, vlm: VLM, pb: PairBatch) -> None:
        """Refuse a metric that gives the wrong shape or a non-finite value, on uniform logits, before any
        forward (a broken metric is refused before the model runs, not after a sweep)."""
        vocab = module_of(vlm.hf, vlm.arch.lm_head).weight.shape[0]
        zeros = torch.zeros(len(pb.clean_id), vocab)
        try:
            self(zeros, self.at_clean(pb, zeros))
        except TypeError as e:  # a callable of another signature
            raise InputError(
                f"metric {self.name!r} could not be called as fn(logits, pair_batch) ({e}); a metric takes the read "
                "position's logits (pairs, vocab) and the PairBatch, and returns (pairs,)"
            ) from None

    def require(self, method: str, *, linear: bool = False, moving: bool = False) -> None:
        """Refuse this metric for ``method`` if the method needs a ``linear`` metric, or one that is not
        ``stationary`` at the clean run (``moving``: a first-order estimate taken there)."""
        if linear and not self.linear:
            raise InputError(
                f"{method} needs a metric linear in the logits (its relevance is conserved from the metric "
                f"down only then), and {self.name!r} is not; use metric='logit_diff', or measure {self.name!r} "
                "with the exact patching methods (effect, patch_heads)"
            )
        if moving and self.stationary:
            raise InputError(
                f"{method} takes the metric's gradient at the clean run, where {self.name!r} is at its minimum "
                "(its gradient there is zero), so every estimate would be 0; use eap_ig (it integrates from the "
                "corrupt run) or the exact patching methods for it"
            )

    def at_clean(self, pb: PairBatch, clean_logits: Tensor | None) -> PairBatch:
        """``pb`` as this metric reads it: with the clean run's read-position logits (a constant reference,
        detached) where it reads them (`reads_clean`), else as it is (``clean_logits`` may then be None)."""
        return replace(pb, clean_logits=clean_logits.detach()) if self.reads_clean else pb

    def provenance(self) -> str:
        """The metric as provenance: its name and parameters, as JSON."""
        return json.dumps({"name": self.name, **dict(self.params)}, sort_keys=True)


# ----------------------------------------------------------------------------- built-ins


def _logit_diff(logits: Tensor, pb: PairBatch) -> Tensor:
    return pair_logit_diff(logits, pb.clean_id, pb.corrupt_id)


def logit_diff() -> Metric:
    """The clean answer's logit minus the corrupt answer's at the read position (the default)."""
    return Metric("logit_diff", _logit_diff, linear=True)


def log_prob(answer: Literal["clean", "corrupt"] = "clean") -> Metric:
    """The log-probability of the ``answer`` side's token at the read position, given the shared prefix."""
    if answer not in ("clean", "corrupt"):
        raise InputError(f"log_prob(answer={answer!r}): give 'clean' or 'corrupt'")

    def fn(logits: Tensor, pb: PairBatch) -> Tensor:
        ids = (pb.clean_id if answer == "clean" else pb.corrupt_id).to(logits.device)
        return torch.log_softmax(logits.float(), -1)[torch.arange(len(logits)), ids]

    return Metric("log_prob", fn, {"answer": answer})


def kl() -> Metric:
    """KL(p_clean ‖ p_edited) at the read position, in nats: 0 on the clean run, its minimum."""

    def fn(logits: Tensor, pb: PairBatch) -> Tensor:
        if pb.clean_logits is None:
            raise InputError("metric 'kl' reads the clean run's logits, and this pair batch has none")
        p = torch.log_softmax(pb.clean_logits.to(logits.device).float(), -1)
        q = torch.log_softmax(logits.float(), -1)
        return (p.exp() * (p - q)).sum(-1)

    return Metric("kl", fn, {"from": "clean"}, stationary=True, reads_clean=True)


@dataclass(frozen=True)
class ProbMass(Metric):
    """`prob_mass`: bound to a model, it knows each answer's tokens."""

    answers: tuple = ()

    def bind(self, vlm: VLM) -> Metric:
        return replace(self, fn=_Mass(self.answers, vlm.answer_ids))

    def for_pairs(self, vlm: VLM, pairs: Sequence) -> Metric:
        """Every pair's shared prefix checked (a token split between the set and another answer, or a set no
        pair can reach, is refused here, before any forward), and every pair's answers read as the others."""
        said = frozenset(s.answer for p in pairs for s in (p.clean, p.corrupt))
        mass = _Mass(self.answers, vlm.answer_ids, said)
        prefixes = {tuple(divergence(mass.tokens(p.clean.answer), mass.tokens(p.corrupt.answer))[0]) for p in pairs}
        mass.chosen(sorted(prefixes), [pairs[0].clean.answer])
        return replace(self, fn=mass)


class _Mass:
    """`prob_mass`'s function: the mass of the tokens that begin an answer of ``answers`` after each pair's
    prefix. A token that also begins another answer (a count 0–20, a pair's own answer, any of ``said``) is
    refused: its probability cannot be split."""

    def __init__(self, answers: tuple, answer_ids: Callable[[str], list[int]], said: frozenset = frozenset()):
        self.answers, self.answer_ids, self.said, self.ids = answers, answer_ids, said, {}
        self.picked: dict[tuple, list[list[int]]] = {}  # (prefixes, answers read) → chosen: once per batch

    def tokens(self, answer: str) -> tuple:
        if answer not in self.ids:
            self.ids[answer] = tuple(self.answer_ids(answer))
        return self.ids[answer]

    def next_tokens(self, prefix: tuple, others: set) -> list[int]:
        def after(seq: tuple) -> int | None:
            return seq[len(prefix)] if len(seq) > len(prefix) and seq[: len(prefix)] == prefix else None

        mine = {t for a in self.answers if (t := after(self.tokens(a))) is not None}
        for other in sorted(others - set(self.answers)):
            try:
                seq = self.tokens(other)
            except InputError:  # a count this vocabulary cannot write: no token of it to share
                continue
            if after(seq) in mine:
                raise InputError(
                    f"prob_mass: after the prefix {list(prefix)}, the token {after(seq)} begins both an answer of "
                    f"the set and {other!r}, so its probability cannot be split between them; give a set that "
                    f"includes {other!r}, or pairs whose shared prefix tells them apart"
                )
        return sorted(mine)

    def chosen(self, prefixes, here: list[str]) -> list[list[int]]:
        """Each prefix's tokens of the set; refused where no prefix has any (the mass would be 0 everywhere).
        Remembered: a sweep reads every replica of one batch with the same prefixes."""
        key = (tuple(tuple(p) for p in prefixes), tuple(here))
        if key not in self.picked:
            self.picked[key] = self._choose(prefixes, here)
        return self.picked[key]

    def _choose(self, prefixes, here: list[str]) -> list[list[int]]:
        others = {str(n) for n in CHECKED_COUNTS} | set(self.said) | set(here)
        picked = [self.next_tokens(tuple(prefix), others) for prefix in prefixes]
        if not any(picked):
            example = f" (a clean answer reads {here[0]!r})" if here else ""
            raise InputError(
                f"prob_mass({list(self.answers)}): no answer of the set can follow any pair's shared prefix"
                f"{example}, so the mass is 0 on every pair; write the answers as the model writes them (the "
                "samples' answer format)"
            )
        return picked

    def __call__(self, logits: Tensor, pb: PairBatch) -> Tensor:
        here = [s.answer for side in (pb.clean, pb.corrupt) for s in (getattr(side, "samples", None) or [])]
        probs = torch.softmax(logits.float(), -1)
        return torch.stack([probs[k, c].sum() for k, c in enumerate(self.chosen(pb.forced, here))])


def prob_mass(answers: Sequence[str]) -> Metric:
    """The probability that the next token begins one of ``answers`` (strings), given the pair's shared
    prefix: e.g. ``prob_mass([str(n) for n in range(5, 10)])``, P(count ≥ 5) on counts up to 9."""
    if (
        not isinstance(answers, (list, tuple))
        or not answers
        or not all(isinstance(a, str) and a.strip() for a in answers)
    ):
        raise InputError(f"prob_mass({answers!r}): give a non-empty list of answer strings, e.g. ['5', '6']")
    answers = tuple(dict.fromkeys(answers))

    def unbound(logits: Tensor, pb: PairBatch) -> Tensor:
        raise InputError("prob_mass must be bound to a model first (metric.bind(vlm)); the methods do it")

    return ProbMass("prob_mass", unbound, {"answers": list(answers)}, answers=answers)


#: The built-ins by name (``metric="log_prob"``: each with its default parameters).
BUILT_IN: dict[str, Callable[[], Metric]] = {"logit_diff": logit_diff, "log_prob": log_prob, "kl": kl}


def as_metric(vlm: VLM, metric, method: str) -> Metric:
    """``metric`` as a `Metric` bound to ``vlm``: None (the logit difference), a built-in's name, a
    `Metric`, or a callable ``(logits, pair_batch) -> (pairs,)``; anything else is refused for ``method``."""
    if metric is None:
        return logit_diff()
    if isinstance(metric, str):
        if metric not in BUILT_IN:
            raise InputError(
                f"{method}: no metric {metric!r}; give one of {', '.join(BUILT_IN)}, "
                "countlens.circuits.metrics.prob_mass([...]), or a callable (logits, pair_batch) -> (pairs,)"
            )
        return BUILT_IN[metric]()
    if isinstance(metric, Metric):
        return metric.bind(vlm)
    if callable(metric):
        return Metric(getattr(metric, "__name__", "metric").strip("<>") or "metric", metric)
    raise InputError(
        f"{method}: metric={metric!r} is not a metric; give a name ({', '.join(BUILT_IN)}), a Metric, or a "
        "callable (logits, pair_batch) -> (pairs,)"
    )


def metric_for(vlm: VLM, pairs: Sequence, metric, method: str, *, linear: bool = False, moving: bool = False) -> Metric:
    """The door of a method that reads ``metric`` over checked ``pairs``: the metric bound to ``vlm``,
    refused where ``method`` needs it ``linear`` or ``moving`` (`Metric.require`), and probed on the first
    pair's batch (prepared, no forward) so that a wrong shape or NaN is refused before the model runs."""
    bound = as_metric(vlm, metric, method)
    bound.require(method, linear=linear, moving=moving)
    bound = bound.for_pairs(vlm, pairs)
    if bound.fn is not _logit_diff:  # the default needs no probe: it is two logits
        bound.probe(vlm, batch_pairs(vlm, pairs[:1]))
    return bound


def normalised(clean_sum: float, corrupt_sum: float, differences, metric: Metric) -> tuple[float, dict]:
    """The normaliser of ``metric`` (`normaliser`, the noise rule included) and the attrs every result carries
    for it: the metric's provenance and `normaliser_stats`. ``differences``: each pair's M_corrupt − M_clean,
    one array or a list of them (one per chunk)."""
    if isinstance(differences, list):
        differences = np.concatenate([np.asarray(d, dtype=np.float64).ravel() for d in differences])
    denom = normaliser(clean_sum, corrupt_sum, differences, metric.name)
    return denom, {"metric": metric.provenance(), **normaliser_stats(denom, differences)}
