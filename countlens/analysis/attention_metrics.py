"""Where the answer position looks: attention diagnostics of visual grounding (MAS, VRA, Attn-IoU, ARS).

The answer's first token is read at the last prompt position, so that position's attention row is
what the answer sees. Per layer and sample we average it over heads and ask four questions, after
"Counting to Four" (Figure 3). MAS follows the paper's definition (read at one position); VRA and
ARS are **countlens's own** definitions (the paper gives numbers but no formula) and Attn-IoU is
countlens's reduction of the paper's per-head, pixel-mask IoU to a head mean on token cells, so
none of the three is comparable with the paper's figures (`docs/fidelity.md`). The paper's own
Attn-IoU, per layer-head against the object pixels, is the result's ``pixel_iou`` (its
binarisation threshold, which the paper does not give, is countlens's 0.5 × peak):

- **MAS**, Modality Attention Share: how much of the attention mass goes to image tokens at all
  (the head-mean of each head's share).
- **VRA**, Visual Region Attention: of that visual attention, the share that lands on image tokens
  whose cell holds an object.
- **Attn-IoU**: the visual attention back-projected onto the token grid, scaled to a maximum of 1,
  binarised at ``threshold`` (0.5: cells holding at least half the peak attention) and compared by
  IoU with the object cells. 1 = it looks exactly at the objects' cells, no more, no less.
- **ARS**, Attention Reward Score: the visual attention renormalised to a distribution over the grid
  cells, clipped at its 99th percentile (so one sink cell cannot dominate) and divided by that clip
  value (to [0, 1], independent of grid size); ARS = mean over object cells − mean over the other
  cells, in [−1, 1]: > 0 when attention prefers objects, < 0 when it prefers background.

**Object cells** (`object_cells`): a token cell is covered when the union of the object masks
covers ≥ ``coverage`` (25 %) of its pixels. A token of a 2×2-merging model (Qwen) spans 2×2 patches,
so a one-patch object covers at most π/16 ≈ 20 % of any cell and would mark none; with
``each_object=True`` (the default) each object therefore also marks the cell(s) holding the largest
part of it, so every drawn object is visible to the metrics. Cells are the token grid of the sample's
`Geometry`; a scene of another size is mapped onto that grid proportionally.

Undefined values are NaN: VRA with no visual attention, IoU with neither attended nor object cells,
ARS when all or none of the cells are object cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import xarray as xr
from torch import Tensor

from countlens.analysis.evaluate import score
from countlens.analysis.parse import parse_shape_count
from countlens.circuits.engine.attention import image_keys, last_token_attention
from countlens.errors import InputError
from countlens.model.arguments import require_layers, require_vlm
from countlens.model.cells import cell_edges, cell_sums, scene_edges
from countlens.model.geometry import Geometry
from countlens.model.vlm import check_samples
from countlens.reference.counting_to_four import attention as reference_attention
from countlens.results import provenance
from countlens.validate import require_count

if TYPE_CHECKING:
    from jaxtyping import Bool, Float, Int

    from countlens.model.vlm import VLM

METRICS: tuple[str, ...] = ("mas", "vra", "iou", "ars")
COVERAGE = 0.25
THRESHOLD = 0.5
QUANTILE = 0.99


# ----------------------------------------------------------------------------- object cells


def object_cells(
    scene, geometry: Geometry, coverage: float = COVERAGE, each_object: bool = True
) -> Bool[Tensor, "rows cols"]:
    """The token cells of ``geometry`` that hold an object.

    A cell is covered when the union of ``scene.masks()`` covers ≥ ``coverage`` of its pixels (a cell
    of a scene at the geometry's size is ``geometry.token_size`` px square). With ``each_object``,
    each object also marks the cell(s) holding most of its pixels (ties all marked).
    """
    if not 0 < coverage <= 1:
        raise InputError(f"coverage must be in (0, 1], got {coverage}; 0.25 is the documented default")
    rows, cols = scene_edges(scene, geometry)  # a strip the tower drops is in no cell
    masks = scene.masks()  # Bool[ndarray, "obj H W"]
    area = np.diff(rows)[:, None] * np.diff(cols)[None, :]
    covered = cell_sums(masks.any(0), rows, cols) >= coverage * area
    if each_object and len(masks):
        per_obj = cell_sums(masks, rows, cols)  # Int[ndarray, "obj rows cols"]
        peak = per_obj.max(axis=(1, 2), keepdims=True)
        covered |= ((per_obj == peak) & (peak > 0)).any(0)
    return torch.from_numpy(covered)


# ----------------------------------------------------------------------------- pure metrics on a grid


def grid_attention(
    image_attn: Float[Tensor, "... n_image"], cells: Int[Tensor, "n_image 2"], grid: tuple[int, int]
) -> Float[Tensor, "... rows cols"]:
    """Attention on image tokens back-projected onto the token grid.

    ``image_attn`` is Float[Tensor, "... n_image"], ``cells`` Int[Tensor, "n_image 2"] (row, col) per
    image token (`Batch.image_cell`); tokens at (−1, −1) (row-end newlines) are dropped, tokens that
    share a cell (a base and a high-resolution view) add up.
    """
    rows, cols = grid
    cells = cells.to(image_attn.device)
    keep = (cells >= 0).all(-1)
    flat = cells[keep, 0] * cols + cells[keep, 1]
    out = image_attn.new_zeros(*image_attn.shape[:-1], rows * cols)
    out.index_add_(-1, flat, image_attn[..., keep])
    return out.view(*image_attn.shape[:-1], rows, cols)


def _flat(grid_map: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    if grid_map.shape[-2:] != mask.shape[-2:]:
        raise InputError(
            f"attention grid {tuple(grid_map.shape[-2:])} and object cells {tuple(mask.shape[-2:])} "
            "differ; build both from the same Geometry"
        )
    return grid_map.flatten(-2).float(), mask.to(grid_map.device).flatten(-2).bool()


def region_share(
    grid_map: Float[Tensor, "... rows cols"], mask: Bool[Tensor, "rows cols"], visual: Float[Tensor, ...] | None = None
) -> Float[Tensor, ...]:
    """VRA: attention on object cells / ``visual`` (default: the grid's total).

    Pass the attention on *all* image tokens as ``visual`` when some image tokens have no cell.
    """
    m, obj = _flat(grid_map, mask)
    total = m.sum(-1) if visual is None else visual.float()
    hit = (m * obj).sum(-1)
    return torch.where(total > 0, hit / total.clamp_min(1e-30), torch.full_like(hit, float("nan")))


def attention_iou(
    grid_map: Float[Tensor, "... rows cols"], mask: Bool[Tensor, "rows cols"], threshold: float = THRESHOLD
) -> Float[Tensor, ...]:
    """Attn-IoU: IoU of {cells ≥ threshold · peak attention} with the object cells.

    NaN when both sets are empty (no attention and no objects).
    """
    m, obj = _flat(grid_map, mask)
    peak = m.amax(-1, keepdim=True)
    attended = (peak > 0) & (m >= threshold * peak)
    inter = (attended & obj).sum(-1).float()
    union = (attended | obj).sum(-1).float()
    iou = torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(inter, float("nan")))
    return iou.masked_fill(peak.squeeze(-1).isnan(), float("nan"))  # no attention map (no head, no softmax)


def pixel_attention_iou(
    grid_map: Float[Tensor, "... rows cols"], scene, threshold: float = THRESHOLD, geometry: Geometry | None = None
) -> Float[Tensor, ...]:
    """The paper's Attn-IoU: ``grid_map`` (Float[Tensor, "... rows cols"], one
    layer-head's map each) back-projected to the scene's pixels, each pixel taking its token cell's
    value, binarised at ``threshold`` · peak, and compared by IoU with the union of the object masks.

    Counted per cell, not per pixel: the attended pixels are whole cells, so the intersection is the
    object pixels of the attended cells. NaN when neither set has a pixel. ``geometry`` (the sample's
    `Geometry`; default: cells cut evenly over the whole scene): where its tower drops a strip
    (`Geometry.dropped`), the cells cover the seen part only and object pixels in the strip, which no
    token sees, count in neither set.
    """
    n_rows, n_cols = grid_map.shape[-2:]
    if geometry is not None:
        if geometry.token_grid != (n_rows, n_cols):
            raise InputError(
                f"pixel_attention_iou: the map is {n_rows}x{n_cols} cells but the geometry's token grid is "
                f"{geometry.token_grid}; give the geometry of the batch the map was read from (batch.geometry[b])"
            )
        rows, cols = scene_edges(scene, geometry)
    else:
        rows, cols = cell_edges(scene.height, n_rows, "high"), cell_edges(scene.width, n_cols, "wide")
    masks = scene.masks()
    obj = masks.any(0) if len(masks) else np.zeros((scene.height, scene.width), bool)
    obj = obj[: rows[-1], : cols[-1]]  # the pixels some cell covers
    on = torch.from_numpy(cell_sums(obj, rows, cols)).float().to(grid_map.device)  # object pixels per cell
    area = torch.from_numpy(np.diff(rows)[:, None] * np.diff(cols)[None, :]).float().to(grid_map.device)
    m = grid_map.float()
    peak = m.amax((-2, -1), keepdim=True)
    attended = ((peak > 0) & (m >= threshold * peak)).float()
    inter = (attended * on).sum((-2, -1))
    union = (attended * area).sum((-2, -1)) + float(obj.sum()) - inter
    iou = torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(inter, float("nan")))
    return iou.masked_fill(peak[..., 0, 0].isnan(), float("nan"))  # no attention map (no head, no softmax)


def attention_reward(
    grid_map: Float[Tensor, "... rows cols"], mask: Bool[Tensor, "rows cols"], quantile: float = QUANTILE
) -> Float[Tensor, ...]:
    """ARS: mean of the clipped, rescaled attention on object cells minus elsewhere.

    p = map / map.sum() over the cells; c = the ``quantile`` of p over the cells (linear
    interpolation); q = min(p, c) / c ∈ [0, 1]; ARS = mean(q[object]) − mean(q[¬object]) ∈ [−1, 1].
    NaN when the map is all zero or the mask is all True / all False.
    """
    m, obj = _flat(grid_map, mask)
    p = m / m.sum(-1, keepdim=True).clamp_min(1e-30)
    clip = torch.quantile(p, quantile, dim=-1, keepdim=True)
    q = torch.minimum(p, clip) / clip.clamp_min(1e-30)
    n_obj, n_bg = obj.sum(-1), (~obj).sum(-1)
    on = (q * obj).sum(-1) / n_obj.clamp_min(1)
    off = (q * ~obj).sum(-1) / n_bg.clamp_min(1)
    ok = (n_obj > 0) & (n_bg > 0) & (clip.squeeze(-1) > 0)
    return torch.where(ok, on - off, torch.full_like(on, float("nan")))


# ----------------------------------------------------------------------------- on a model


def _check(samples: Sequence, batch_size: int) -> None:
    listed = isinstance(samples, Sequence) and not isinstance(samples, (str, bytes))
    missing = [i for i, s in enumerate(samples) if getattr(s, "scene", None) is None] if listed else []
    if missing:
        raise InputError(
            f"samples {missing[:5]} have no scene (object masks); use TaskSample-like samples "
            "with .scene, e.g. from countlens.datasets.countingtricks"
        )
    check_samples(samples, "attention_metrics")
    require_count(batch_size, "batch_size")


def _sample_metrics(
    head_mean: Tensor, pos: Tensor, cells: Tensor, obj: Tensor, quantile: float, threshold: float
) -> dict[str, Tensor]:
    """Float[Tensor, "layer"] per metric from one sample's head-mean row Float[Tensor, "layer seq"]."""
    image = head_mean[:, pos.to(head_mean.device)]  # Float[Tensor, "layer n_image"]
    mas = image.sum(-1)
    grid = grid_attention(image, cells, tuple(obj.shape))
    return {
        "mas": mas,
        "vra": region_share(grid, obj, mas),
        "iou": attention_iou(grid, obj, threshold),
        "ars": attention_reward(grid, obj, quantile),
    }


def attention_metrics(
    vlm: VLM,
    samples: Sequence,
    layers: Sequence[int] | None = None,
    batch_size: int = 16,
    *,
    coverage: float = COVERAGE,
    threshold: float = THRESHOLD,
    quantile: float = QUANTILE,
    at: str = "prompt",
    max_new_tokens: int = 50,
) -> xr.Dataset:
    """MAS, VRA, Attn-IoU and ARS of the last prompt position: an xr.Dataset over (layer, sample).

    ``at="generation"``: read instead at the last generation step after greedy decoding (at most
    ``max_new_tokens``), as the MAS paper's released code does, and add that code's own diagnostics
    (`countlens.reference.counting_to_four.attention`): ``sets`` (layer, set, sample: the attention summed
    over the special, system, image and text positions; its `modality_shares` reduces them to the 4-way
    share), ``vra_code`` and ``ars_code`` (sample: VRA and ARS by the code's formulas — the names runs
    have stored); ``correct`` then reads the generated answer (`countlens.analysis.parse.parse_shape_count`)
    and ``text`` holds it.

    Also ``pixel_iou`` over (layer, head, sample): the paper's Attn-IoU, each head's own map against
    the object pixels (`pixel_attention_iou`). Per sample: ``correct`` (`countlens.analysis.evaluate.score`),
    ``object_share`` (the share of cells that are object cells: VRA's value under uniform
    attention), ``case``, ``count``, ``task``. On a cross-attention model (Llama-3.2-Vision) the image
    is its states (`countlens.circuits.engine.attention.image_keys`): MAS is 0 at self-attention layers and 1
    at cross-attention layers by construction, and VRA, Attn-IoU and ARS say where on the image the
    cross-attention looks — countlens's definitions, the papers define none there. Attention comes from
    `countlens.circuits.engine.attention.last_token_attention` (eager attention for that call only).
    """
    require_vlm(vlm, "attention_metrics")
    _check(samples, batch_size)
    if at not in ("prompt", "generation"):
        raise InputError(f"at={at!r}: read attention at the 'prompt' (its last token) or at the last 'generation' step")
    if at == "generation" and vlm.arch.spec.cross_attention is not None:
        raise InputError(
            "at='generation' reads the MAS code's diagnostics of image tokens; a cross-attention model has none"
        )
    asked = layers  # None: every layer, NaN where there are no probabilities (linear attention)
    layers = sorted(set(require_layers(vlm, layers, "attention_metrics") or range(vlm.arch.n_layers)))
    for layer in layers:
        vlm.arch.attention(layer)  # raises a LayerError naming the valid range
    rows: dict[str, list[Tensor]] = {k: [] for k in METRICS}
    share: list[float] = []
    pixel: list[Tensor] = []
    reference: dict[str, list] = {"sets": [], "vra_code": [], "ars_code": [], "text": []}
    reads = (
        reference_attention.generation_batches(vlm, samples, batch_size, max_new_tokens)
        if at == "generation"
        else ((chunk, batch, None) for chunk, batch in vlm.batches(samples, batch_size))
    )
    for chunk, batch, generated in reads:
        attn = last_token_attention(vlm, batch, asked and layers)  # Float[Tensor, "layer batch head seq"]
        head_mean = attn.nanmean(2)  # NaN: heads beyond a layer's own, or a linear-attention layer
        for b, s in enumerate(chunk):
            obj = object_cells(s.scene, batch.geometry[b], coverage)
            share.append(float(obj.float().mean()))
            keys, cells = image_keys(batch, b)
            if generated is not None:
                sets = reference_attention.chatml_sets(vlm, batch, b)
                reference["sets"].append(reference_attention.set_sums(head_mean[:, b], sets))
                image, ground = head_mean[:, b][:, keys], reference_attention.ground_tokens(cells, obj)
                reference["vra_code"].append(reference_attention.vra_as_reference(image, ground, quantile))
                reference["ars_code"].append(reference_attention.ars_as_reference(image, ground, quantile))
                reference["text"].append(vlm.tokenizer.decode(generated[b], skip_special_tokens=True).strip())
            got = _sample_metrics(head_mean[:, b], keys, cells, obj, quantile, threshold)
            for k in METRICS:
                rows[k].append(got[k])
            per_head = attn[:, b][..., keys.to(attn.device)]  # Float[Tensor, "layer head n_image"]
            grid = grid_attention(per_head, cells, batch.geometry[b].token_grid)
            pixel.append(pixel_attention_iou(grid, s.scene, threshold, batch.geometry[b]))
    scored = score(vlm, samples, batch_size=batch_size)
    data = {k: (("layer", "sample"), torch.stack(v, -1).numpy()) for k, v in rows.items()}
    data["pixel_iou"] = (("layer", "head", "sample"), torch.stack(pixel, -1).numpy())
    data |= {"object_share": ("sample", np.array(share)), "correct": ("sample", scored["correct"].values)}
    data |= {k: ("sample", scored[k].values) for k in ("case", "count", "task")}
    coords = {"layer": layers, "head": np.arange(vlm.arch.n_heads), "sample": np.arange(len(samples))}
    if at == "generation":
        read = [parse_shape_count(t, str(s.meta.get("shape", ""))) for t, s in zip(reference["text"], samples)]
        data["correct"] = ("sample", np.array([r == int(s.meta.get("count", -1)) for r, s in zip(read, samples)]))
        data["sets"] = (("layer", "set", "sample"), torch.stack(reference["sets"], -1).numpy())
        data |= {
            k: ("sample", np.array(reference[k], dtype=object if k == "text" else float))
            for k in ("vra_code", "ars_code", "text")
        }
        coords["set"] = list(reference_attention.SETS)
    return xr.Dataset(
        data,
        coords=coords,
        attrs={
            **provenance(vlm.name, vlm.arch.name, dataset={"samples": len(samples)}, samples=samples),
            "method": "attention_metrics",
            "position": "last generation step" if at == "generation" else "last prompt token",
            "coverage": coverage,
            "threshold": threshold,
            "quantile": quantile,
        },
    )


# ----------------------------------------------------------------------------- aggregation


def _outcomes(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {"all": df, "correct": df[df["correct"]], "incorrect": df[~df["correct"]]}


def aggregate(
    ds: xr.Dataset, by: str | None = "case", layers: Sequence[int] | None = None, per_layer: bool = False
) -> pd.DataFrame:
    """Mean MAS / VRA / IoU / ARS (NaN-skipping) and n per ``by`` value and outcome (all / correct / incorrect).

    Metrics are first averaged over ``layers`` (default: every layer of ``ds``) unless ``per_layer``,
    which keeps a ``layer`` index level. Index: (``by``, outcome[, layer]); ``by=None`` drops that level.
    """
    need = [*METRICS, "correct"] + ([by] if by else [])
    missing = [k for k in need if k not in ds.variables]
    if missing:
        raise InputError(
            f"the result has no {missing}; give an attention_metrics() result and group by one "
            f"of its variables {sorted(map(str, ds.data_vars))}"
        )
    if layers is not None:
        ds = ds.sel(layer=list(layers))
    vals = ds[list(METRICS)] if per_layer else ds[list(METRICS)].mean("layer", skipna=True)
    df = vals.assign({k: ds[k] for k in need if k not in METRICS}).to_dataframe().reset_index()
    df["correct"] = df["correct"].astype(bool)
    keys = ([by] if by else []) + (["layer"] if per_layer else [])
    parts = []
    for outcome, part in _outcomes(df).items():
        stats = part.groupby(keys)[list(METRICS)].mean() if keys else part[list(METRICS)].mean().to_frame().T
        n = part.groupby(keys)["sample"].nunique() if keys else pd.Series([part["sample"].nunique()])
        parts.append(stats.assign(n=n.values if not keys else n, outcome=outcome).reset_index(drop=not keys))
    out = pd.concat(parts, ignore_index=True)
    index = ([by] if by else []) + ["outcome"] + (["layer"] if per_layer else [])
    return out.set_index(index).sort_index()
