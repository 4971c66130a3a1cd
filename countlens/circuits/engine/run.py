"""Your own experiment: interventions under any measurement, and their effect over count pairs.

Two entry points take the same interventions (`countlens.circuits.engine.interventions`):

- ``effect(vlm, pairs, interventions)`` → xr.Dataset: the interventions applied to each pair's clean
  run (a `Patch` copies the pair's corrupt run), and the normalised logit-difference change
  ``effect`` = (Σ LD_edited − Σ LD_clean) / (Σ LD_corrupt − Σ LD_clean) with the ``overwrite`` rate
  (`countlens.circuits.methods.patching` defines both), per pair too. A mapping {label: interventions} is a
  grid over the ``intervention`` dim; `patch_layers`, `patch_heads` and `patch_experts` are such grids
  (`effect_grid`), so every patching number comes from this one normalisation.
- ``with intervene(vlm, interventions): ...`` — every forward inside runs edited: teacher-forced
  scoring (`countlens.analysis.score`), generation (`countlens.analysis.generate`, ``vlm.hf.generate``),
  ``vlm.trace`` and raw nnsight, HeadLens decoding, a fine-tune's evaluation. Positions are resolved
  per forward (`countlens.circuits.sites.positions`), so any batch size works, and so do the new tokens of
  generation; a `Patch`'s values and a `Mask` know the samples of their rows, so each forward's row
  takes its own sample's row, in any batching and order. It runs on plain torch hooks on the HF
  modules, so it holds for a model with a LoRA adapter too; local models only. Two interventions run
  here alone: `Replace` (a site rewritten from other sites of the same forward, recorded there by a
  hook) and `Block` (attention knockout: a hook before the layer's attention adds −inf to its mask).

Helpers: `record` reads any set of sites in one forward; `mean_activation` and `mean_difference`
(a steering vector: the mean of a site over one set of samples minus its mean over another).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import product
from typing import TYPE_CHECKING

import torch
import xarray as xr
from torch import Tensor

from countlens.circuits.engine.donors import donor_rows
from countlens.circuits.engine.edits import Edit
from countlens.circuits.engine.hooks import Hook, hooked
from countlens.circuits.engine.interventions import Block, Intervention, Patch, Replace, as_interventions
from countlens.circuits.engine.metrics import RESERVED, Metric, logit_diff, metric_for
from countlens.circuits.engine.pair_batch import PairBatch
from countlens.circuits.engine.record import location, mean_activation, record, require_local, rows_seq
from countlens.circuits.engine.sweep import check_pair_sweep, pairs_store, sweep_pairs
from countlens.circuits.sites import Expert, HeadZ, ImageStates, Location, Residual, first_arg
from countlens.circuits.sites.positions import Frame
from countlens.errors import InputError
from countlens.model.arguments import require_vlm

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.circuits.sites import Site
    from countlens.model.vlm import VLM

#: Sites `effect` patches from the corrupt run's cache (`countlens.circuits.engine.edits.cache_run`); the
#: others are recorded from the corrupt run when a Patch asks for them.
CACHED = (Residual, HeadZ, Expert, ImageStates)


def mean_difference(
    vlm: VLM, a: Sequence, b: Sequence, site: Site, positions="all", batch_size: int = 16
) -> Float[Tensor, " d"]:
    """A steering vector: ``site``'s mean over ``a``'s tokens at ``positions`` minus its mean over ``b``'s."""
    require_vlm(vlm, "mean_difference")
    return mean_activation(vlm, a, site, positions, batch_size) - mean_activation(vlm, b, site, positions, batch_size)


# ----------------------------------------------------------------------------- under any measurement


