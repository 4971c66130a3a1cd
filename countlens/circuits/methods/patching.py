"""Activation patching over clean/corrupt count pairs: by layer (VAP), by head, and by attribution.

A pair's two images differ only in how many objects they show (`countlens.datasets.count_pairs`).
Patching copies activations of the corrupt run into the clean run at one site and asks how far the
clean prediction moves toward the corrupt answer. With M the metric (`countlens.circuits.metrics`;
default the logit difference LD = logit(clean answer) − logit(corrupt answer)) at the read position, a
site's **effect** is the normalised change (Σ M_patched − Σ M_clean) / (Σ M_corrupt − Σ M_clean):
0 = no change, 1 = as corrupt. Its **overwrite rate** is the share of pairs whose arg-max becomes the
corrupt answer.

Multi-token answers (real tokenizers write "12" as "1", "2") are compared at the first token where
the two answers differ, their shared prefix teacher-forced on both sides (`countlens.model.answers`): for
10 vs 12 the read position is after "1" and LD = logit("0") − logit("2"); for 1 vs 10 it is the
end-of-answer token against "0"; two single-token answers share no prefix, so they are read at the
last prompt token.

- `patch_layers` (visual activation patching): the residual stream after layer l, over a token
  group (image tokens, the last prompt token, other text, all); `countlens.circuits.sites.Residual`.
- `patch_heads`: one head's z (before o_proj) at layer l, over all or a group of positions;
  `countlens.circuits.sites.HeadZ`.
- `attribution_patch` (AtP): the first-order estimate (z_corrupt − z_clean)·∂M/∂z for every head
  and layer at once, from three passes (corrupt forward, clean forward and backward); a metric whose
  gradient vanishes at the clean run (``kl``) is refused; with
  ``method="atp*"``, AtP* (`countlens.circuits.methods.atp_star`: the QK fix and GradDrop).

Architecture note: Qwen3-VL's DeepStack adds image features to the residual stream inside its first
decoder layers, so there patching the embeddings (layer −1) or an early layer does not carry all
the image's information — the image also enters below the patched site.

Speed: many sites are patched in one forward by *batch expansion* — the clean batch is stacked k
times and replica r receives site r's patch — so an L×H sweep costs about L·H/k forwards.
The two exact sweeps are a grid of edits handed to `countlens.circuits.engine.sweep.sweep_pairs`, which
streams each chunk of pairs to a `countlens.sweep_store.SweepStore` and resumes from it; launched as
several processes they split the chunks between them (`countlens.distributed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.edits import cache_run
from countlens.circuits.engine.gradients import activation_gradients_only
from countlens.circuits.engine.interventions import Patch
from countlens.circuits.engine.metrics import metric_for, normalised
from countlens.circuits.engine.pair_batch import pairs_provenance, prepare_pairs
from countlens.circuits.engine.run import effect_sweep
from countlens.circuits.engine.sweep import check_pair_sweep
from countlens.circuits.methods.atp_star import atp_star
from countlens.circuits.sites import (
    GROUPS,
    STATES,
    HeadZ,
    ImageStates,
    Residual,
    check_group,
    group_mask,
    heads_view,
)
from countlens.distributed import Shard
from countlens.errors import InputError
from countlens.model.arguments import require_layers, require_vlm
from countlens.validate import require_choice, require_count, require_dataarray

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


def image_group(vlm: VLM) -> str:
    """Where the image is patched: its tokens ("image"), or a cross-attention model's states."""
    return STATES if vlm.arch.spec.cross_attention is not None else "image"


def patch_layers(
    vlm: VLM,
    pairs: Sequence,
    groups: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int = 16,
    store=None,
    progress: bool = False,
    shard: Shard | None = None,
    metric=None,
) -> xr.Dataset:
    """Visual activation patching: xr.Dataset with ``effect`` and ``overwrite`` over (layer, group)
    and per-pair ``logit_diff`` / ``to_corrupt`` over (layer, group, pair). Layers default to −1
    (the embeddings: input of layer 0) … n_layers − 1; groups to the image (`image_group`), the last
    position and the other text.

    A cross-attention model (Llama-3.2-Vision) has no image tokens; its ``image_states`` group patches
    the image states (`countlens.circuits.sites`): at layer −1 those every cross-attention layer reads
    (patching all of them there carries the whole effect), at a cross-attention layer those that layer
    alone reads. Self-attention layers read no image states: NaN effect there."""
    require_vlm(vlm, "patch_layers")
    check_pair_sweep(pairs, batch_size, "patch_layers")
    metric = metric_for(vlm, pairs, metric, "patch_layers")
    layers = require_layers(vlm, layers, "patch_layers", embeddings=True) or list(range(-1, vlm.arch.n_layers))
    groups = (image_group(vlm), "last", "text") if groups is None else tuple(groups)
    for layer in layers:
        if layer != -1:
            vlm.arch.layer(layer)  # raises a LayerError naming the valid range
    cross = vlm.arch.spec.cross_attention is not None
    allowed = (*GROUPS, STATES) if cross else GROUPS
    for g in groups:
        if g not in allowed:
            raise InputError(f"unknown token group {g!r}; use some of {allowed}")
        if g == "image" and cross:
            raise InputError(
                f"{vlm.arch.name} has no image tokens: its image reaches the text only through cross-attention; "
                f"patch the group {STATES!r} instead"
            )
    reads_states = {-1, *vlm.arch.cross_layers}

    # Each (layer, group) patches the residual over the group's tokens; a cross-attention model's image
    # states at layer −1 and its cross-attention layers (a self-attention layer reads none: no site).
    sets = [
        None
        if g == STATES and layer not in reads_states
        else [Patch(ImageStates(layer))]
        if g == STATES
        else [Patch(Residual(layer), positions=g)]
        for layer in layers
        for g in groups
    ]

    coords = {"layer": layers, "group": list(groups)}
    spec = {"layers": layers, "groups": list(groups)}
    ds = effect_sweep(vlm, pairs, sets, coords, "patch_layers", spec, batch_size, store, progress, shard, metric)
    if STATES in groups:
        unread = xr.DataArray([layer not in reads_states for layer in layers], coords={"layer": layers})
        here = unread & (ds.group == STATES)
        for name in ("effect", "overwrite", metric.name):
            ds[name] = ds[name].where(~here)
    ds.attrs["method"] = "patch_layers"
    return ds


