"""Activation patching over clean/corrupt count pairs: by layer (VAP), by head, and by attribution.

A pair's two images differ only in how many objects they show (`countlens.datasets.count_pairs`).
Patching copies activations of the corrupt run into the clean run at one site and asks how far the
clean prediction moves toward the corrupt answer. With LD = logit(clean answer) − logit(corrupt
answer) at the read position, a site's **effect** is the normalised logit-difference change
(Σ LD_patched − Σ LD_clean) / (Σ LD_corrupt − Σ LD_clean): 0 = no change, 1 = as corrupt. Its
**overwrite rate** is the share of pairs whose arg-max becomes the corrupt answer.

Multi-token answers (real tokenizers write "12" as "1", "2") are compared at the first token where
the two answers differ, their shared prefix teacher-forced on both sides (`countlens.answers`): for
10 vs 12 the read position is after "1" and LD = logit("0") − logit("2"); for 1 vs 10 it is the
end-of-answer token against "0"; two single-token answers share no prefix, so they are read at the
last prompt token.

- `patch_layers` (visual activation patching): the residual stream after layer l, over a token
  group (image tokens, the last prompt token, other text, all).
- `patch_heads`: one head's z (before o_proj) at layer l, over all or a group of positions.
- `attribution_patch` (AtP): the first-order estimate (z_corrupt − z_clean)·∂LD/∂z for every head
  and layer at once, from three passes (corrupt forward, clean forward and backward).

Architecture note: Qwen3-VL's DeepStack adds image features to the residual stream inside its first
decoder layers, so there patching the embeddings (layer −1) or an early layer does not carry all
the image's information — the image also enters below the patched site.

Speed: many sites are patched in one forward by *batch expansion* — the clean batch is stacked k
times and replica r receives site r's patch — so an L×H sweep costs about L·H/k forwards.
Long sweeps stream each chunk of pairs to a `countlens.results.SweepStore` and resume from it;
launched as several processes they split the chunks between them (`countlens.distributed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens import distributed
from countlens.circuits.edits import Edit, cache_run, run_edits
from countlens.circuits.sites import GROUPS, STATES, HeadZ, ImageStates, Residual, group_mask, heads_view
from countlens.circuits.sweep import open_store, run_chunks
from countlens.distributed import Shard
from countlens.errors import InputError
from countlens.results import SweepStore, provenance, samples_digest
from countlens.validate import require_count
from countlens.vlm import check_pairs

if TYPE_CHECKING:
    from jaxtyping import Int

    from countlens.vlm import VLM, Batch


@dataclass
class PairBatch:
    """A chunk of pairs prepared for patching: the two batches and each pair's two answer tokens."""

    clean: Batch
    corrupt: Batch
    clean_id: Int[Tensor, " pairs"]  # a leading space: one named dim (jaxtyping's spelling that linters accept)
    corrupt_id: Int[Tensor, " pairs"]


def check_pair_sweep(pairs: Sequence, batch_size: int = 1, what: str = "patching") -> None:
    check_pairs(pairs, what)
    require_count(batch_size, "batch_size")


