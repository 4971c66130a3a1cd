"""Which objects does the model count? Each object's exact effect on the count answer.

For every object of every scene, the object's image tokens in the scene's run are overwritten with
the same positions of a *reference* run, and the count answer's logit difference is read again.

Definitions (enough to re-implement the numbers):

- **Scene**: a generated sample (``sample.scene.objects``: an object list; a loaded benchmark image
  has none and is refused). Its count n is ``meta["count"]`` where the sample has one (an organism
  may count only some objects), else ``len(scene.objects)``; its answer is the sample's, and the
  answer for n − 1 is the same text with the number n replaced by n − 1.
- **Metric**: LD = the metric (`countlens.circuits.metrics`; default the logit difference logit(answer
  n) − logit(answer n − 1)) at the read position, read as countlens's patching reads a pair, the answer n
  its clean side and n − 1 its corrupt side (`countlens.circuits.engine.pair_batch`): where the two
  answers' tokens first differ (`countlens.model.answers.divergence`), their shared prefix
  teacher-forced. The default is the model's preference for the true count over the count it would give
  had it missed one object. The effect is exact, so any metric applies (``kl`` reads the scene's own
  run as the clean one). The per-scene and per-object variables below are named after the metric
  (``clean_logit_diff`` by default, ``clean_log_prob`` under ``log_prob``).
- **Object tokens**: `countlens.circuits.sites.positions.Objects` (``tokens(batch, b, sample)``): image token
  t is object i's when i covers ≥ ``coverage`` of the pixels of t's token cell, or, with ``peak``, when
  t's cell holds the largest share of i (`countlens.model.cells.object_cells`). Cells are the *token* cells
  the language model sees (the organism's merged 2×2 patches). A token two objects both claim is in
  both spans; ``shared_tokens`` counts, per object, its tokens that another object also owns.
- **References**: ``"removed"``: the scene drawn again without object i (same size, background and
  noise; one object fewer), one run per (scene, object); ``"background"``: the scene with no object,
  one run per scene. Both are prepared like the scene (same question and teacher-forced prefix) and
  must give the same token layout (same image size), else an `InputError`.
- **Site**: ``Residual(-1)`` (the default; or ``Embed("image")``, the same node): the input of decoder
  layer 0 at the object's image tokens — the projected image-token embeddings; ``Residual(L)``: the
  residual stream after decoder layer L. Results store the site's label (``"L-1.resid"``).
- **Effect** of object i: ``effect`` = LD(clean) − LD(clean with i's tokens patched from the
  reference run): positive when the object's tokens carry the count. ``normalised`` = effect /
  (LD(clean) − LD(reference run)): the share of the reference run's whole change that i's tokens
  carry (for "removed", 1 means its tokens carry all that removing the object does; for
  "background" the denominator is the whole image's change, so a scene's objects share it). NaN where
  that denominator is 0. The patch goes through countlens's own engine (`cache_run`, `run_edits` with
  an `Edit` whose value is the cached reference run's), the one under `effect` and `patch_layers`.
- **Hidden objects**: an object that covers no token at the chosen coverage (e.g. drawn outside
  the image area, so it has no pixel in it) is reported, not refused: ``n_tokens`` 0, ``effect``,
  ``normalised`` and the logit differences NaN (nothing to patch), and never run. If *no* object of
  the input covers a token, an `InputError` is raised before any forward.
- **Placement** on the ViT patch grid, as COUNTINGTRICKS places its position cases
  (`countlens.datasets.countingtricks`: grid line k is x = k·patch, the ViT patch, not the merged
  token cell): the object's centre (cx, cy) in patches, the nearest anchor among four lattices —
  cell centres (i+½, j+½), vertical-line midpoints (i, j+½), horizontal-line midpoints (i+½, j) and
  intersections (i, j) — gives ``anchor`` ("center", "vline", "hline", "cross") and ``placement``
  ("centred", "edge" for either line, "intersection"); ``offset``: the distance in patches from the
  centre to the nearest cell centre. ``token_placement`` / ``token_offset``: the same on the token
  cells (patch × merge).
- **Size**: ``size`` in patches (a circle's diameter, a square's side, a triangle's circumscribed
  diameter, over the ViT patch), ``size_px`` in pixels. **Contact**: ``touches``: the object's
  outline meets or overlaps another's (`countlens.datasets.contact.boundary_gap` ≤ 1e-6 px; exact).

Result: an xr.Dataset over dims ``scene`` (the samples, in order) and ``object`` (the index into
``sample.scene.objects``, padded to the largest count: ``exists`` is False on padding, where floats
are NaN). Token spans: ``covers`` Bool over (scene, object, token), ``token`` the index of the
scene's image tokens in sequence order (padding False), with their cell in ``token_row`` /
``token_col`` (−1 on padding). Per scene: ``count``, ``case`` (the sample's meta, "" if none),
``clean_logit_diff`` and ``clean_correct`` (the arg-max at the read position is the true answer's
token: the whole answer where counts are one token, as in the organism's vocabulary; where a tokenizer
splits digits, only the first token where n and n − 1 differ — a 10 read after "1" is not told from
11 or 12 — so give `object_misses` the run's own answers, ``wrong=``, as discover does). Cost in
forwards: S clean runs, plus N reference runs ("removed") or S ("background"), plus N patched runs,
for S scenes and N objects that cover a token; rows batched ``batch_size`` objects at a time (a chunk
holds whole scenes, at least one, so a scene of more objects makes a larger chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.engine.metrics import Metric, as_metric
from countlens.circuits.engine.pair_batch import PairBatch
from countlens.circuits.engine.record import location, require_local
from countlens.circuits.sites import Embed, Residual
from countlens.circuits.sites.positions import Objects
from countlens.datasets.contact import boundary_gap
from countlens.datasets.tasks import count_of, fewer_answer, without_objects
from countlens.errors import InputError, NoObjectTokensError
from countlens.model.answers import divergence
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.validate import require_choice, require_count, require_share

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

REFERENCES: tuple[str, ...] = ("removed", "background")
#: COUNTINGTRICKS anchor kinds (`countlens.datasets.countingtricks.Case.anchor`) → placement class.
CLASSES: dict[str, str] = {"center": "centred", "vline": "edge", "hline": "edge", "cross": "intersection"}
TOUCH_PX = 1e-6


def object_site(vlm: VLM, site) -> Residual:
    """``site`` as the Residual an object method reads there: a `Residual` (−1: layer 0's input, the
    projected image-token embeddings), or ``Embed("image")`` (the same, named as the input node)."""
    if isinstance(site, Embed) and site.part == "image":
        site = Residual(-1)
    if not isinstance(site, Residual):
        said = "Residual(-1) (or Embed('image'))" if isinstance(site, str) and site == "embed" else None
        if isinstance(site, (int, np.integer)) and not isinstance(site, bool):
            said = f"Residual({int(site)})"
        raise InputError(
            f"the object methods take a site of the residual stream, Residual(layer) (−1: the image-token "
            f"embeddings, layer 0's input) or Embed('image'); got {site!r:.60}" + (f": write {said}" if said else "")
        )
    location(vlm, site)  # a LayerError naming the model's layers
    return site


def _scenes(samples: Sequence, objects: Sequence[int] | None) -> list:
    """Each sample's scene, refused by name without an object list or without a chosen object."""
    chosen = Objects(0 if objects is None else objects)
    return [chosen.scene_of(s, f"sample {k}") for k, s in enumerate(samples)]


