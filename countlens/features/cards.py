"""Feature cards: what one transcoder feature reads, where it fires in the image, and what it does to the count.

A transcoder feature f of layer l (`countlens.features.transcoder`) has an activation a_f(t) at every
token t: its encoder applied to the MLP's input there. Its **card** gathers, over a set of scenes:

- **top-activating scenes**: the ``top`` scenes with the largest maximum activation over their tokens,
  with the activation at every image token (one value per token-grid cell: the map `draw_card` draws
  over the image) and the position of the maximum (an image token, or a text position);
- **the objects it fires on**: per top scene, each object's largest activation over its image tokens
  (`countlens.circuits.sites.positions.Objects`: the cells it covers by ≥ 25 %, or its peak cell); an object
  counts as fired on where that is > 0, and ``fires_on_objects`` is the share of objects of the top
  scenes fired on;
- **its effect on the count logits**, two ways:
  *direct* — the virtual weight W_dec[f] ⊙ γ · W_U[c] of its decoder row to each count word c (γ the
  final norm's weight; the norm's scale, one positive number per position, left out), minus its mean
  over the count words: what one unit of activation writes toward each count, through the residual
  stream alone;
  *ablated* — in the model itself, the feature's write a_f(t) · W_dec[f] removed from the MLP's output
  at every token, the mean change of the log-probability of each top scene's answer token (a
  negative value: the feature helped the right count).

`feature_cards` returns an xarray Dataset over ``card`` (one per (layer, feature)); `draw_card` draws
one card's top scenes with their activation maps and object outlines. These are countlens's
definitions (circuit-tracer's feature pages show top activations over text only).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.interventions import Replace
from countlens.circuits.engine.record import record
from countlens.circuits.engine.run import intervene
from countlens.circuits.sites import MlpIn, MlpOut
from countlens.circuits.sites.positions import Objects
from countlens.errors import InputError
from countlens.features.replacement import check_fits
from countlens.labels import feature_keys, feature_label
from countlens.model.adapt import module_of
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.validate import require_count, require_dataset, require_path

if TYPE_CHECKING:
    from countlens.features.transcoder import TranscoderSet
    from countlens.model.vlm import VLM

COUNT_WORDS = tuple(str(i) for i in range(10))


def _check(vlm, transcoders, samples, features, top) -> list[tuple[int, int]]:
    require_vlm(vlm, "feature_cards")
    check_fits(vlm, transcoders, "feature_cards")
    check_samples(samples, "feature_cards")
    require_count(top, "top")
    if top > len(samples):
        raise InputError(f"top={top} exceeds the {len(samples)} samples given: give top ≤ len(samples)")
    out = list(feature_keys(features))  # pairs or "L1F17" labels: never a float rounded, never empty or twice
    for layer, f in out:
        if layer not in transcoders.layers or not 0 <= f < transcoders.d_transcoder:
            raise InputError(
                f"feature ({layer}, {f}) is not in the transcoder set (layers {list(transcoders.layers)}, "
                f"features 0–{transcoders.d_transcoder - 1})"
            )
    return out


@torch.no_grad()
def _activations(vlm, transcoders, batch, layers) -> dict[int, torch.Tensor]:
    """Per layer, the transcoder's activations (B, T, features) on ``batch``'s MLP inputs."""
    seen = record(vlm, batch, [MlpIn(layer) for layer in layers], on_device=True)
    tc = {layer: transcoders.layer(layer) for layer in layers}
    return {layer: tc[layer].encode(seen[MlpIn(layer)].to(tc[layer].dtype)).float() for layer in layers}


@torch.no_grad()
def _ablated_logprob(vlm, transcoders, batch, layer: int, f: int) -> torch.Tensor:
    """(B,) the answer token's log-probability with feature f's write removed from layer's MLP output."""
    tc = transcoders.layer(layer)

    def without_feature(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        write = tc.encode(x.to(tc.dtype))[..., f : f + 1] * tc.W_dec[f]
        return y - write.to(y.dtype)

    ablation = Replace(MlpOut(layer), without_feature, reads=(MlpIn(layer), MlpOut(layer)))
    with intervene(vlm, ablation), torch.no_grad():
        logits = vlm.hf(**batch.inputs, use_cache=False).logits
    rows = torch.arange(len(batch))
    return logits[rows, batch.last].float().log_softmax(-1)[rows, batch.answer_token]


def _answer_logprob(vlm, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = vlm.hf(**batch.inputs, use_cache=False).logits
    rows = torch.arange(len(batch))
    return logits[rows, batch.last].float().log_softmax(-1)[rows, batch.answer_token]


@torch.no_grad()
def _direct(vlm, transcoders, layer: int, f: int) -> np.ndarray:
    """The virtual weight of feature f's decoder row to each count word's logit, minus their mean."""
    ids = [vlm.answer_ids(w)[0] for w in COUNT_WORDS]
    gamma = getattr(module_of(vlm.hf, vlm.arch.final_norm), "weight", None)
    row = transcoders.layer(layer).W_dec[f].float()
    if gamma is not None:
        row = row * gamma.float().to(row.device)
    w_u = module_of(vlm.hf, vlm.arch.lm_head).weight[ids].float().to(row.device)
    v = (w_u @ row).cpu().numpy()
    return v - v.mean()


@torch.no_grad()
def feature_cards(
    vlm: VLM,
    transcoders: TranscoderSet,
    samples: Sequence,
    features: Sequence[tuple[int, int]],
    top: int = 6,
    batch_size: int = 32,
) -> xr.Dataset:
    """The cards (module docstring) of ``features`` ((layer, feature) pairs or labels such as
    ``"L1F17"``, read by `countlens.labels.feature_keys`) over ``samples`` (scenes with objects, e.g.
    `countlens.datasets.tasks.task_samples("count", 64, seed)`): per card the ``top`` scenes by maximum
    activation, their image-token activations and cells, each object's largest activation, the direct
    effect on each count word's logit and the ablated change of the answer's log-probability."""
    chosen = _check(vlm, transcoders, samples, features, top)
    require_count(batch_size, "batch_size")
    layers = sorted({layer for layer, _ in chosen})
    peak = np.full((len(chosen), len(samples)), -np.inf)
    where = np.zeros((len(chosen), len(samples)), dtype=int)
    maps: dict[tuple[int, int], np.ndarray] = {}
    cells: dict[int, np.ndarray] = {}
    objects: dict[tuple[int, int], np.ndarray] = {}
    image_peak = np.zeros((len(chosen), len(samples)), dtype=bool)
    for start, (chunk, batch) in zip(
        range(0, len(samples), batch_size), vlm.batches(samples, batch_size, answers=True), strict=True
    ):
        acts = _activations(vlm, transcoders, batch, layers)
        mask = batch.inputs["attention_mask"].bool()
        for b in range(len(chunk)):
            s = start + b
            pos = batch.image_pos[b]
            cells[s] = batch.image_cell[b].numpy()
            spans = [
                Objects(i).tokens(batch, b, chunk[b]) for i in range(len(getattr(chunk[b].scene, "objects", ()) or ()))
            ]
            for c, (layer, f) in enumerate(chosen):
                a = acts[layer][b, :, f].masked_fill(~mask[b], -np.inf)
                peak[c, s], where[c, s] = float(a.max()), int(a.argmax())
                image_peak[c, s] = bool(torch.isin(torch.tensor(where[c, s]), pos))
                maps[(c, s)] = acts[layer][b, pos, f].numpy()
                objects[(c, s)] = np.array([float(acts[layer][b, t, f].max()) if len(t) else np.nan for t in spans])
    ranked = np.argsort(-peak, axis=1, kind="stable")[:, :top]
    n_tok = max(len(cells[int(s)]) for s in ranked.flat)
    n_obj = max([len(objects[(c, int(s))]) for c in range(len(chosen)) for s in ranked[c]] + [1])
    act_map = np.full((len(chosen), top, n_tok), np.nan)
    cell = np.full((len(chosen), top, n_tok, 2), -1)
    obj = np.full((len(chosen), top, n_obj), np.nan)
    for c in range(len(chosen)):
        for r, s in enumerate(ranked[c]):
            m = maps[(c, int(s))]
            act_map[c, r, : len(m)] = m
            cell[c, r, : len(m)] = cells[int(s)]
            o = objects[(c, int(s))]
            obj[c, r, : len(o)] = o
    direct = np.stack([_direct(vlm, transcoders, layer, f) for layer, f in chosen])
    ablated = np.zeros(len(chosen))
    for c, (layer, f) in enumerate(chosen):
        picked = [samples[int(s)] for s in ranked[c]]
        batch = vlm.prepare_samples(picked, answers=True)
        ablated[c] = float((_ablated_logprob(vlm, transcoders, batch, layer, f) - _answer_logprob(vlm, batch)).mean())
    fired = np.where(np.isnan(obj), np.nan, obj > 0)
    ds = xr.Dataset(
        {
            "scene": (("card", "rank"), ranked),
            "max_activation": (("card", "rank"), np.take_along_axis(peak, ranked, 1)),
            "peak_position": (("card", "rank"), np.take_along_axis(where, ranked, 1)),
            "peak_on_image": (("card", "rank"), np.take_along_axis(image_peak, ranked, 1)),
            "activation": (("card", "rank", "token"), act_map),
            "cell": (("card", "rank", "token", "axis"), cell),
            "object_activation": (("card", "rank", "object"), obj),
            "fires_on_objects": (("card",), np.nanmean(fired.reshape(len(chosen), -1), axis=1)),
            "direct": (("card", "count"), direct),
            "ablated": (("card",), ablated),
        },
        coords={
            "card": [feature_label(c) for c in chosen],
            "layer": ("card", [layer for layer, _ in chosen]),
            "feature": ("card", [f for _, f in chosen]),
            "count": [int(w) for w in COUNT_WORDS],
            "axis": ["row", "col"],
        },
    )
    ds.attrs.update(
        provenance(
            vlm.name,
            vlm.arch.name,
            dataset={"samples": len(samples)},
            samples=samples,
            method="feature_cards",
            transcoders=transcoders.scan or "unnamed",
            top=top,
        )
    )
    return ds


#: What `draw_card` reads of `feature_cards`' result.
CARD_VARIABLES = ("card", "activation", "scene", "cell", "object_activation", "max_activation", "fires_on_objects")
CARD_VARIABLES += ("ablated",)


def draw_card(cards: xr.Dataset, card: str, samples: Sequence, path: str | Path) -> Path:
    """Draw ``card``'s top scenes: each image with its activation over the token grid (red, opacity
    ∝ activation / the card's maximum) and its objects' outlines (solid where the feature fires on them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, Rectangle

    require_dataset(cards, "draw_card's cards (feature_cards' result)", CARD_VARIABLES)
    path = require_path(path, "draw_card's path", example="'card.png'")
    if not isinstance(card, str) or card not in cards.card.values:
        raise InputError(f"no card {card!r}; the cards are {list(map(str, cards.card.values))}")
    check_samples(samples, "draw_card")
    c = cards.sel(card=card)
    if int(c.scene.max()) >= len(samples):
        raise InputError(
            f"card {card} shows scene {int(c.scene.max())} of the samples its cards were made from; {len(samples)} "
            "samples given: give draw_card those same samples"
        )
    top = c.sizes["rank"]
    fig, axes = plt.subplots(1, top, figsize=(2.2 * top, 2.5), squeeze=False)
    vmax = float(np.nanmax(c.activation.values)) or 1.0
    for r in range(top):
        ax = axes[0, r]
        sample = samples[int(c.scene[r])]
        image = np.asarray(sample.image)
        ax.imshow(image)
        h, w = image.shape[:2]
        grid = c.cell.values[r]
        rows, cols = int(grid[:, 0].max()) + 1, int(grid[:, 1].max()) + 1
        for t, (row, col) in enumerate(grid):
            a = c.activation.values[r, t]
            if row < 0 or not np.isfinite(a) or a <= 0:
                continue
            ax.add_patch(
                Rectangle((col * w / cols, row * h / rows), w / cols, h / rows, color="red", alpha=0.6 * a / vmax)
            )
        for i, o in enumerate(getattr(sample.scene, "objects", ()) or ()):
            fired = bool(c.object_activation.values[r, i] > 0)
            ax.add_patch(
                Circle((o.cx, o.cy), o.size / 2, fill=False, lw=1.5 if fired else 0.6, ls="-" if fired else ":")
            )
        ax.set_title(f"{float(c.max_activation[r]):.2f}", fontsize=8)
        ax.axis("off")
    fig.suptitle(
        f"{card}: fires on {float(c.fires_on_objects):.0%} of objects; ablated Δ log p {float(c.ablated):+.3f}"
    )
    path = Path(path)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path
