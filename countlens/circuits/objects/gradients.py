"""Object attribution, cheap: every object of every scene scored from one gradient pass (AtP) or ``steps``.

A scene's **clean** input is its image; its **reference** input is the same scene with its objects
removed (the background: same size, colour, noise and noise seed; `Scene.without` of every object,
`countlens.datasets.tasks.without_objects`), with the same question. The **metric** m is a logit
difference at the read position: logit(n) − logit(n − 1), n the scene's true count
(``sample.meta["count"]``, else its number of objects) and n − 1 the answer with that number lowered
by one, or any metric of `countlens.circuits.metrics` with n's answer its clean side and n − 1's its
corrupt side (``metric``; the logit difference by default; AtP refuses ``kl``, whose gradient at the clean
input is zero); a multi-token answer is read where the two answers first differ, their shared prefix
("circle:") teacher-forced (`countlens.circuits.engine.pair_batch.prepare_pairs`, whose ``corrupt`` side is
here the reference).

The attributed site is x, the **input of a decoder layer**: ``site=Residual(-1)`` (the default; or
``Embed("image")``) the input of layer 0 (the token embeddings with the projected image tokens),
``site=Residual(l)`` the residual stream after layer l (the input of layer l + 1; l < n_layers − 1). Per
token t,

- **AtP**: a_t = (x_clean,t − x_ref,t) · ∂m/∂x_t at the clean input (one backward per chunk of scenes);
- **EAP-IG** (integrated gradients, `countlens.circuits.graph.integrated.IG_STEPS` by default):
  a_t = (x_clean,t − x_ref,t) ·
  (1/s) Σ_{k=1..s} ∂m/∂x_t at x_ref + (k/s)(x_clean − x_ref), the whole input interpolated at once
  (right-endpoint Riemann sum; ``s`` backwards per chunk).

Object i's **span** is its image tokens by `countlens.circuits.sites.positions.Objects` (coverage ≥
``coverage`` of the token's cell, or the object's peak cell); its ``score`` is Σ_{t ∈ span_i} a_t. All
objects of a chunk come from the same gradients: one pass, not one per object. A token two objects
share counts in each object's score; ``overlap`` = Σ_t (k_t − 1)·a_t over tokens owned by k_t ≥ 2
objects, so ``objects`` (the union of the spans, each token once) = Σ_i score_i − overlap.
``background`` is Σ a_t over the image tokens in no span, ``text`` over the other positions (0 at
``embed``: the text is the same in both inputs; at a later layer the text has read the image).

**Completeness** (EAP-IG): objects + background + text = m(clean) − m(reference) (``image_total``) up
to the Riemann sum's error, which shrinks as ``steps`` grows; ``completeness_error`` is their
difference. AtP is a first-order estimate and has no completeness: its sum is not expected to equal
``image_total``. Scores are in logit units (not normalised), signed: > 0 means the object raises
logit(n) over logit(n − 1). Their counterpart by exact patching puts the reference's values at the
object's tokens into the clean run, m(clean) − m(patched).

Cost per chunk of scenes, as `countlens.circuits.methods.registry.Cost` counts (a backward ≈ two forwards):
AtP one plain forward (the reference) and one forward with a backward, 1 + 3 forward-equivalents;
EAP-IG two plain (both inputs recorded) and ``steps`` with a backward, 2 + 3·steps. Where the image
also enters inside the decoder (Qwen3-VL's DeepStack) those additions are not interpolated.

Edge attribution by span (object → receiver: a head's q / k / v, an MLP, the logits) is
`countlens.circuits.objects.edges.object_edge_attribution` (EAP, EAP-IG): this gradient taken at each
receiver's own copy of the residual stream (`countlens.circuits.graph.edge_attribution.receiver_gradients`),
summed over the span. At ``site=Residual(-1)`` an object's edges summed over every receiver (every layer's,
the logits included) equal its score here, AtP's for EAP and EAP-IG's at the same ``steps`` (tested).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine import Hook, hooked
from countlens.circuits.engine.gradients import activation_gradients_only
from countlens.circuits.engine.metrics import Metric, logit_diff, metric_for
from countlens.circuits.engine.pair_batch import PairBatch, prepare_pairs
from countlens.circuits.engine.record import require_local
from countlens.circuits.graph.integrated import IG_STEPS
from countlens.circuits.objects.effects import object_site
from countlens.circuits.sites import Embed, Residual
from countlens.circuits.sites.positions import Objects
from countlens.datasets.tasks import TaskSample, count_of, without_objects
from countlens.errors import InputError
from countlens.model.arguments import require_vlm
from countlens.results import provenance
from countlens.validate import require_choice, require_count, require_sequence, require_share

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: `object_attribution`'s ``method`` values: AtP (one gradient, the clean input's) and EAP-IG (integrated);
#: every family runs both. The registry's `countlens.circuits.methods.registry.OBJECT_RANKERS` name the method each
#: applies per object (this module sits below the registry and does not import it).
OBJECT_VARIANTS: tuple[str, ...] = ("atp", "eap-ig")


@dataclasses.dataclass(frozen=True)
class ReferencePair:
    """A scene (``clean``) beside its background (``corrupt``: the reference input, answer n − 1)."""

    clean: object
    corrupt: TaskSample
    kind: str = "objects"
    index: int = 0


def reference_sample(sample, where: str = "the sample") -> TaskSample:
    """``sample``'s reference: its scene without objects, its question, its answer with n lowered to n − 1
    (`without_objects`; its meta's ``"reference"`` is ``"background"``)."""
    scene = Objects(0).scene_of(sample, where)  # refuses a scene without an object list, naming the fix
    return without_objects(sample, range(len(scene.objects)), where=where, reference="background")


def object_provenance(
    vlm: VLM, pairs: Sequence, method, steps, coverage, peak, site: Residual, metric: Metric, **more
) -> dict:
    """The provenance of an object ranking: the model, the scenes, the method and its settings, the site
    (its label) and the metric (its provenance), against the scenes' backgrounds; ``more`` beside them."""
    return provenance(
        vlm.name,
        vlm.arch.name,
        dataset={"scenes": len(pairs)},
        samples=[p.clean for p in pairs],
        method=method,
        steps=steps,
        coverage=float(coverage),
        peak=bool(peak),
        site=site.label,
        reference="background",
        metric=metric.provenance(),
        read="the metric at the read position, answer n against answer n - 1",
        **more,
    )


def input_layer(vlm: VLM, site) -> int:
    """The decoder layer whose input is the attributed site (`object_site`): 0 for Residual(−1) or
    Embed("image"), l + 1 for Residual(l)."""
    site = object_site(vlm, site)
    last = vlm.arch.n_layers - 2
    if site.layer > last:
        raise InputError(
            f"site={site}: use Residual(-1) (layer 0's input) or Residual(l) for a layer l in 0..{last} (after the "
            "last layer an image token reaches no other position)"
        )
    return site.layer + 1


def spans(batch: Batch, b: int, sample, coverage: float, peak: bool) -> list[Tensor]:
    """Row ``b``'s positions of each object of ``sample``'s scene (`Objects`' rule)."""
    return [Objects(i, coverage, peak).tokens(batch, b, sample) for i in range(len(sample.scene.objects))]


@contextmanager
def _at_input(vlm: VLM, layer: int, store: dict, value: Tensor | None):
    """Inside: layer ``layer``'s input is kept in ``store["x"]`` (made a leaf that requires a gradient when
    gradients are on) or, with ``value``, replaced by it."""

    def pre(x):
        if value is not None:
            store["x"] = value
            return value
        x = x.detach()
        store["x"] = x.requires_grad_(True) if torch.is_grad_enabled() else x
        return store["x"]

    with hooked(vlm.hf, [Hook(vlm.arch.layer(layer), "input", pre)]):
        yield


def _metric(vlm: VLM, batch: Batch, pb: PairBatch, metric: Metric) -> tuple[Tensor, Tensor]:
    """(m per row, the read position's logits) of one forward of ``batch``. A metric that reads the clean
    run's logits reads ``pb.clean_logits``, and before they are known (the clean run itself) its own."""
    logits = vlm.hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    if metric.reads_clean and pb.clean_logits is None:
        pb = dataclasses.replace(pb, clean_logits=logits.detach())
    return metric(logits, pb), logits.detach()


@torch.no_grad()
def _record(vlm: VLM, batch: Batch, layer: int, pb: PairBatch, metric: Metric) -> tuple[Tensor, Tensor, Tensor]:
    """(layer ``layer``'s input, m per row, the logits) in one plain forward."""
    store: dict = {}
    with _at_input(vlm, layer, store, None):
        m, logits = _metric(vlm, batch, pb, metric)
    return store["x"], m, logits


def _gradient(
    vlm: VLM, batch: Batch, layer: int, pb: PairBatch, value: Tensor | None, metric: Metric
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(the input, ∂Σm/∂input, m per row, the logits) from one forward and backward, the input ``value``
    or the batch's own."""
    store: dict = {}
    leaf = None if value is None else value.detach().clone().requires_grad_(True)
    with activation_gradients_only(vlm.hf), torch.enable_grad(), _at_input(vlm, layer, store, leaf):
        m, logits = _metric(vlm, batch, pb, metric)
        (grad,) = torch.autograd.grad(m.sum(), store["x"])
    return store["x"].detach(), grad, m.detach(), logits


def per_token(
    vlm: VLM, pb: PairBatch, layer: int, method: str, steps: int, metric: Metric | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(a_t over (rows, seq) in float64, m(clean), m(reference)) for one chunk (see the module docstring),
    m the bound ``metric`` (None: the logit difference). The clean run goes first: a metric may read its
    logits."""
    metric = logit_diff() if metric is None else metric
    if method == "atp":
        x_clean, grad, m_clean, logits = _gradient(vlm, pb.clean, layer, pb, None, metric)
        grad = grad.double()
    else:
        x_clean, m_clean, logits = _record(vlm, pb.clean, layer, pb, metric)
    pb = metric.at_clean(pb, logits)
    x_ref, m_ref, _ = _record(vlm, pb.corrupt, layer, pb, metric)
    if method != "atp":
        grad = 0
        for k in range(1, steps + 1):
            point = x_ref + (k / steps) * (x_clean - x_ref)
            grad = grad + _gradient(vlm, pb.clean, layer, pb, point, metric)[1].double() / steps
    a = ((x_clean.double() - x_ref.double()) * grad).sum(-1)
    return a.cpu(), m_clean.double().cpu(), m_ref.double().cpu()


def check_request(
    vlm: VLM,
    samples,
    method_name: str,
    steps,
    coverage,
    batch_size,
    site,
    what: str,
    variants: tuple[str, ...] = OBJECT_VARIANTS,
    peak: bool = True,
    refusal: Callable[[VLM], str | None] | None = None,
):
    """Every argument checked, and the scenes prepared against their references, before any forward:
    (steps, the input layer, the pairs, their prepared chunks). ``variants``: the ``method`` values
    ``what`` takes, every one but "eap-ig" one gradient; ``refusal``: why the model cannot run them
    (None: it can), as the registry's method has it (`countlens.circuits.graph.edges.refusal` for edges)."""
    require_vlm(vlm, what)
    require_choice(method_name, f"{what} method", variants)
    why = None if refusal is None else refusal(vlm)
    if why is not None:
        raise InputError(f"{what}: method={method_name!r} does not run on {vlm.name}: {why}")
    require_local(vlm, what)
    if vlm.arch.spec.cross_attention is not None:
        raise InputError(
            f"{what}: {vlm.arch.name} has no image tokens (its image reaches the text as image states), so an "
            "object has no span of positions to attribute to"
        )
    if method_name != "eap-ig" and steps not in (None, 1):
        raise InputError(
            f"{what}: method={method_name!r} takes one gradient, the clean input's; steps={steps!r} is "
            "EAP-IG's (method='eap-ig')"
        )
    steps = 1 if method_name != "eap-ig" else IG_STEPS if steps is None else require_count(steps, "steps")
    require_share(coverage, "coverage")
    require_count(batch_size, "batch_size")
    if not isinstance(peak, (bool, np.bool_)):
        raise InputError(f"{what}: peak={peak!r}: give True (an object owns at least its peak cell's token) or False")
    layer = input_layer(vlm, site)
    samples = require_sequence(samples, "samples", example="countingtricks(['1A'], 8, grid=vlm.geometry)")
    pairs = [ReferencePair(s, reference_sample(s, f"sample {i}"), index=i) for i, s in enumerate(samples)]
    for i, p in enumerate(pairs):  # else prepare_pairs would call the pair "the same picture"
        if np.array_equal(np.asarray(p.clean.image), np.asarray(p.corrupt.image)):
            raise InputError(
                f"{what}: sample {i}'s objects are all outside the image (it renders as its background): no object "
                "has a token to attribute to; draw its objects inside the image or leave the sample out"
            )
    chunks = [prepare_pairs(vlm, pairs[i : i + batch_size]) for i in range(0, len(pairs), batch_size)]
    peak = True if peak is None else peak
    owned = (
        pos for pb in chunks for b, s in enumerate(pb.clean.samples) for pos in spans(pb.clean, b, s, coverage, peak)
    )
    if not any(len(pos) for pos in owned):
        raise InputError(
            f"{what}: no object of these {len(samples)} scenes covers an image token at coverage {coverage} "
            f"(peak={peak}): there is nothing to attribute to. Lower coverage, or set peak=True so that every object "
            "with a pixel in the image owns its largest cell"
        )
    return steps, layer, pairs, chunks


def object_attribution(
    vlm: VLM,
    samples: Sequence,
    method: str = "atp",
    steps: int | None = None,
    coverage: float = 0.25,
    batch_size: int = 16,
    site: Residual | Embed = Residual(-1),
    peak: bool = True,
    metric=None,
) -> xr.Dataset:
    """Every object of every scene scored by AtP (``method="atp"``) or EAP-IG (``"eap-ig"``, ``steps``
    points, default `IG_STEPS`) against the scene's background (see the module docstring), of ``metric``
    (`countlens.circuits.metrics`; default the logit difference; AtP refuses one stationary at the clean
    run, such as ``kl``, which EAP-IG takes):
    ``score`` over (``scene``, ``object``: the index into ``sample.scene.objects``; NaN beyond a scene's
    own objects) with ``tokens`` (each span's size); per scene ``objects`` (the spans' union), ``overlap``,
    ``background``, ``text``, ``image_total`` = m(clean) − m(reference), ``clean_metric``,
    ``reference_metric`` and, for EAP-IG, ``completeness_error``."""
    what = "object_attribution"
    if not isinstance(peak, bool):
        raise InputError(f"{what}: peak is True or False; got {peak!r}")
    steps, layer, pairs, chunks = check_request(
        vlm, samples, method, steps, coverage, batch_size, site, what, peak=peak
    )
    metric = metric_for(vlm, pairs, metric, f"{what} (method={method!r})", moving=method == "atp")
    n, width = len(pairs), max(len(p.clean.scene.objects) for p in pairs)
    score = np.full((n, width), np.nan)
    tokens = np.zeros((n, width), dtype=np.int64)
    per_scene = {
        k: np.zeros(n) for k in ("objects", "overlap", "background", "text", "clean_metric", "reference_metric")
    }
    row = 0
    for pb in chunks:
        owned = [spans(pb.clean, b, s, coverage, peak) for b, s in enumerate(pb.clean.samples)]
        a, m_clean, m_ref = per_token(vlm, pb, layer, method, steps, metric)
        for b, objs in enumerate(owned):
            image = torch.zeros(a.shape[1], dtype=torch.bool)
            image[pb.clean.image_pos[b]] = True
            real = pb.clean.inputs["attention_mask"][b].bool()
            k = torch.zeros(a.shape[1], dtype=torch.int64)
            for i, pos in enumerate(objs):
                score[row, i] = float(a[b, pos].sum()) if len(pos) else np.nan  # hidden: as object_effects
                tokens[row, i] = len(pos)
                k[pos] += 1
            per_scene["objects"][row] = float(a[b, k > 0].sum())
            per_scene["overlap"][row] = float((a[b] * (k - 1).clamp(min=0)).sum())
            per_scene["background"][row] = float(a[b, image & (k == 0)].sum())
            per_scene["text"][row] = float(a[b, real & ~image].sum())
            per_scene["clean_metric"][row], per_scene["reference_metric"][row] = float(m_clean[b]), float(m_ref[b])
            row += 1
    total = per_scene["clean_metric"] - per_scene["reference_metric"]
    data = {"score": (("scene", "object"), score), "tokens": (("scene", "object"), tokens)}
    data |= {k: ("scene", v) for k, v in per_scene.items()} | {"image_total": ("scene", total)}
    if method == "eap-ig":
        summed = per_scene["objects"] + per_scene["background"] + per_scene["text"]
        data["completeness_error"] = ("scene", summed - total)
    grad, plain = (1, 1) if method == "atp" else (steps, 2)
    return xr.Dataset(
        data,
        coords={
            "scene": np.arange(n),
            "object": np.arange(width),
            "count": ("scene", [count_of(p.clean, "") for p in pairs]),
        },
        attrs=object_provenance(
            vlm,
            pairs,
            method,
            steps,
            coverage,
            peak,
            object_site(vlm, site),
            metric,
            forward_equivalents=(plain + 3 * grad) * len(chunks),
        ),
    )
