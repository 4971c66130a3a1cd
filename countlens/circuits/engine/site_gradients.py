"""Gradients at any site: each site's value, the gradient of a metric there, and input × gradient.

``gradients(vlm, data, sites, metric=None, positions="all")`` runs the engine's recorder with a metric
(`countlens.circuits.engine.record.record`: one forward and one backward per chunk of ``batch_size``) and
keeps, at each sample's tokens of ``positions``, the site's value x_t, the gradient g_t = ∂M/∂x_t of the
metric, and **input × gradient** x_t · g_t (their product summed over the site's width): the first-order
share of M that token t's value at the site carries, in the metric's units, signed.

``data`` is one of

- **count pairs** (`countlens.datasets.count_pairs`): the forward is each pair's clean run, read where its
  two answers first differ, and the metric is any of `countlens.circuits.metrics` over the `PairBatch`
  (default the logit difference), taken at the door as `effect` takes it (`metric_for`). A metric whose
  gradient vanishes at the clean run (``kl()``) is refused: every gradient would be zero;
- **samples** (`countlens.datasets.task_samples`, ``[p.clean for p in pairs]`` …): one answer each, so the
  metric reads the sample's own answer as the clean one (`sample_batch`: its first token, read after the
  prompt). The default is ``log_prob()``, the log-probability of that token; ``prob_mass([...])`` or a
  callable of the clean answer work too. A metric that needs a corrupt answer (``logit_diff``,
  ``log_prob(answer="corrupt")``) or the clean run's logits (``kl``) is refused, naming why.

``positions``: a token group's name (``"all"``, ``"image"``, ``"last"``, ``"text"``) or any positions
(`Cells`, `Objects`, a `Mask`); on pairs ``Objects(..., of="donor")`` reads the corrupt scene's objects
(their tokens in the clean run). A site with no gradient — a read-only one: an attention `Pattern`, a
`VisionBlock` — is refused, and so are an unknown position and a metric the data cannot feed, all before
any forward (every chunk is prepared and its positions resolved first).

The result, an `xr.Dataset` (a site's **positions** are each sample's chosen tokens in sequence order,
``position`` k the k-th of them; samples with fewer are NaN / −1 beyond their ``n_positions``):

- ``value``, ``gradient`` (site, sample, position, width): float32, the site's width on the last axis (a
  site narrower than the widest, a head among residual sites, is NaN beyond its ``site_width``);
- ``input_x_gradient`` (site, sample, position): Σ over the width of value × gradient;
- the metric per sample at the recorded run, named after it (``log_prob``, ``logit_diff`` …);
- coords ``site`` (each site's label, e.g. ``"L0H1"``, ``"L-1.resid"``), ``site_width`` (site), ``sample``,
  and, travelling with every variable a sample is taken from: ``token`` (sample, position), the token's
  index in the sample's own sequence (its first real token 0); ``cell_row``, ``cell_col``, an image
  token's cell of the image-token grid (−1 for any other token); ``grid_rows``, ``grid_cols`` (sample),
  that grid; ``n_positions`` (sample). So ``countlens.analysis.overlays.cell_map(ds.input_x_gradient.sel(
  site="L-1.resid").isel(sample=0))`` is one sample's map on its image-token grid, ready for ``overlay``;
- attrs: provenance (the model, the data's recipe), ``method`` "gradients", ``metric`` (its name and
  parameters), ``sites`` (the labels), ``positions`` and ``run`` (which run was read).

The gradient is the recorder's: of the metric summed over a chunk's rows, rows do not interact, so each
sample's gradient is its own metric's. Parameters take no gradient (`activation_gradients_only`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.circuits.engine.metrics import Metric, as_metric, log_prob, metric_for
from countlens.circuits.engine.pair_batch import PairBatch, batch_pairs, pairs_provenance
from countlens.circuits.engine.record import location, record, require_local
from countlens.circuits.sites.positions import Frame, as_positions
from countlens.errors import InputError
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_pairs, check_samples
from countlens.results import provenance
from countlens.validate import require_count, require_sequence

if TYPE_CHECKING:
    from countlens.model.vlm import VLM, Batch

#: The result's own names (variables, coords, dims): a metric may not be named after one of them.
VARIABLES = ("value", "gradient", "input_x_gradient", "token", "cell_row", "cell_col", "grid_rows", "grid_cols")
VARIABLES += ("n_positions", "site", "site_width", "sample", "position", "width")


class SampleBatch(PairBatch):
    """A `PairBatch` of samples: their batch as its clean side, each answer's first token as ``clean_id``.
    It has no corrupt side: ``corrupt`` is None, and a metric that reads ``corrupt_id`` is refused."""

    def __getattribute__(self, name: str):
        if name == "corrupt_id":
            raise InputError(
                "a metric read pair_batch.corrupt_id, and samples have no corrupt answer (each sample's own answer is "
                "its clean_id): give count pairs (count_pairs) for a metric of two answers, or a metric of each "
                "sample's own answer: log_prob(), prob_mass([...])"
            )
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return f"SampleBatch({len(self.clean)} samples)"


def sample_batch(vlm: VLM, batch: Batch) -> SampleBatch:
    """The `SampleBatch` of ``batch`` (prepared with its samples' answers): read after the prompt, nothing
    forced, each answer's first token as ``clean_id``."""
    return SampleBatch(batch, None, batch.answer_token, None, forced=[[] for _ in range(len(batch))])


def is_pairs(data) -> bool:
    """Whether ``data`` reads as count pairs (its first item has ``clean`` and ``corrupt``)."""
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or not data:
        return False
    first = data[0]
    try:  # static: a sample's ``image`` property would render its scene
        inspect.getattr_static(first, "clean")
        inspect.getattr_static(first, "corrupt")
    except AttributeError:
        return False
    return True


def sample_metric(vlm: VLM, samples: Sequence, metric) -> Metric:
    """``metric`` for samples, bound to ``vlm`` (None: ``log_prob()``, the sample's own answer), refused
    where it needs what samples lack, and probed on the first sample's batch (no forward)."""
    bound = as_metric(vlm, log_prob() if metric is None else metric, "gradients")
    fix = "give count pairs (count_pairs) for it, or a metric of each sample's own answer: log_prob(), prob_mass([...])"
    if bound.name == "logit_diff":
        raise InputError(
            "gradients: metric 'logit_diff' compares the clean answer with a corrupt one, and samples have one "
            f"answer each; {fix}"
        )
    if bound.name == "log_prob" and dict(bound.params).get("answer") == "corrupt":
        raise InputError(f"gradients: log_prob(answer='corrupt') reads a corrupt answer, and samples have none; {fix}")
    if bound.reads_clean or bound.stationary:
        raise InputError(
            f"gradients: metric {bound.name!r} compares the run with a clean run, and on samples that is the run "
            f"itself (its gradient there is zero); {fix}"
        )
    bound.probe(vlm, sample_batch(vlm, vlm.prepare_samples(samples[:1], answers=True)))  # reading corrupt: refused
    return bound


def gradient_sites(vlm: VLM, sites) -> list:
    """``sites`` (one or a list) checked against ``vlm``, each once: refused where one is no site, one the
    model lacks, or one with no gradient (read only)."""
    if hasattr(sites, "location") and not isinstance(sites, type):
        sites = [sites]
    sites = require_sequence(sites, "sites", example="[Residual(3), HeadZ(0, 1)]")
    for site in sites:
        loc = location(vlm, site)  # no site, or one the model lacks / hooks cannot reach
        if loc.io == "weights" or not hasattr(site, "layer"):
            what = "attention probabilities" if loc.io == "weights" else "the vision tower"
            raise InputError(
                f"{type(site).__name__} {site.label} is read only ({what}): "
                "it has no gradient of its own. Take gradients at Residual, HeadZ, Q, K, V, MlpIn, MlpOut or Logits "
                "(for attention, at the head's Q or K)"
            )
    sites = list(dict.fromkeys(sites))  # sites are frozen dataclasses: a repeat is kept once
    labels = [site.label for site in sites]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise InputError(f"two sites share the label {twice[0]!r}; give each site once")
    return sites


def gradients(vlm: VLM, data: Sequence, sites, metric=None, positions="all", batch_size: int = 16) -> xr.Dataset:
    """Each site's value, the metric's gradient there and input × gradient, at ``positions`` of each
    sample (or each pair's clean run): see the module docstring for ``data``, ``metric`` and the layout."""
    require_vlm(vlm, "gradients")
    require_local(vlm, "gradients")
    batch_size = require_count(batch_size, "batch_size")
    paired = is_pairs(data)
    (check_pairs if paired else check_samples)(data, "gradients")
    sites = gradient_sites(vlm, sites)
    where = as_positions(positions)
    where.check(vlm)
    bound = metric_for(vlm, data, metric, "gradients", moving=True) if paired else sample_metric(vlm, data, metric)
    bound.refuse_clash(VARIABLES, "gradients")
    chunks = []  # every chunk prepared and its positions resolved before any forward
    for start in range(0, len(data), batch_size):
        chunk = data[start : start + batch_size]
        if paired:
            pb = batch_pairs(vlm, chunk)
            frame = Frame.of(pb.clean, donor=pb.corrupt)
        else:
            pb = sample_batch(vlm, vlm.prepare_samples(chunk, answers=True))
            frame = Frame.of(pb.clean)
        chunks.append((pb, where.mask(vlm, frame).cpu()))
    if not any(bool(mask.any()) for _, mask in chunks):
        raise InputError(
            f"no token of the {len(data)} samples lies at {where!r}: nothing to differentiate; give positions "
            "that the samples have (a token group, or objects their scenes show)"
        )

    rows: dict[str, list] = {k: [] for k in ("value", "gradient", "token", "cell", "grid", "metric")}
    for pb, mask in chunks:
        # At the clean run, a metric that reads the clean run's logits reads this very run's.
        cache = record(vlm, pb.clean, sites, metric=lambda logits, pb=pb: bound(logits, bound.at_clean(pb, logits)))
        with torch.no_grad():
            rows["metric"].append(bound(cache.logits, bound.at_clean(pb, cache.logits)).double().numpy())
        for b in range(len(pb.clean)):
            chosen = torch.nonzero(mask[b]).flatten()
            rows["value"].append([cache[s][b, chosen] for s in sites])
            rows["gradient"].append([cache.grad[s][b, chosen] for s in sites])
            real = torch.nonzero(pb.clean.inputs["attention_mask"][b].cpu()).flatten()
            rows["token"].append((chosen - real.min()).numpy())
            cells = dict(zip(pb.clean.image_pos[b].tolist(), pb.clean.image_cell[b].tolist()))
            rows["cell"].append(np.array([cells.get(t, (-1, -1)) for t in chosen.tolist()], np.int32).reshape(-1, 2))
            rows["grid"].append(pb.clean.geometry[b].token_grid)
    return _dataset(vlm, data, sites, bound, where, rows, paired)


def _dataset(vlm: VLM, data, sites: list, bound: Metric, where, rows: dict, paired: bool) -> xr.Dataset:
    n = len(rows["token"])
    counts = [len(t) for t in rows["token"]]
    k = max(counts, default=0)
    widths = [int(rows["value"][0][i].shape[-1]) for i in range(len(sites))]
    shape = (len(sites), n, k, max(widths))
    value, grad = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    ixg = np.full(shape[:3], np.nan, np.float32)
    token, cell = np.full((n, k), -1, np.int32), np.full((n, k, 2), -1, np.int32)
    for j in range(n):
        c = counts[j]
        token[j, :c], cell[j, :c] = rows["token"][j], rows["cell"][j]
        for i, w in enumerate(widths):
            v, g = rows["value"][j][i], rows["gradient"][j][i]
            value[i, j, :c, :w], grad[i, j, :c, :w] = v.numpy(), g.numpy()
            ixg[i, j, :c] = (v.double() * g.double()).sum(-1).numpy()
    labels = [site.label for site in sites]
    extra = dict(
        method="gradients",
        metric=bound.provenance(),
        sites=json.dumps(labels),
        positions=repr(where),
        run="each pair's clean run" if paired else "each sample's run",
    )
    attrs = (
        pairs_provenance(vlm, data, **extra)
        if paired
        else provenance(vlm.name, vlm.arch.name, dataset={"samples": len(data)}, samples=data, **extra)
    )
    grids = np.array(rows["grid"], np.int32).reshape(n, 2)
    ds = xr.Dataset(
        {
            "value": (("site", "sample", "position", "width"), value),
            "gradient": (("site", "sample", "position", "width"), grad),
            "input_x_gradient": (("site", "sample", "position"), ixg),
            bound.name: ("sample", np.concatenate(rows["metric"]).astype(np.float32)),
        },
        coords={
            "site": labels,
            "site_width": ("site", np.array(widths, np.int32)),
            "sample": np.arange(n),
            "token": (("sample", "position"), token),
            "cell_row": (("sample", "position"), cell[..., 0]),
            "cell_col": (("sample", "position"), cell[..., 1]),
            "n_positions": ("sample", np.array(counts, np.int32)),
            "grid_rows": ("sample", grids[:, 0]),
            "grid_cols": ("sample", grids[:, 1]),
        },
        attrs=attrs,
    )
    for name, long_name in (("input_x_gradient", "input × gradient"), ("gradient", "gradient")):
        ds[name].attrs.update(long_name=f"{long_name} of {bound.name}", signed=1)  # overlays: a diverging scale
    return ds