def _prepare(vlm: VLM, samples: Sequence, forced: Sequence) -> Batch:
    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples], None, forced=forced)
    batch.samples = list(samples)
    return batch


def _check_aligned(clean: Batch, ref: Batch, reference: str, rows: torch.Tensor) -> None:
    """Refuse a reference whose row ``rows[k]`` does not give clean row k's token layout."""
    a, b = clean.inputs["input_ids"], ref.inputs["input_ids"][rows.to(ref.inputs["input_ids"].device)]
    same = a.shape == b.shape and torch.equal(a, b)
    pairs = [(k, int(r)) for k, r in enumerate(rows)]
    same = same and all(torch.equal(clean.image_pos[k], ref.image_pos[r]) for k, r in pairs)
    same = same and all(clean.geometry[k].token_grid == ref.geometry[r].token_grid for k, r in pairs)
    if not same:
        raise InputError(
            f"the {reference!r} reference images do not give the scenes' token layout (token shapes "
            f"{tuple(a.shape)} vs {tuple(b.shape)}): patching needs the same positions on both sides; give "
            "scenes whose reference (same size, same question) tokenises alike"
        )


def _placement(u: float, v: float) -> tuple[str, float]:
    """(anchor kind, distance to the nearest cell centre) of a point (u, v) in cell units."""
    cx, cy = abs(u - (np.floor(u) + 0.5)), abs(v - (np.floor(v) + 0.5))
    lx, ly = abs(u - np.round(u)), abs(v - np.round(v))
    dist = {"center": np.hypot(cx, cy), "vline": np.hypot(lx, cy), "hline": np.hypot(cx, ly), "cross": np.hypot(lx, ly)}
    return min(dist, key=dist.get), float(dist["center"])