def patch_heads(
    vlm: VLM,
    pairs: Sequence,
    layers: Sequence[int] | None = None,
    positions: str = "all",
    batch_size: int = 16,
    store=None,
    progress: bool = False,
    shard: Shard | None = None,
    metric=None,
) -> xr.Dataset:
    """Head patching of z: ``effect`` / ``overwrite`` over (layer, head); per pair over (layer, head, pair).
    ``positions``: the token group whose z is patched ("all", "image", "last" or "text"). Every layer
    kind's heads (`countlens.model.arch.LayerKind`: the ``kind`` coordinate); NaN beyond a layer's own heads."""
    require_vlm(vlm, "patch_heads")
    check_pair_sweep(pairs, batch_size, "patch_heads")
    metric = metric_for(vlm, pairs, metric, "patch_heads")
    check_group(positions)  # before the store's spec.json is written
    layers = require_layers(vlm, layers, "patch_heads") or list(range(vlm.arch.n_layers))
    for layer in layers:
        vlm.arch.layer(layer)
    heads = list(range(vlm.arch.n_heads))
    arch = vlm.arch

    # A layer with fewer heads than the widest (Qwen3.5: value heads vs attention heads): NaN beyond.
    sets = [
        [Patch(HeadZ(layer, head), positions=positions)] if head < arch.heads(layer) else None
        for layer in layers
        for head in heads
    ]

    spec = {"layers": layers, "positions": positions}
    coords = {"layer": layers, "head": heads}
    ds = effect_sweep(vlm, pairs, sets, coords, "patch_heads", spec, batch_size, store, progress, shard, metric)
    # Each layer's kind: full, sliding or chunked self-attention, linear attention, or cross-attention.
    ds = ds.assign_coords(kind=("layer", [vlm.arch.kind(layer) for layer in layers]))
    ds.attrs.update(method="patch_heads", positions=positions)
    return ds


#: `attribution_patch`'s ``method`` values: AtP, and AtP* (`countlens.circuits.methods.atp_star`).
ATP_VARIANTS: tuple[str, ...] = ("atp", "atp*")