def prepare_pairs(vlm: VLM, pairs: Sequence) -> PairBatch:
    """Prepare clean and corrupt batches and check that their token positions line up.

    Each pair's answers are compared where their token sequences first differ
    (`countlens.answers.divergence`): the shared prefix (e.g. "1" of 10 and 12) is teacher-forced on
    both sides, and ``clean_id`` / ``corrupt_id`` are the two tokens read at the position after it.
    """
    check_pair_sweep(pairs, what="prepare_pairs")
    from countlens.answers import divergence

    split = [
        divergence(vlm.answer_ids(p.clean.answer), vlm.answer_ids(p.corrupt.answer), (p.clean.answer, p.corrupt.answer))
        for p in pairs
    ]
    forced = [prefix for prefix, _, _ in split]

    def prep(side: Sequence) -> Batch:
        return vlm.prepare([s.image for s in side], [s.question for s in side], [s.answer for s in side], forced=forced)

    clean = prep([p.clean for p in pairs])
    corrupt = prep([p.corrupt for p in pairs])
    a, b = clean.inputs["input_ids"], corrupt.inputs["input_ids"]
    aligned = a.shape == b.shape and all(torch.equal(x, y) for x, y in zip(clean.image_pos, corrupt.image_pos))
    if not aligned or not torch.equal(clean.last, corrupt.last):
        raise InputError(
            f"clean and corrupt inputs do not line up (token shapes {tuple(a.shape)} vs {tuple(b.shape)}): "
            f"{vlm.arch.name} gives these images different numbers of image tokens. Patching needs the same "
            "positions on both sides: use images of one size and the same question in each pair"
        )
    for k, (g, h) in enumerate(zip(clean.geometry, corrupt.geometry)):
        if g.token_grid != h.token_grid:  # equal token counts on different grids would pass the check above
            raise InputError(
                f"pair {k}: the clean image gives a {g.token_grid} token grid and the corrupt one "
                f"{h.token_grid}, so image token i covers different cells; give both images one size"
            )
    # Tiles: equal token (or state) counts can come from different tile grids (1×2 and 2×1), and then
    # token i covers different cells; a cross-attention model's states must line up the same way.
    sides = zip(
        clean.tile_grids,
        corrupt.tile_grids,
        clean.state_cells or [None] * len(pairs),
        corrupt.state_cells or [None] * len(pairs),
    )
    for k, (g, h, sg, sh) in enumerate(sides):
        if g != h or (sg is not None and not torch.equal(sg, sh)):
            raise InputError(
                f"pair {k}: the clean image is cut into {g} tiles and the corrupt one into {h}, so image token "
                "(or state) i covers different cells; give both images one size"
            )
    for k, p in enumerate(pairs):
        # With the image layouts equal, image tokens (and any layout tokens) match: only the text can differ.
        if p.clean.question != p.corrupt.question or not torch.equal(a[k], b[k]):
            raise InputError(
                f"pair {k}: the clean and corrupt prompts differ outside the image ({p.clean.question!r} "
                f"vs {p.corrupt.question!r}); patching measures what the image changes, so each pair "
                "must share its question: build both sides with one prompt (count_pairs does)"
            )
    return PairBatch(clean, corrupt, torch.tensor([c for _, c, _ in split]), torch.tensor([d for _, _, d in split]))


def _logit_diff(logits: Tensor, clean_id: Tensor, corrupt_id: Tensor) -> Tensor:
    rows = torch.arange(len(logits))
    return logits[rows, clean_id.to(logits.device)] - logits[rows, corrupt_id.to(logits.device)]


def _summarise(patched_ld: Tensor, pred_corrupt: Tensor, clean_ld: Tensor, corrupt_ld: Tensor) -> tuple:
    denom = float(corrupt_ld.sum() - clean_ld.sum())
    effect = (patched_ld.sum(-1) - clean_ld.sum()) / denom
    return effect, pred_corrupt.float().mean(-1)


def _provenance(vlm: VLM, pairs: Sequence, **extra) -> dict:
    kinds = sorted({getattr(p, "kind", "?") for p in pairs})
    return provenance(vlm.name, vlm.arch.name, dataset={"pairs": len(pairs), "kinds": kinds}, **extra)


def sweep_pairs(
    vlm: VLM,
    pairs,
    make_edits,
    coords: dict,
    batch_size: int,
    store,
    progress: bool,
    shard: Shard | None = None,
    experts: bool = False,
) -> xr.Dataset:
    """Run ``make_edits(pair_batch)`` (one edit per site of the ``coords`` grid, in order; None for a
    slot that is no site: NaN there) over chunks of pairs; per-pair logit diffs (site…, pair).
    ``experts``: the corrupt cache records the MoE layers' experts inputs (expert edits copy from them).
    Sharded (`countlens.distributed`): this rank's chunks, then every rank's, read from the store."""
    check_pair_sweep(pairs, batch_size)
    shard = distributed.resolve(shard, store, "this patching sweep")
    shape = tuple(len(v) for v in coords.values())
    dims = tuple(coords)
    starts = {
        f"pairs_{start:06d}_{min(start + batch_size, len(pairs)):06d}": start
        for start in range(0, len(pairs), batch_size)
    }

    def chunk_result(start: int) -> xr.Dataset:
        chunk = pairs[start : start + batch_size]
        pb = prepare_pairs(vlm, chunk)
        cache = cache_run(vlm, pb.corrupt, range(-1, vlm.arch.n_layers), experts=experts)
        clean = cache_run(vlm, pb.clean, [], resid=False, z=False)["logits"]

        # Per replica only (LD, arg-max is the corrupt answer): the full logits of an L×H sweep would be
        # L·H·pairs·vocab floats (28·28·16·152k ≈ 7.6 GB at 7B).
        def read(rows: Tensor) -> Tensor:
            to_corrupt = (rows.argmax(-1) == pb.corrupt_id.to(rows.device)).float()
            return torch.stack([_logit_diff(rows, pb.clean_id, pb.corrupt_id), to_corrupt])

        edits = make_edits(pb)
        live = [i for i, e in enumerate(edits) if e is not None]  # None: a slot with no site (NaN)
        ran = run_edits(vlm, pb.clean, cache, [edits[i] for i in live], reduce=read)
        out = torch.full((len(edits), *ran.shape[1:]), float("nan"))
        out[live] = ran
        ld, pred = out[:, 0].contiguous(), out[:, 1] == 1
        pair = np.arange(start, start + len(chunk))
        return xr.Dataset(
            {
                "logit_diff": (dims + ("pair",), ld.view(*shape, len(chunk)).numpy()),
                "to_corrupt": (dims + ("pair",), pred.view(*shape, len(chunk)).numpy()),
                "clean_logit_diff": ("pair", _logit_diff(clean.cpu(), pb.clean_id, pb.corrupt_id).numpy()),
                "corrupt_logit_diff": ("pair", _logit_diff(cache["logits"].cpu(), pb.clean_id, pb.corrupt_id).numpy()),
                "clean_correct": ("pair", (clean.argmax(-1).cpu() == pb.clean_id).numpy()),
            },
            coords={**coords, "pair": pair},
        )

    parts = run_chunks(starts, chunk_result, store, shard, f"patching {len(pairs)} pairs" if progress else None)
    ds = xr.concat(parts, dim="pair", data_vars="minimal")
    ld, clean_ld, corrupt_ld = (
        torch.from_numpy(ds[v].values) for v in ("logit_diff", "clean_logit_diff", "corrupt_logit_diff")
    )
    effect, overwrite = _summarise(ld, torch.from_numpy(ds["to_corrupt"].values), clean_ld, corrupt_ld)
    overwrite = overwrite.masked_fill(effect.isnan(), float("nan"))  # no site: no overwrite either
    ds["effect"] = (dims, effect.numpy())
    ds["overwrite"] = (dims, overwrite.numpy())
    ds.attrs.update(_provenance(vlm, pairs))
    return ds