def _layout(vlm: VLM, samples: Sequence, scenes: Sequence, coverage: float, peak: bool, batch_size: int) -> dict:
    """Per scene, everything read before any forward: object tokens, placement, size, contact."""
    out: dict = {"spans": [], "cells": [], "objects": []}
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        batch = vlm.prepare([s.image for s in chunk], [s.question for s in chunk], None)
        batch.samples = list(chunk)
        for b, sample in enumerate(chunk):
            scene, geom = scenes[start + b], batch.geometry[b]
            pos = batch.image_pos[b]
            spans = []
            for i in range(len(scene.objects)):
                mine = Objects(i, coverage, peak).tokens(batch, b, sample)
                spans.append(torch.isin(pos, mine).numpy())
            out["spans"].append(np.array(spans, dtype=bool).reshape(len(scene.objects), len(pos)))
            out["cells"].append(batch.image_cell[b].numpy())
            rows = []
            for i, o in enumerate(scene.objects):
                p, t = geom.patch_size, geom.token_size
                anchor, offset = _placement(o.cx / p, o.cy / p)
                token_anchor, token_offset = _placement(o.cx / t, o.cy / t)
                others = [q for j, q in enumerate(scene.objects) if j != i]
                rows.append(
                    {
                        "anchor": anchor,
                        "placement": CLASSES[anchor],
                        "offset": offset,
                        "token_placement": CLASSES[token_anchor],
                        "token_offset": token_offset,
                        "size": o.size / p,
                        "size_px": float(o.size),
                        "cx": float(o.cx),
                        "cy": float(o.cy),
                        "shape": o.shape,
                        "touches": any(boundary_gap(o, q) <= TOUCH_PX for q in others),
                    }
                )
            out["objects"].append(rows)
    return out


