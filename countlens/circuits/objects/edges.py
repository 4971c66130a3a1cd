"""Edge attribution by object span: the edge from each object's image tokens to every receiver.

The scenes, their references (the scene without its objects), the metric m (default logit(n) −
logit(n − 1); any of `countlens.circuits.metrics`, EAP refusing ``kl``) and the spans are
`countlens.circuits.objects.gradients`'; the receivers are
`countlens.circuits.graph.edges`' (a head's ``q``, a key / value head's ``k`` and ``v``, a fused block's
``attn``, an MLP's ``in``, the ``logits``), named as there. The upstream node is the input of decoder
layer 0 (the token embeddings with the projected image tokens) at the object's span: the edge
object i → r carries Δ_t = x_clean,t − x_ref,t at the span's positions into r's own copy of the
residual stream (the embeddings reach every receiver directly). Per token t and receiver r, with
g_r,t = ∂m/∂x_r,t the gradient through r alone (`countlens.circuits.graph.edge_attribution.receiver_gradients`),

- **EAP**: e_r,t = Δ_t · g_r,t at the clean input (one backward per chunk of scenes);
- **EAP-IG** (``steps``, `countlens.circuits.graph.integrated.IG_STEPS` by default):
  e_r,t = Δ_t · (1/s) Σ_{k=1..s} g_r,t
  at x_ref + (k/s)(x_clean − x_ref), layer 0's whole input interpolated (`edge_attribution`'s points).

``score`` of object i and receiver r is Σ_{t ∈ span_i} e_r,t; ``objects``, ``overlap`` and
``background`` per receiver are as object_attribution forms them from a_t (the union of the spans, the
tokens counted more than once, the image tokens in no span); the text's edges are 0 (the same text
in both inputs). Scores are signed logit units, not normalised: > 0 raises logit(n) over logit(n − 1).

**Identities** (tested). On a model whose layers add exactly their attention and MLP outputs to the
residual stream (`countlens.circuits.graph.edges.check_additive`, run here on the first chunk), layer 0's
input reaches m only through the receivers' copies, each of which holds it plus upstream outputs, so
∂m/∂x_t = Σ_r g_r,t over **every** receiver of every layer, the logits included, at the same point.
Hence an object's edges summed over all receivers equal its node score, Σ_r score[i, r] =
`object_attribution` (EAP: ``method="atp"``; EAP-IG: ``"eap-ig"``, the same ``steps``) — only summed
over all receivers (layer 0's alone miss what later layers read of the embeddings through the
residual stream) and only with the gradients taken at the same points; it is no statement about the
exact effect. For EAP-IG, Σ_r (objects + background) = m(clean) − m(reference) up to the Riemann
sum's error (``completeness_error``). Per receiver, objects = Σ_i score[i, r] − overlap and objects +
background = Σ_{t ∈ image} e_r,t: summed over the scenes, that is the whole image's edge IN.image → r
of `edge_attribution` on the (scene, background) pairs, same method and steps, times −(Σ LD_ref −
Σ LD_clean) (its Δ is corrupt − clean, and it divides by that denominator).

Cost per chunk of scenes, in forward-equivalents: two plain forwards (both inputs recorded) and
``steps`` forwards with a backward (EAP: 1), 2 + 3·steps, and `check_additive`'s one forward once.
The receiver products are formed a chunk of image positions at a time (`CHUNK_BYTES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine.metrics import Metric, logit_diff, metric_for
from countlens.circuits.engine.pair_batch import PairBatch
from countlens.circuits.graph.edge_attribution import CHUNK_BYTES, EDGE_VARIANTS, gradient_pass, receiver_gradients
from countlens.circuits.graph.edges import EdgeGraph, check_additive, edge_graph
from countlens.circuits.graph.edges import refusal as edge_refusal
from countlens.circuits.graph.nodes import image_positions, record_nodes
from countlens.circuits.objects.effects import count_of
from countlens.circuits.objects.gradients import check_request, object_provenance, spans
from countlens.circuits.sites import Embed, Residual

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

# `object_edge_attribution`'s ``method`` values are `edge_attribution`'s (`EDGE_VARIANTS`: "eap", "eap-ig"),
# refused where edges are undefined (`countlens.circuits.graph.edges.refusal`, the registry's edge methods'
# refusal); the registry's `countlens.circuits.methods.registry.OBJECT_RANKERS` name the method each applies.

#: Per scene, after its objects' rows: the parts summed over groups of image tokens.
PARTS: tuple[str, ...] = ("objects", "overlap", "background")


def span_weights(pb: PairBatch, vlm: VLM, width: int, coverage: float, peak: bool) -> tuple[Tensor, list[int]]:
    """(rows, width + 3, seq) float64 weights: row b's objects' spans (1 at their tokens), then the
    union of the spans, each token's extra owners (k_t − 1) and the image tokens in no span; and the
    number of objects per row."""
    image = image_positions(vlm, pb.clean).cpu()
    rows, seq = image.shape
    w = torch.zeros(rows, width + len(PARTS), seq, dtype=torch.float64)
    counts = []
    for b, sample in enumerate(pb.clean.samples):
        owners = torch.zeros(seq, dtype=torch.float64)
        objs = spans(pb.clean, b, sample, coverage, peak)
        for i, pos in enumerate(objs):
            w[b, i, pos] = 1
            owners[pos] += 1
        w[b, width] = (owners > 0).double()
        w[b, width + 1] = (owners - 1).clamp(min=0)
        w[b, width + 2] = (image[b] & (owners == 0)).double()
        counts.append(len(objs))
    return w, counts


def _positions(vlm: VLM, graph: EdgeGraph, rows: int) -> int:
    """Positions one layer's receiver products cover at once within `CHUNK_BYTES` (the stacked
    cotangents, the norm's copies and the gradients: about three of each receiver's)."""
    per_layer = max(sum(r.layer == layer for r in graph.receivers) for layer in range(vlm.arch.n_layers + 1))
    return max(1, CHUNK_BYTES // (3 * per_layer * rows * vlm.arch.d_model * 8))


def span_edges(
    vlm: VLM, graph: EdgeGraph, pb: PairBatch, weights: Tensor, method: str, steps: int, metric: Metric | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(Σ_t weights[b, g, t] · e_r,t over (receivers, rows, groups), m(clean), m(reference)) for one chunk,
    float64 on the CPU (see the module docstring), m the bound ``metric`` (None: the logit difference)."""
    metric = logit_diff() if metric is None else metric
    ref, clean = (record_nodes(vlm, b, [Embed("image")], logits=True) for b in (pb.corrupt, pb.clean))
    pb = metric.at_clean(pb, clean["logits"])
    m_ref, m_clean = (metric(r["logits"], pb) for r in (ref, clean))
    x_ref, x_clean = ref["embed"], clean["embed"]
    image = image_positions(vlm, pb.clean).to(x_clean.device)
    delta = (x_clean.double() - x_ref.double()) * image[..., None]
    weights = weights.to(x_clean.device)
    where = image.any(0).nonzero()
    lo, hi = int(where.min()), int(where.max()) + 1
    size = _positions(vlm, graph, len(pb.clean))
    index = {r: j for j, r in enumerate(graph.receivers)}
    out = torch.zeros(len(graph.receivers), weights.shape[0], weights.shape[1], dtype=torch.float64)
    for k in range(1, steps + 1):
        point = x_clean if method == "eap" else x_ref + (k / steps) * (x_clean - x_ref)
        g = gradient_pass(vlm, graph, pb.clean, point, pb, metric)
        with torch.no_grad():
            for p0 in range(lo, hi, size):
                sl = slice(p0, min(hi, p0 + size))
                for layer in range(vlm.arch.n_layers + 1):
                    got = receiver_gradients(vlm, graph, layer, g, sl)
                    e = torch.stack([(delta[:, sl] * gr.double()).sum(-1) for gr in got.values()])
                    summed = torch.einsum("rbs,bgs->rbg", e, weights[:, :, sl]).cpu() / steps
                    for r, row in zip(got, summed):
                        out[index[r]] += row
        del g
    return out, m_clean.double().cpu(), m_ref.double().cpu()