def pairs_store(store, spec: dict, pairs: Sequence) -> SweepStore | None:
    return open_store(
        store, lambda: {**spec, "pairs_digest": samples_digest(side for p in pairs for side in (p.clean, p.corrupt))}
    )


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
) -> xr.Dataset:
    """Visual activation patching: xr.Dataset with ``effect`` and ``overwrite`` over (layer, group)
    and per-pair ``logit_diff`` / ``to_corrupt`` over (layer, group, pair). Layers default to −1
    (the embeddings: input of layer 0) … n_layers − 1; groups to the image (`image_group`), the last
    position and the other text.

    A cross-attention model (Llama-3.2-Vision) has no image tokens; its ``image_states`` group patches
    the image states (`countlens.circuits.sites`): at layer −1 those every cross-attention layer reads
    (patching all of them there carries the whole effect), at a cross-attention layer those that layer
    alone reads. Self-attention layers read no image states: NaN effect there."""
    check_pair_sweep(pairs, batch_size, "patch_layers")
    layers = list(range(-1, vlm.arch.n_layers)) if layers is None else [int(x) for x in layers]
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

    def edits(pb: PairBatch) -> list[Edit]:
        masks = {g: group_mask(pb.clean, g) for g in groups if g != STATES}
        if STATES in groups:
            masks[STATES] = torch.ones(len(pb.clean), len(pb.clean.state_cells[0]), dtype=torch.bool)
        none = torch.zeros_like(pb.clean.inputs["attention_mask"], dtype=torch.bool)
        return [
            Edit(ImageStates(layer), masks[g])
            if g == STATES and layer in reads_states
            else Edit(Residual(layer), none if g == STATES else masks[g])  # a self-attention layer: nothing to patch
            for layer in layers
            for g in groups
        ]

    spec = {
        "sweep": "patch_layers",
        "model": vlm.name,
        "layers": layers,
        "groups": list(groups),
        "pairs": len(pairs),
        "batch_size": batch_size,
    }
    ds = sweep_pairs(
        vlm,
        pairs,
        edits,
        {"layer": layers, "group": list(groups)},
        batch_size,
        pairs_store(store, spec, pairs),
        progress,
        shard,
    )
    if STATES in groups:
        unread = xr.DataArray([layer not in reads_states for layer in layers], coords={"layer": layers})
        here = unread & (ds.group == STATES)
        for name in ("effect", "overwrite", "logit_diff"):
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
) -> xr.Dataset:
    """Head patching of z: ``effect`` / ``overwrite`` over (layer, head); per pair over (layer, head, pair).
    ``positions``: the token group whose z is patched ("all", "image", "last" or "text"). Every layer
    kind's heads (`countlens.arch.LayerKind`: the ``kind`` coordinate); NaN beyond a layer's own heads."""
    check_pair_sweep(pairs, batch_size, "patch_heads")
    layers = list(range(vlm.arch.n_layers)) if layers is None else [int(x) for x in layers]
    for layer in layers:
        vlm.arch.layer(layer)
    heads = list(range(vlm.arch.n_heads))
    arch = vlm.arch

    def edits(pb: PairBatch) -> list[Edit | None]:
        mask = group_mask(pb.clean, positions)
        # A layer with fewer heads than the widest (Qwen3.5: value heads vs attention heads): NaN beyond.
        return [
            Edit(HeadZ(layer, head), mask) if head < arch.heads(layer) else None for layer in layers for head in heads
        ]

    spec = {
        "sweep": "patch_heads",
        "model": vlm.name,
        "layers": layers,
        "positions": positions,
        "pairs": len(pairs),
        "batch_size": batch_size,
    }
    ds = sweep_pairs(
        vlm,
        pairs,
        edits,
        {"layer": layers, "head": heads},
        batch_size,
        pairs_store(store, spec, pairs),
        progress,
        shard,
    )
    # Each layer's kind: full, sliding or chunked self-attention, linear attention, or cross-attention.
    ds = ds.assign_coords(kind=("layer", [vlm.arch.kind(layer) for layer in layers]))
    ds.attrs.update(method="patch_heads", positions=positions)
    return ds