@torch.no_grad()
def object_effects(
    vlm: VLM,
    samples: Sequence,
    reference: str = "removed",
    site: Residual | Embed = Residual(-1),
    coverage: float = 0.25,
    peak: bool = True,
    batch_size: int = 16,
    objects: Sequence[int] | None = None,
    metric=None,
) -> xr.Dataset:
    """Each object's exact effect on the count answer: its image tokens patched from the ``reference``
    run ("removed": the scene without it; "background": the scene without any object) at ``site``
    (Residual(layer), −1 the image-token embeddings; or Embed("image")). ``objects``: the object indices
    to measure in every scene (None: all; the others are NaN, their spans still reported). ``metric``:
    `countlens.circuits.metrics` (default the logit difference), any metric. Dataset over (scene,
    object); the module docstring defines every variable."""
    require_vlm(vlm, "object_effects")
    require_local(vlm, "object_effects")
    if vlm.arch.spec.cross_attention is not None:
        raise NoObjectTokensError(
            f"object_effects: {vlm.arch.name} has no image tokens (its image reaches the text as image states "
            "through cross-attention), so an object has no positions to patch"
        )
    check_samples(samples, "object_effects")
    reference = require_choice(reference, "reference", REFERENCES)
    site = object_site(vlm, site)
    coverage = require_share(coverage, "coverage")
    batch_size = require_count(batch_size, "batch_size")
    if not isinstance(peak, (bool, np.bool_)):
        raise InputError(
            f"object_effects: peak={peak!r}: give True (an object owns at least its peak cell's token) or False"
        )
    samples = list(samples)
    scenes = _scenes(samples, objects)
    counts = [len(s.objects) for s in scenes]  # objects per scene; the answer's count is the sample's own
    true = [count_of(s, f"sample {k}") for k, s in enumerate(samples)]
    fewer = [fewer_answer(s, n, f"sample {k}") for k, (s, n) in enumerate(zip(samples, true))]
    split = [divergence(vlm.answer_ids(s.answer), vlm.answer_ids(f), (s.answer, f)) for s, f in zip(samples, fewer)]
    metric = _scene_metric(vlm, metric, "object_effects", _prepare(vlm, samples[:1], [split[0][0]]), split[0])
    layout = _layout(vlm, samples, scenes, coverage, bool(peak), batch_size)
    chosen = set(range(max(counts))) if objects is None else set(Objects(objects).objects)
    live = [[bool(sp[i].any()) and i in chosen for i in range(n)] for sp, n in zip(layout["spans"], counts)]
    if not any(any(x) for x in live):
        raise NoObjectTokensError(
            f"no chosen object of these {len(samples)} scenes covers an image token at coverage {coverage} "
            f"(peak={bool(peak)}): there is nothing to patch. Lower coverage, or set peak=True so that every "
            "object with a pixel in the image owns its largest cell"
        )

    n_scenes, width = len(samples), max(counts)
    ld = {k: np.full((n_scenes, width), np.nan) for k in ("patched", "reference")}
    clean_ld, correct = np.full(n_scenes, np.nan), np.zeros(n_scenes, dtype=bool)
    for chunk in scene_chunks(counts, live, batch_size):
        forced = [split[s][0] for s in chunk]
        ids = (torch.tensor([split[s][1] for s in chunk]), torch.tensor([split[s][2] for s in chunk]))
        clean = _prepare(vlm, [samples[s] for s in chunk], forced)
        logits = cache_run(vlm, clean, [], resid=False, z=False)["logits"].cpu()
        # The chunk's scenes as pairs (answer n clean, n − 1 corrupt); both sides hold the scene's batch.
        reads = metric.reads_clean
        pb = PairBatch(clean, clean, *ids, forced=[list(f) for f in forced], clean_logits=logits if reads else None)
        clean_ld[chunk] = metric(logits, pb).numpy()
        correct[chunk] = (logits.argmax(-1) == ids[0]).numpy()
        items = [(r, s, i) for r, s in enumerate(chunk) for i in range(counts[s]) if live[s][i]]
        if not items:
            continue
        rows = torch.tensor([r for r, _, _ in items])
        item_ids = (ids[0][rows], ids[1][rows])
        item_clean = _prepare(vlm, [samples[s] for _, s, _ in items], [forced[r] for r, _, _ in items])
        if reference == "removed":
            refs = [without_objects(samples[s], [i]) for _, s, i in items]
            ref = _prepare(vlm, refs, [forced[r] for r, _, _ in items])
            _check_aligned(item_clean, ref, reference, torch.arange(len(items)))
            cache = cache_run(vlm, ref, [site.layer], z=False)
        else:  # one background run per scene, read by each of its objects' rows
            used = list(dict.fromkeys(r for r, _, _ in items))
            bg = [without_objects(samples[chunk[r]], range(counts[chunk[r]])) for r in used]
            ref = _prepare(vlm, bg, [forced[r] for r in used])
            of = torch.tensor([used.index(r) for r, _, _ in items])
            _check_aligned(item_clean, ref, reference, of)
            per_scene = cache_run(vlm, ref, [site.layer], z=False)
            resid = per_scene["resid"][site.layer]
            cache = {
                "resid": {site.layer: resid[of.to(resid.device)]},
                "logits": per_scene["logits"][of.to(resid.device)],
            }
        mask = torch.zeros_like(item_clean.inputs["input_ids"], dtype=torch.bool, device="cpu")
        for k, (_, s, i) in enumerate(items):
            pos = item_clean.image_pos[k]
            mask[k, pos[torch.from_numpy(layout["spans"][s][i])]] = True
        item_pb = PairBatch(
            item_clean,
            item_clean,
            *item_ids,
            forced=[pb.forced[r] for r, _, _ in items],
            clean_logits=logits[rows] if reads else None,
        )
        patched = run_edits(vlm, item_clean, cache, [Edit(site, mask)], reduce=lambda x, at=item_pb: metric(x, at))
        ref_ld = metric(cache["logits"].cpu(), item_pb)
        for k, (_, s, i) in enumerate(items):
            ld["patched"][s, i], ld["reference"][s, i] = float(patched[0, k]), float(ref_ld[k])

    ds = _dataset(vlm, samples, scenes, counts, true, layout, ld, clean_ld, correct, reference, site, coverage, peak)
    if metric.name != "logit_diff":
        ds = ds.rename({f"{k}_logit_diff": f"{k}_{metric.name}" for k in ("patched", "reference", "clean")})
    ds.attrs["metric"] = metric.provenance()
    return ds