def attribution_patch(
    vlm: VLM, pairs: Sequence, positions: str = "all", batch_size: int = 16, method: str = "atp", metric=None
) -> xr.Dataset:
    """AtP: first-order estimates of head patching (``effect`` over (layer, head)) and of residual
    patching over ``positions`` (``resid_effect`` over layer), normalised like the exact sweeps, of
    ``metric`` (`countlens.circuits.metrics`; default the logit difference). A metric whose gradient
    vanishes at the clean run (``kl``) is refused: every estimate would be 0.
    ``method="atp*"``: AtP* (`countlens.circuits.methods.atp_star.atp_star`: GradDrop on the heads' z, and the
    QK fix's per-head query, key and value estimates; magnitudes, no residual estimates)."""
    require_vlm(vlm, "attribution_patch")
    require_choice(method, "method", ATP_VARIANTS)
    if method == "atp*":
        return atp_star(vlm, pairs, positions=positions, batch_size=batch_size, metric=metric)
    check_pair_sweep(pairs, batch_size, "attribution_patch")
    check_group(positions)
    metric = metric_for(vlm, pairs, metric, "attribution_patch (AtP)", moving=True)
    n_layers, n_heads = vlm.arch.n_layers, vlm.arch.n_heads
    head_est = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    resid_est = torch.zeros(n_layers, dtype=torch.float64)
    clean_sum = corrupt_sum = 0.0
    differences = []  # per pair: M_corrupt − M_clean, for the normaliser's noise rule
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        pb = prepare_pairs(vlm, chunk)
        corrupt = cache_run(vlm, pb.corrupt, range(n_layers))
        mask = group_mask(pb.clean, positions)
        zs, hs, gz, gh = [], [], [], []
        clean_logits = None  # recorded where the metric reads the clean run's logits
        with activation_gradients_only(vlm.hf):
            with torch.enable_grad(), vlm.read(pb.clean):
                for layer in range(n_layers):
                    z = vlm.module(vlm.arch.o_proj(layer)).input
                    z.requires_grad_(True)
                    zs.append(z.save())
                    h = vlm.module(vlm.arch.layer(layer)).output
                    h.requires_grad_(True)
                    hs.append(h.save())
                logits = vlm.nn.output.logits[:, -1].float()
                if metric.reads_clean:  # a metric that reads the clean run's logits reads this very run's
                    clean_logits = logits.detach().save()
                ld = metric(logits, metric.at_clean(pb, clean_logits))
                clean_ld = ld.detach().save()
                with ld.sum().backward():
                    for layer in reversed(range(n_layers)):
                        gh.append(hs[layer].grad.save())
                        gz.append(zs[layer].grad.save())
        gz, gh = gz[::-1], gh[::-1]
        m = mask.to(torch.float64)
        for layer in range(n_layers):
            dz = (corrupt["z"][layer].double() - zs[layer].detach().double()) * gz[layer].double()
            per_head = heads_view(dz, vlm.arch.heads(layer)).sum(-1) * m[..., None].to(dz.device)
            head_est[layer, : vlm.arch.heads(layer)] += per_head.sum((0, 1)).cpu()
            dh = (corrupt["resid"][layer].double() - hs[layer].detach().double()) * gh[layer].double()
            resid_est[layer] += (dh.sum(-1) * m.to(dh.device)).sum().cpu()
        corrupt_ld = metric(corrupt["logits"], metric.at_clean(pb, clean_logits))
        clean_sum += float(clean_ld.sum())
        corrupt_sum += float(corrupt_ld.sum())
        differences.append((corrupt_ld.double() - clean_ld.double().to(corrupt_ld.device)).cpu().numpy())
    denom, noted = normalised(clean_sum, corrupt_sum, differences, metric)
    for layer in range(n_layers):  # beyond a layer's own heads: no site
        head_est[layer, vlm.arch.heads(layer) :] = float("nan")
    provenance = pairs_provenance(vlm, pairs, **noted)
    ds = xr.Dataset(
        {
            "effect": (("layer", "head"), (head_est / denom).numpy()),
            "resid_effect": ("layer", (resid_est / denom).numpy()),
        },
        coords={
            "layer": np.arange(n_layers),
            "head": np.arange(n_heads),
            "kind": ("layer", [vlm.arch.kind(layer) for layer in range(n_layers)]),
        },
        attrs={**provenance, "method": "attribution_patch", "positions": positions},
    )
    return ds


def compare(estimate: xr.DataArray, exact: xr.DataArray, k: int = 10) -> dict:
    """How well an estimate (AtP) ranks sites like exact patching: Spearman ρ and top-k overlap of |effect|."""
    require_count(k, "k")
    require_dataarray(estimate, "estimate")
    require_dataarray(exact, "exact", estimate.dims)
    if exact.shape != estimate.transpose(*exact.dims).shape:
        raise InputError(
            f"estimate {dict(estimate.sizes)} and exact {dict(exact.sizes)} cover other sites; compare like with like"
        )
    a, b = estimate.values.ravel(), exact.transpose(*estimate.dims).values.ravel()
    if np.isinf(a).any() or np.isinf(b).any():
        raise InputError("compare: a score is ±inf; compare results whose every score is finite (check the pairs)")
    if (np.isnan(a) != np.isnan(b)).any():
        raise InputError(
            f"compare: estimate and exact score different sites ({int((np.isnan(a) != np.isnan(b)).sum())} are NaN in "
            "one only), so a rank correlation would cover part of them; compare results over the same sites"
        )
    sites = ~np.isnan(a)  # slots beyond a layer's own heads are no sites in either
    a, b = a[sites], b[sites]
    k = min(k, len(a))
    top_a, top_b = set(np.argsort(-np.abs(a))[:k]), set(np.argsort(-np.abs(b))[:k])
    return {"spearman": spearman(a, b), "top_k": k, "top_k_overlap": len(top_a & top_b) / k}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ: Pearson's r of the ranks, tied values sharing their mean rank; NaN when either
    side is constant. (Written out: scipy.stats costs its importer over a second.)"""
    ra, rb = _mean_ranks(np.asarray(a, dtype=np.float64)), _mean_ranks(np.asarray(b, dtype=np.float64))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    norm = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / norm) if norm > 0 else float("nan")


def _mean_ranks(x: np.ndarray) -> np.ndarray:
    ranks = np.empty(len(x))
    ranks[np.argsort(x, kind="stable")] = np.arange(1, len(x) + 1)
    _, tie, size = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(tie, weights=ranks) / size)[tie]