def object_edge_attribution(
    vlm: VLM,
    samples: Sequence,
    method: str = "eap",
    steps: int | None = None,
    coverage: float = 0.25,
    peak: bool = True,
    batch_size: int = 16,
    metric=None,
) -> xr.Dataset:
    """Every object's edges to every receiver, by EAP (``method="eap"``) or EAP-IG (``"eap-ig"``,
    ``steps`` points, default `IG_STEPS`), against the scene's background, of ``metric``
    (`countlens.circuits.metrics`; default the logit difference; EAP refuses one stationary at the clean
    run, such as ``kl``, which EAP-IG takes) (see the module docstring): ``score`` over (``scene``,
    ``object``: the index into ``sample.scene.objects``, NaN beyond a scene's own objects; ``receiver``:
    `countlens.circuits.graph.edges`' labels, with ``layer`` and ``part`` coordinates) and ``tokens``
    (each span's size); per scene and receiver ``objects``, ``overlap`` and ``background``; per scene
    ``image_total`` = m(clean) − m(reference), ``clean_metric``, ``reference_metric`` and, for EAP-IG,
    ``completeness_error``. Every argument is checked, and a model whose edges are undefined refused,
    before any forward."""
    what = "object_edge_attribution"
    steps, _, pairs, chunks = check_request(
        vlm,
        samples,
        method,
        steps,
        coverage,
        batch_size,
        Residual(-1),
        what,
        EDGE_VARIANTS,
        peak=peak,
        refusal=edge_refusal,
    )
    metric = metric_for(vlm, pairs, metric, f"{what} (method={method!r})", moving=method == "eap")
    graph = edge_graph(vlm)  # the refusal above has built it once already
    n, width, n_r = len(pairs), max(len(p.clean.scene.objects) for p in pairs), len(graph.receivers)
    score = np.full((n, width, n_r), np.nan)
    tokens = np.zeros((n, width), dtype=np.int64)
    parts = {k: np.zeros((n, n_r)) for k in PARTS}
    measured = {k: np.zeros(n) for k in ("clean_metric", "reference_metric")}
    row = 0
    for pb in chunks:
        if not graph.checked:
            check_additive(vlm, graph, pb.clean)
        weights, counts = span_weights(pb, vlm, width, coverage, peak)
        got, m_clean, m_ref = span_edges(vlm, graph, pb, weights, method, steps, metric)
        for b, count in enumerate(counts):
            score[row, :count] = got[:, b, :count].T.numpy()
            tokens[row, :count] = weights[b, :count].sum(-1).long().numpy()
            for j, part in enumerate(PARTS):
                parts[part][row] = got[:, b, width + j].numpy()
            measured["clean_metric"][row], measured["reference_metric"][row] = float(m_clean[b]), float(m_ref[b])
            row += 1
    score[tokens == 0] = np.nan  # an object that owns no token (hidden) has no edge, as in object_effects
    total = measured["clean_metric"] - measured["reference_metric"]
    data = {"score": (("scene", "object", "receiver"), score), "tokens": (("scene", "object"), tokens)}
    data |= {k: (("scene", "receiver"), v) for k, v in parts.items()}
    data |= {k: ("scene", v) for k, v in measured.items()} | {"image_total": ("scene", total)}
    if method == "eap-ig":
        summed = (parts["objects"] + parts["background"]).sum(-1)
        data["completeness_error"] = ("scene", summed - total)
    return xr.Dataset(
        data,
        coords={
            "scene": np.arange(n),
            "object": np.arange(width),
            "receiver": [r.label for r in graph.receivers],
            "layer": ("receiver", [r.layer for r in graph.receivers]),
            "part": ("receiver", [r.part_name for r in graph.receivers]),
            "count": ("scene", [count_of(p.clean, "") for p in pairs]),
        },
        attrs=object_provenance(
            vlm,
            pairs,
            method,
            steps,
            coverage,
            peak,
            Residual(-1),
            metric,
            upstream="the object's image tokens at layer 0's input",
            forward_equivalents=(2 + 3 * steps) * len(chunks) + 1,
        ),
    )