def _scene_metric(vlm: VLM, metric, method: str, batch: Batch, split: tuple) -> Metric:
    """``metric`` bound to ``vlm`` and probed (`countlens.circuits.engine.metrics.metric_for`'s door, for
    scenes rather than pairs) on the first scene's prepared ``batch`` read at its answers' divergence
    ``split`` (prefix, n's token, n − 1's): no forward."""
    bound = as_metric(vlm, metric, method)
    prefix, clean_id, corrupt_id = split
    bound.probe(vlm, PairBatch(batch, batch, torch.tensor([clean_id]), torch.tensor([corrupt_id]), [list(prefix)]))
    return bound


def scene_chunks(counts: Sequence[int], live: Sequence, batch_size: int) -> list[list[int]]:
    """Scene indices in chunks of whole scenes holding at most ``batch_size`` live objects (≥ 1 scene)."""
    out, cur, held = [], [], 0
    for s in range(len(counts)):
        n = sum(live[s])
        if cur and (held + n > batch_size or len(cur) >= batch_size):
            out.append(cur)
            cur, held = [], 0
        cur.append(s)
        held += n
    return out + [cur] if cur else out


def _dataset(vlm, samples, scenes, counts, true, layout, ld, clean_ld, correct, reference, site, coverage, peak):
    n_scenes, width = len(samples), max(counts)
    T = max(len(c) for c in layout["cells"])
    exists = np.arange(width)[None, :] < np.array(counts)[:, None]
    covers = np.zeros((n_scenes, width, T), dtype=bool)
    token_row, token_col = np.full((n_scenes, T), -1), np.full((n_scenes, T), -1)
    for s, (sp, cells) in enumerate(zip(layout["spans"], layout["cells"])):
        covers[s, : sp.shape[0], : sp.shape[1]] = sp
        token_row[s, : len(cells)], token_col[s, : len(cells)] = cells[:, 0], cells[:, 1]
    n_tokens = covers.sum(-1)
    shared = (covers & (covers.sum(1, keepdims=True) > 1)).sum(-1)

    def per_object(key, fill, dtype):
        arr = np.full((n_scenes, width), fill, dtype=dtype)
        for s, rows in enumerate(layout["objects"]):
            for i, row in enumerate(rows):
                arr[s, i] = row[key]
        return arr

    effect = clean_ld[:, None] - ld["patched"]
    denom = clean_ld[:, None] - ld["reference"]
    with np.errstate(divide="ignore", invalid="ignore"):
        normalised = np.where(denom != 0, effect / denom, np.nan)
    so = ("scene", "object")
    data = {
        "effect": (so, effect),
        "normalised": (so, normalised),
        "patched_logit_diff": (so, ld["patched"]),
        "reference_logit_diff": (so, ld["reference"]),
        "exists": (so, exists),
        "n_tokens": (so, np.where(exists, n_tokens, 0)),
        "shared_tokens": (so, np.where(exists, shared, 0)),
        "covers": (("scene", "object", "token"), covers),
        "token_row": (("scene", "token"), token_row),
        "token_col": (("scene", "token"), token_col),
        "touches": (so, per_object("touches", False, bool)),
        "clean_logit_diff": ("scene", clean_ld),
        "clean_correct": ("scene", correct),
        "count": ("scene", np.array(true)),
        "case": ("scene", np.array([str(s.meta.get("case", "")) if s.meta else "" for s in samples])),
    }
    for key in ("offset", "token_offset", "size", "size_px", "cx", "cy"):
        data[key] = (so, per_object(key, np.nan, float))
    for key in ("anchor", "placement", "token_placement", "shape"):
        data[key] = (so, per_object(key, "", object).astype(str))
    ds = xr.Dataset(data, coords={"scene": np.arange(n_scenes), "object": np.arange(width), "token": np.arange(T)})
    ds.attrs.update(
        provenance(
            vlm.name,
            vlm.arch.name,
            dataset={"scenes": n_scenes, "objects": int(sum(counts))},
            samples=samples,
            method="object_effects",
            reference=reference,
            site=site.label,
            coverage=float(coverage),
            peak=bool(peak),
            definition="LD = the metric at the read position (answer n against answer n-1); "
            "effect = LD_clean - LD_patched; normalised = effect / (LD_clean - LD_reference)",
            no_tokens="objects covering no token (n_tokens 0) are not patched: their effect is NaN",
        )
    )
    return ds