@contextmanager
def intervene(vlm: VLM, interventions) -> Iterator[None]:
    """``with intervene(vlm, [Add(Residual(2), v, alpha=4.0), ...]):`` — every forward of ``vlm`` inside
    runs with the interventions; on exit the model is as it was. A `Patch` takes ``values`` here
    (`record` of a donor batch): each forward's row reads its own sample's row of them, at any batch
    size and order (`countlens.circuits.sites.positions.row_index`); a forward of other samples is refused."""
    require_vlm(vlm, "intervene")
    require_local(vlm, "intervene")
    items = as_interventions(vlm, interventions)
    for item in items:
        for site in () if isinstance(item, Block) else (item.site, *getattr(item, "reads", ())):
            location(vlm, site)
        if isinstance(item, Patch) and item.values is None:
            raise InputError(
                f"under intervene, {item!r} needs values=: record(vlm, donor_batch, [site])[site] — or run "
                "effect(vlm, pairs, ...), where a Patch copies each pair's corrupt run"
            )
    items = [item.resolved(vlm) for item in items]  # forwards of reference or donor samples, unedited
    blocks = [item for item in items if isinstance(item, Block)]
    state: dict = {"keys": {}}

    def frame_of(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise InputError("intervene needs input_ids in every forward (positions are read off the tokens)")
        attn = kwargs.get("attention_mask")
        attn = torch.ones_like(ids) if attn is None else attn
        new = attn.shape[1] > ids.shape[1]  # a step after a KV cache: the columns are new tokens
        batch = None if new else vlm.prepared(ids, kwargs.get("pixel_values"))
        frame = Frame(ids, attn, batch, new)
        masks = {id(i.positions): i.positions.mask(vlm, frame) for i in items}  # refusals before any layer runs
        rows = {} if new else {id(i): donor_rows(vlm, i, frame, masks[id(i.positions)]) for i in items if i.donor}
        state.update(frame=frame, masks=masks, rows=rows, read={})
        for item in blocks:
            state["keys"][id(item)] = _block_keys(vlm, item, frame, state["keys"].get(id(item)))
            _keys_left(item, frame, masks[id(item.positions)], state["keys"][id(item)])

    def action(item: Intervention, loc: Location):
        op = None if isinstance(item, Replace) else item.op()

        def act(t: Tensor) -> Tensor | None:
            frame = state["frame"]
            if item.donor and frame.new:
                return None  # no donor has the tokens generated after the prompt
            mask = state["masks"][id(item.positions)]
            out = t.clone()
            view = loc.view(rows_seq(out, frame))
            if tuple(view.shape[:2]) != tuple(mask.shape):
                raise InputError(f"{item.site} is shaped {tuple(view.shape)} here, the tokens {tuple(mask.shape)}")
            b, s = mask.to(view.device).nonzero(as_tuple=True)
            if isinstance(item, Replace):
                values = [view[b, s] if r == item.site else _read(state, r, b, s, view.device) for r in item.reads]
                view[b, s] = item.written(values, view.shape[-1]).to(view.dtype)
            elif op is not None:
                view[b, s] = op(view[b, s]).to(view.dtype)
            else:
                view[b, s] = state["rows"][id(item)].take(item.values, b, s).to(view.device, view.dtype)
            return out

        return act

    def keeper(site: Site, loc: Location):
        def keep(t: Tensor) -> None:
            state["read"][site] = loc.view(rows_seq(t, state["frame"])).clone()

        return keep

    hooks = [Hook("", "before", frame_of)]
    hooks += [Hook(vlm.arch.attention(i.layer), "before", _knockout(vlm, i, state)) for i in blocks]
    edits = [i for i in items if not isinstance(i, Block)]
    hooks += [Hook((loc := location(vlm, item.site)).path, loc.io, action(item, loc)) for item in edits]
    # The reads are recorded after every edit at their module: a Replace reads what the forward has there.
    reads = dict.fromkeys(r for i in edits if isinstance(i, Replace) for r in i.reads if r != i.site)
    hooks += [Hook((loc := location(vlm, site)).path, loc.io, keeper(site, loc)) for site in reads]
    with hooked(vlm.hf, hooks):
        yield


def _read(state: dict, site: Site, b: Tensor, s: Tensor, device: torch.device) -> Tensor:
    """What ``site`` held at rows ``b``, positions ``s`` earlier in this forward (a `Replace`'s read)."""
    got = state["read"].get(site)
    if got is None:
        raise InputError(f"{site} did not run before the site that reads it in this forward; read an earlier site")
    return got[b.to(got.device), s.to(got.device)].to(device)


def _block_keys(vlm: VLM, item: Block, frame: Frame, before: Tensor | None) -> Tensor:
    """A `Block`'s key positions over every key column of this forward: the prompt's, and after a KV
    cache those of the earlier forwards (``before``) followed by the new tokens'."""
    now = item.keys.mask(vlm, frame)
    if not frame.new:
        return now
    width = frame.attention_mask.shape[1]
    if before is None or before.shape[0] != now.shape[0] or before.shape[1] + now.shape[1] != width:
        raise InputError(
            f"{item!r}: a forward after a KV cache attends to keys of earlier forwards this intervene has not "
            "seen; run the prompt's forward inside the same intervene (generate does)"
        )
    return torch.cat([before, now.to(before.device)], 1)


def _keys_left(item: Block, frame: Frame, queries: Tensor, keys: Tensor) -> None:
    """Refuse, before any layer runs, a `Block` that leaves a real query no key (causal attention:
    the real keys up to its own position)."""
    real = frame.attention_mask.bool().to(queries.device)
    n = queries.shape[1]
    seen = real.cumsum(1)[:, -n:]  # the real keys each query sees
    cut = (real & keys.to(real.device)).cumsum(1)[:, -n:]  # those Block takes away from a chosen query
    bad = (queries.bool() & real[:, -n:] & (seen == cut)).nonzero()
    if len(bad):
        b, q = bad[0].tolist()
        raise InputError(
            f"{item!r} leaves the query at position {q} of row {b} no key to attend to (all {int(seen[b, q])} it "
            "sees are blocked); leave at least one out of keys (e.g. its own position)"
        )


def _knockout(vlm: VLM, item: Block, state: dict):
    """The hook before ``item``'s attention: its mask with −inf (False) from the chosen queries to the
    chosen keys, at one head or all; the mask as it was where nothing is blocked."""
    heads = vlm.arch.heads(item.layer)

    def before(module, args, kwargs):
        queries, keys = state["masks"][id(item.positions)], state["keys"][id(item)]
        if not (queries.any() and keys.any()):
            return None
        hidden = first_arg(args, kwargs)
        positional = "attention_mask" not in kwargs and len(args) > 1
        mask = args[1] if positional else kwargs.get("attention_mask")
        rows, n, kv = queries.shape[0], queries.shape[1], keys.shape[1]
        if mask is not None and (not isinstance(mask, Tensor) or mask.ndim != 4 or mask.shape[-2] != n):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise InputError(f"{item!r} edits a (batch, heads, query, key) attention mask; this layer got {got}")
        width = kv if mask is None else mask.shape[-1]
        if width < kv:
            raise InputError(f"{item!r}: this layer's attention sees {width} keys, the forward has {kv} positions")
        device = hidden.device if mask is None else mask.device
        cut = torch.zeros(rows, 1 if item.head is None else heads, n, width, dtype=torch.bool, device=device)
        pairs = queries.to(device)[:, :, None] & keys.to(device)[:, None, :]
        cut[:, 0 if item.head is None else item.head, :, :kv] = pairs
        if mask is None:  # sdpa's causal default, written out: query i sees the keys up to its position
            allowed = torch.arange(width, device=device) <= torch.arange(n, device=device)[:, None] + width - n
            mask = torch.zeros(n, width, dtype=hidden.dtype, device=device).masked_fill(~allowed, float("-inf"))
        new = mask & ~cut if mask.dtype == torch.bool else torch.where(cut, float("-inf"), mask)
        if positional:
            return (args[0], new, *args[2:]), kwargs
        return args, {**kwargs, "attention_mask": new}

    return before


# ----------------------------------------------------------------------------- effect over pairs


def lower(vlm: VLM, item: Intervention, frame: Frame, donors: dict, masks: dict) -> Edit:
    """``item`` as an `Edit` of the edited (clean) batch of ``frame``: its mask, and a donor's values
    (None: the cached corrupt run's) or its op. ``masks`` caches each positions' mask per batch."""
    batch = frame.batch
    if isinstance(item.site, ImageStates):
        mask = torch.ones(len(batch), len(batch.state_cells[0]), dtype=torch.bool)
    else:
        if item.positions not in masks:
            masks[item.positions] = item.positions.mask(vlm, frame).cpu()
        mask = masks[item.positions]
    if _from_corrupt(item):
        return Edit(item.site, mask, donors.get(item.site))
    if item.donor:  # a Resample's donors, or a Patch's own values
        return Edit(item.site, mask, donor_rows(vlm, item, frame, mask).full(item.values, mask))
    return Edit(item.site, mask, op=item.op())


def _from_corrupt(item: Intervention) -> bool:
    """A Patch without values of its own: in `effect`, it copies each pair's corrupt run."""
    return isinstance(item, Patch) and item.values is None


def effect_grid(
    vlm: VLM,
    pairs: Sequence,
    sets: Sequence[Sequence[Intervention] | None],
    coords: dict,
    batch_size: int = 16,
    store=None,
    progress: bool = False,
    shard=None,
    metric: Metric | None = None,
) -> xr.Dataset:
    """The effect of each set of interventions (None: no site, NaN), laid out on the ``coords`` grid in
    order, under ``metric`` (bound; None: the logit difference); the engine of `effect` and of the patching
    sweeps (`countlens.circuits.engine.sweep.sweep_pairs`)."""
    metric = logit_diff() if metric is None else metric
    taken = sorted(set(coords) & {*RESERVED, *metric.variables})
    if taken:
        raise InputError(
            f"the grid's dims {taken} are names of the result's own variables ({', '.join(RESERVED)} and the "
            f"metric's {', '.join(metric.variables)}); name the dims otherwise"
        )
    live = [items for items in sets if items is not None]
    experts = any(isinstance(i.site, Expert) for items in live for i in items)
    recorded = [i.site for items in live for i in items if _from_corrupt(i) and not isinstance(i.site, CACHED)]
    recorded = list(dict.fromkeys(recorded))

    def make_edits(pb: PairBatch) -> list:
        frame, masks = Frame.of(pb.clean, donor=pb.corrupt), {}
        for item in (i for items in live for i in items if not isinstance(i.site, ImageStates)):
            if item.positions not in masks:  # every positions resolved before any forward: refusals come first
                masks[item.positions] = item.positions.mask(vlm, frame).cpu()
        donors = record(vlm, pb.corrupt, recorded) if recorded else {}
        return [None if items is None else [lower(vlm, i, frame, donors, masks) for i in items] for items in sets]

    return sweep_pairs(
        vlm, pairs, make_edits, coords, batch_size, store, progress, shard, experts=experts, metric=metric
    )


def effect_sweep(
    vlm: VLM,
    pairs: Sequence,
    sets,
    coords: dict,
    sweep: str,
    spec: dict,
    batch_size: int,
    store,
    progress,
    shard,
    metric: Metric | None = None,
) -> xr.Dataset:
    """`effect_grid` of a named sweep that may be stored: the store's spec is the sweep's name, the model,
    ``spec`` (whatever else fixes its results), the metric and the pairs' count and batch size, with a
    digest of the pairs."""
    metric = logit_diff() if metric is None else metric
    full = {"sweep": sweep, "model": vlm.name, **spec, "metric": metric.provenance()}
    full.update(pairs=len(pairs), batch_size=batch_size)
    store = pairs_store(store, full, pairs)
    return effect_grid(vlm, pairs, sets, coords, batch_size, store, progress, shard, metric)


def effect(
    vlm: VLM, pairs: Sequence, interventions, batch_size: int = 16, progress: bool = False, metric=None
) -> xr.Dataset:
    """The interventions' effect on each pair's clean run under ``metric`` (`countlens.circuits.metrics`;
    default the logit difference): ``effect`` and ``overwrite``, per pair the metric (named after it, e.g.
    ``logit_diff``) and ``to_corrupt`` beside the clean and corrupt runs'; a `Patch` copies the corrupt run.

    ``interventions``: one, a list (applied together), or a grid of sets:

    - {label: list}: a grid over one ``intervention`` dim;
    - {dim: {coord: list}} or {(dim, dim, ...): {(coord, coord, ...): list}}: a grid over those named
      dims, e.g. ``{("layer", "alpha"): {(l, a): [Add(Residual(l), v, alpha=a)] ...}}``; a cell left out
      is NaN;
    - an ``xr.DataArray`` of sets (object dtype): its dims and coords."""
    require_vlm(vlm, "effect")
    check_pair_sweep(pairs, batch_size, "effect")
    coords, cells = _grid(interventions)
    sets = [None if cell is _MISSING else as_interventions(vlm, cell) for cell in cells]
    for items in (s for s in sets if s is not None):
        for item in items:
            if isinstance(item, (Replace, Block)):
                raise InputError(
                    f"{item!r} runs under intervene only (effect's stacked forward writes each site from its own "
                    "value or a donor's): with intervene(vlm, [...]): compare vlm.forward(batch) or score(vlm, ...)"
                )
            item.check_samples(pairs)
    metric = metric_for(vlm, pairs, metric, "effect")
    resolved = [None if items is None else [item.resolved(vlm) for item in items] for items in sets]
    grid = coords or {"intervention": [""]}
    ds = effect_grid(vlm, pairs, resolved, grid, batch_size, progress=progress, metric=metric)
    shown = {" ".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in _labelled(coords, sets)}
    ds.attrs.update(method="effect", interventions=json.dumps(shown))
    return ds if coords else ds.isel(intervention=0, drop=True)


def _labelled(coords: dict, sets: list) -> list:
    """(cell label, [repr of each intervention]) of every set of a grid, in order; a scalar's label is ""."""
    cells = list(product(*coords.values())) if coords else [("",)]
    return [(c[0] if len(c) == 1 else c, [repr(i) for i in s]) for c, s in zip(cells, sets) if s is not None]


_MISSING = object()  # a named grid's cell that the mapping leaves out (NaN)


def _grid(interventions) -> tuple[dict, list]:
    """(coords, cells in C order) of ``interventions``: {} and one cell for a set; a grid's dims otherwise
    (a cell that a named grid leaves out is `_MISSING`: NaN)."""
    if isinstance(interventions, xr.DataArray):
        if interventions.dtype != object or interventions.size == 0:
            raise InputError(
                "an xr.DataArray of interventions holds sets of them (dtype object), one per cell, and at least one"
            )
        coords = {d: [v.item() for v in interventions[d].values] for d in interventions.dims}
        return coords, list(interventions.values.ravel())
    if not isinstance(interventions, Mapping):
        return {}, [interventions]
    grid = dict(interventions)
    if not grid:
        raise InputError("give at least one set of interventions in the mapping")
    named = len(grid) == 1 and isinstance(next(iter(grid.values())), Mapping)
    if not named:  # {label: set}: one `intervention` dim
        labels: dict = {}
        for key in grid:
            if str(key) in labels:
                raise InputError(
                    f"the labels {labels[str(key)]!r} and {key!r} of the mapping are both {str(key)!r} on the "
                    "intervention dim, so one set would hide the other; give each set a distinct label"
                )
            labels[str(key)] = key
        return {"intervention": list(labels)}, list(grid.values())
    ((dims, cells),) = grid.items()
    dims = tuple(dims) if isinstance(dims, tuple) else (dims,)
    if not dims or not all(isinstance(d, str) and d.isidentifier() for d in dims) or len(set(dims)) < len(dims):
        raise InputError(f"a named grid's dims {dims!r} must be distinct names, e.g. ('layer', 'alpha')")
    keyed = {}
    for key, cell in cells.items():
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(dims):
            raise InputError(f"the grid cell {key!r} has {len(key)} coords for the dims {dims}; give one per dim")
        keyed[key] = cell
    if not keyed:
        raise InputError(f"the grid over {dims} has no cells; give at least one set of interventions")
    coords = {d: list(dict.fromkeys(k[i] for k in keyed)) for i, d in enumerate(dims)}
    return coords, [keyed.get(c, _MISSING) for c in product(*coords.values())]
