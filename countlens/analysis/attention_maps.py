"""Where heads look on the image, stored so that it can be drawn later without the model.

`attention_maps` reads, for a few samples, the last prompt position's attention on every image token,
per (layer, head), and keeps beside it everything a drawing needs: the image (as it was given to the
model, downsampled to at most `MAX_SIDE` px a side), its objects as a label image, and each image
token's base-grid cell and view (`countlens.model.layouts`). `countlens.analysis.overlays` draws it.

The attention is `countlens.circuits.engine.attention.last_token_attention` (eager attention for that call
only) at the image keys of `countlens.circuits.engine.attention.image_keys` — the rows MAS, VRA and
Attention-IoU read (`countlens.analysis.attention_metrics`) — not a second reading.

**Size rule.** Every head is stored when layers × heads × tokens × samples ≤ ``max_values``
(`MAX_VALUES` = 2²⁰ float32 values, 4 MiB; netCDF has no float16). Otherwise the first K heads of
``ranking`` are (K = ``max_values`` // (tokens × samples), at least one); without a ranking, the heads
with the largest mean image-attention share. The per-layer head mean (``layer_mean``) is always stored.

The result, an `xr.Dataset`:

- ``attention`` (site, sample, token): the head's attention on each image token, a site being one
  stored (layer, head) (coords ``site_layer``, ``site_head``); NaN where a head has no probabilities
  (a slot beyond a layer's own heads, a linear-attention layer) and at padding tokens;
- ``layer_mean`` (layer, sample, token): the mean over the layer's heads;
- ``cell_row``, ``cell_col``, ``view`` (sample, token): each token's base cell ((-1, -1): none, e.g. a
  row-end newline) and view (0 base, 1 finer; -1 padding, beyond a sample's ``n_tokens``);
- ``grid_rows``, ``grid_cols`` (sample): the base grid (the sample's `Geometry.token_grid`);
- ``image`` (sample, y, x, rgb) uint8 and ``objects`` (sample, y, x) uint8: 0 background, i the
  i-th object of the scene (objects painted in order, as the scene renders them); ``image_height``,
  ``image_width`` (sample): the stored image's size (smaller images are padded at the bottom right);
- any per-sample ``labels`` given (e.g. correct, case, count, pred).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.attention import image_keys, last_token_attention
from countlens.errors import InputError
from countlens.model.layouts import token_cells
from countlens.model.processors import useful_grid

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: The longest side of a stored image (px): 8 samples of 256 × 256 RGB are 1.5 MiB.
MAX_SIDE = 256
#: At most this many float32 attention values of single heads (4 MiB) before only the top heads are kept.
MAX_VALUES = 2**20


def _views(vlm: VLM, batch: Batch, b: int, image, n: int) -> np.ndarray:
    """Each image key's view, from the layout countlens already maps the keys' cells with
    (`countlens.model.layouts.token_cells`, as `VLM.prepare` calls it)."""
    spec, geom, tiles = vlm.arch.spec, batch.geometry[b], batch.tile_grids[b] if batch.tile_grids else None
    if batch.state_cells:  # a cross-attention model's image states
        return token_cells(spec.layout, geom, n, b, tiles).views.numpy()
    useful = useful_grid(vlm.processor, image.height, image.width)
    return token_cells(spec.layout, geom, n, b, tiles, useful).views.numpy()


def downsampled(sample) -> tuple[np.ndarray, np.ndarray]:
    """The sample's image and object labels, at most `MAX_SIDE` px a side (area-averaged pixels,
    nearest labels)."""
    from PIL import Image

    image = sample.image.convert("RGB")
    w, h = image.size
    labels = np.zeros((h, w), np.uint8)
    scene = getattr(sample, "scene", None)
    if scene is not None:
        masks = scene.masks()
        if len(masks) > 255:
            raise InputError(f"a scene with {len(masks)} objects: at most 255 are stored as labels; draw fewer")
        if masks.shape[1:] == (h, w):
            for i, m in enumerate(masks, start=1):  # later objects paint over earlier ones, as rendered
                labels[m] = i
    scale = min(1.0, MAX_SIDE / max(w, h))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    if size != (w, h):
        image = image.resize(size, Image.Resampling.BOX)
        labels = np.asarray(Image.fromarray(labels).resize(size, Image.Resampling.NEAREST))
    return np.asarray(image, np.uint8), labels


def _kept_sites(per_sample: list[np.ndarray], ranking, max_values: int) -> list[tuple[int, int]]:
    """The (layer, head) sites stored under the size rule (module docstring)."""
    n_layers, n_heads = per_sample[0].shape[:2]
    n_tokens, n_samples = max(a.shape[-1] for a in per_sample), len(per_sample)
    every = [(la, h) for la in range(n_layers) for h in range(n_heads)]
    if n_layers * n_heads * n_tokens * n_samples <= max_values:
        return every
    k = max(1, max_values // (n_tokens * n_samples))
    if ranking is None:  # the heads that look at the image most, on these samples
        share = np.nanmean([a.sum(-1) for a in per_sample], axis=0)  # (layer, head)
        ranking = sorted(every, key=lambda s: -np.nan_to_num(share[s], nan=-1.0))
    ranked = [(int(la), int(h)) for la, h in ranking]
    bad = [s for s in ranked if s not in every]
    if bad:
        raise InputError(f"ranking names heads {bad[:3]} the model lacks ({n_layers} layers × {n_heads} heads)")
    return ranked[:k]


def attention_maps(
    vlm: VLM,
    samples: Sequence,
    labels: Mapping[str, Sequence] | None = None,
    ranking: Sequence[tuple[int, int]] | None = None,
    batch_size: int = 8,
    max_values: int = MAX_VALUES,
) -> xr.Dataset:
    """The last prompt position's attention on each image token of ``samples``, per (layer, head), with
    the images, their objects and the tokens' cells and views (see the module docstring).
    ``labels``: per-sample values stored alongside (one per sample each); ``ranking``: the order in
    which heads are kept when not all fit in ``max_values``."""
    if len(samples) == 0:
        raise InputError("no samples given; pass a few samples with an image (e.g. COUNTINGTRICKS scenes)")
    labels = dict(labels or {})
    wrong = {k: len(v) for k, v in labels.items() if len(v) != len(samples)}
    if wrong:
        raise InputError(f"labels {wrong} do not have one value per sample ({len(samples)}); give one each")
    rows, cells, views, grids = [], [], [], []
    for chunk, batch in vlm.batches(samples, batch_size):
        attn = last_token_attention(vlm, batch)  # Float[Tensor, "layer batch head key"]
        for b, s in enumerate(chunk):
            keys, cell = image_keys(batch, b)
            rows.append(attn[:, b][..., keys].numpy())  # (layer, head, n_image)
            cells.append(cell.numpy())
            views.append(_views(vlm, batch, b, s.image, len(keys)))
            grids.append(batch.geometry[b].token_grid)
    sites = _kept_sites(rows, ranking, max_values)
    n = max(a.shape[-1] for a in rows)

    def pad(a: np.ndarray, fill) -> np.ndarray:  # samples may have different token counts (tiles)
        return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - a.shape[-1])], constant_values=fill)

    full = np.stack([pad(a, np.nan) for a in rows], 2).astype(np.float32)  # (layer, head, sample, token)
    with np.errstate(all="ignore"):  # a layer without probabilities is NaN, its mean too
        layer_mean = torch.from_numpy(full).nanmean(1).numpy()
    pictures = [downsampled(s) for s in samples]
    h, w = max(p[0].shape[0] for p in pictures), max(p[0].shape[1] for p in pictures)
    image = np.zeros((len(samples), h, w, 3), np.uint8)
    objects = np.zeros((len(samples), h, w), np.uint8)
    for i, (im, lab) in enumerate(pictures):
        image[i, : im.shape[0], : im.shape[1]], objects[i, : lab.shape[0], : lab.shape[1]] = im, lab
    data = {
        "attention": (("site", "sample", "token"), np.stack([full[la, hd] for la, hd in sites])),
        "layer_mean": (("layer", "sample", "token"), layer_mean),
        "cell_row": (("sample", "token"), np.stack([pad(c[:, 0], -1) for c in cells]).astype(np.int32)),
        "cell_col": (("sample", "token"), np.stack([pad(c[:, 1], -1) for c in cells]).astype(np.int32)),
        "view": (("sample", "token"), np.stack([pad(v, -1) for v in views]).astype(np.int32)),
        "n_tokens": ("sample", np.array([a.shape[-1] for a in rows], np.int32)),
        "grid_rows": ("sample", np.array([g[0] for g in grids], np.int32)),
        "grid_cols": ("sample", np.array([g[1] for g in grids], np.int32)),
        "image": (("sample", "y", "x", "rgb"), image),
        "objects": (("sample", "y", "x"), objects),
        "image_height": ("sample", np.array([p[0].shape[0] for p in pictures], np.int32)),
        "image_width": ("sample", np.array([p[0].shape[1] for p in pictures], np.int32)),
    }
    data |= {k: ("sample", np.asarray(v)) for k, v in labels.items()}
    every = len(sites) == vlm.arch.n_layers * vlm.arch.n_heads
    return xr.Dataset(
        data,
        coords={
            "site_layer": ("site", np.array([s[0] for s in sites], np.int32)),
            "site_head": ("site", np.array([s[1] for s in sites], np.int32)),
            "layer": np.arange(vlm.arch.n_layers),
            "sample": np.arange(len(samples)),
        },
        attrs={
            "model": vlm.name,
            "arch": vlm.arch.name,
            "layout": vlm.arch.spec.layout,
            "position": "last prompt token",
            "heads": "all" if every else f"top {len(sites)} of the ranking (max_values {max_values})",
        },
    )