def attribution_patch(vlm: VLM, pairs: Sequence, positions: str = "all", batch_size: int = 16) -> xr.Dataset:
    """AtP: first-order estimates of head patching (``effect`` over (layer, head)) and of residual
    patching over ``positions`` (``resid_effect`` over layer), normalised like the exact sweeps."""
    check_pair_sweep(pairs, batch_size, "attribution_patch")
    n_layers, n_heads = vlm.arch.n_layers, vlm.arch.n_heads
    head_est = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    resid_est = torch.zeros(n_layers, dtype=torch.float64)
    clean_sum = corrupt_sum = 0.0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        pb = prepare_pairs(vlm, chunk)
        corrupt = cache_run(vlm, pb.corrupt, range(n_layers))
        mask = group_mask(pb.clean, positions)
        zs, hs, gz, gh = [], [], [], []
        params = [p for p in vlm.hf.parameters() if p.requires_grad]
        for p in params:  # gradients only for activations: no parameter .grad buffers
            p.requires_grad_(False)
        try:
            with torch.enable_grad(), vlm.read(pb.clean):
                for layer in range(n_layers):
                    z = vlm.module(vlm.arch.o_proj(layer)).input
                    z.requires_grad_(True)
                    zs.append(z.save())
                    h = vlm.module(vlm.arch.layer(layer)).output
                    h.requires_grad_(True)
                    hs.append(h.save())
                logits = vlm.nn.output.logits[:, -1].float()
                ld = _logit_diff(logits, pb.clean_id, pb.corrupt_id)
                clean_ld = ld.detach().save()
                with ld.sum().backward():
                    for layer in reversed(range(n_layers)):
                        gh.append(hs[layer].grad.save())
                        gz.append(zs[layer].grad.save())
        finally:
            for p in params:
                p.requires_grad_(True)
        gz, gh = gz[::-1], gh[::-1]
        m = mask.to(torch.float64)
        for layer in range(n_layers):
            dz = (corrupt["z"][layer].double() - zs[layer].detach().double()) * gz[layer].double()
            per_head = heads_view(dz, vlm.arch.heads(layer)).sum(-1) * m[..., None].to(dz.device)
            head_est[layer, : vlm.arch.heads(layer)] += per_head.sum((0, 1)).cpu()
            dh = (corrupt["resid"][layer].double() - hs[layer].detach().double()) * gh[layer].double()
            resid_est[layer] += (dh.sum(-1) * m.to(dh.device)).sum().cpu()
        clean_sum += float(clean_ld.sum())
        corrupt_sum += float(_logit_diff(corrupt["logits"], pb.clean_id, pb.corrupt_id).sum())
    denom = corrupt_sum - clean_sum
    for layer in range(n_layers):  # beyond a layer's own heads: no site
        head_est[layer, vlm.arch.heads(layer) :] = float("nan")
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
        attrs={**_provenance(vlm, pairs), "method": "attribution_patch", "positions": positions},
    )
    return ds


def compare(estimate: xr.DataArray, exact: xr.DataArray, k: int = 10) -> dict:
    """How well an estimate (AtP) ranks sites like exact patching: Spearman ρ and top-k overlap of |effect|."""
    require_count(k, "k")
    a, b = estimate.values.ravel(), exact.transpose(*estimate.dims).values.ravel()
    sites = ~(np.isnan(a) | np.isnan(b))  # slots beyond a layer's own heads are no sites
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
