"""The one driver of long sweeps: chunks, this rank's share, a resumable store, and the wait.

A sweep (head patching, mean ablation) is a list of named chunks whose results are independent.
`run_chunks` computes each chunk this process owns (`countlens.distributed.Shard.mine`), writes it
to a `countlens.sweep_store.SweepStore` as soon as it is done, and reads the chunks an earlier run
already finished instead of recomputing them, so a killed sweep resumes where it stopped. Launched
as several processes, every rank waits until all chunks are in the store and returns all of them:
every rank then holds the whole sweep, as one process would.

`sweep_pairs` is the patching sweep on this driver, persistence wrapped around a computation: each
chunk is a pure function of its pairs (`patched_chunk`: it records the corrupt run,
`countlens.circuits.engine.edits.cache_run`, runs one edit per site of a grid on the clean batch,
`countlens.circuits.engine.edits.run_edits`, and keeps each site's per-pair logit difference); the runner names
the chunks, stores, shards and resumes them (`run_chunks`), and the chunks together give each site's
normalised ``effect`` and ``overwrite`` rate (`countlens.circuits.methods.patching`) with the pairs' provenance.
Head, layer and expert patching differ only in their edits; their pairs are checked once, at the public
function's door (`check_pair_sweep`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from countlens import distributed
from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.engine.metrics import Metric, logit_diff, normalised
from countlens.circuits.engine.pair_batch import PairBatch, batch_pairs, pairs_provenance
from countlens.distributed import Shard
from countlens.model.vlm import check_pairs
from countlens.progress import track
from countlens.sweep_store import SweepStore, samples_digest
from countlens.validate import require_count

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

Chunk = TypeVar("Chunk")


def open_store(store: str | SweepStore | None, spec: Callable[[], dict]) -> SweepStore | None:
    """``store`` as a `SweepStore` checked against ``spec()`` (called only for a directory path: a
    spec may digest every sample); an open store is used as it is, None stays None."""
    if store is None or isinstance(store, SweepStore):
        return store
    return SweepStore(store, spec())


def run_chunks(
    chunks: Mapping[str, Chunk],
    compute: Callable[[Chunk], xr.Dataset | xr.DataArray],
    store: SweepStore | None,
    shard: Shard,
    description: str | None = None,
) -> list:
    """Every chunk's result, in the order of ``chunks`` ({stored key: what ``compute`` takes}): read
    from ``store`` where finished, else ``compute(chunk)`` (then written to ``store``). Sharded, this
    rank computes its share, then waits for the other ranks' chunks and reads them all.
    ``description``: a progress line per chunk."""
    keys = list(chunks)
    mine = set(shard.mine(keys))
    todo = [key for key in keys if key in mine]
    if description is not None:
        suffix = f" (rank {shard.rank} of {shard.world})" if shard.sharded else ""
        todo = track(todo, description=description + suffix)
    parts = []
    for key in todo:
        if store is not None and key in store.done():
            parts.append(store.read(key))
            continue
        part = compute(chunks[key])
        if store is not None:
            store.write(key, part)
        parts.append(part)
    if shard.sharded:
        distributed.wait_for(store, keys, shard)
        parts = [store.read(key) for key in keys]
    return parts


def check_pair_sweep(pairs: Sequence, batch_size: int = 1, what: str = "patching") -> None:
    """Refuse what a sweep of ``what`` cannot read as pairs, or a batch size that is no count."""
    check_pairs(pairs, what)
    require_count(batch_size, "batch_size")


def sweep_pairs(
    vlm: VLM,
    pairs: Sequence,
    make_edits: Callable[[PairBatch], Sequence[Edit | None]],
    coords: dict,
    batch_size: int,
    store,
    progress: bool,
    shard: Shard | None = None,
    experts: bool = False,
    metric: Metric | None = None,
) -> xr.Dataset:
    """Run ``make_edits(pair_batch)`` (one edit per site of the ``coords`` grid, in order; None for a
    slot that is no site: NaN there) over chunks of pairs; per-pair values of ``metric`` (a bound `Metric`;
    None: the logit difference) on the grid (site…, pair).
    ``experts``: the corrupt cache records the MoE layers' experts inputs (expert edits copy from them).
    Sharded (`countlens.distributed`): this rank's chunks, then every rank's, read from the store.

    The runner around the computation: ``pairs`` and ``batch_size`` were checked at the public function's
    door (`check_pair_sweep`); here the chunks are named, run or read back (`run_chunks`: store, shards,
    resume), summarised and given their provenance. Each chunk is `patched_chunk`'s pure function."""
    shard = distributed.resolve(shard, store, "this patching sweep")
    metric = logit_diff() if metric is None else metric
    chunks = {
        f"pairs_{start:06d}_{min(start + batch_size, len(pairs)):06d}": (start, pairs[start : start + batch_size])
        for start in range(0, len(pairs), batch_size)
    }
    compute = patched_chunk(vlm, make_edits, coords, experts, metric)
    parts = run_chunks(chunks, compute, store, shard, f"patching {len(pairs)} pairs" if progress else None)
    ds = xr.concat(parts, dim="pair", data_vars="minimal")
    dims = tuple(coords)
    name = metric.name
    ld, clean_ld, corrupt_ld = (torch.from_numpy(ds[v].values) for v in (name, f"clean_{name}", f"corrupt_{name}"))
    effect, overwrite, noted = _summarise(ld, torch.from_numpy(ds["to_corrupt"].values), clean_ld, corrupt_ld, metric)
    overwrite = overwrite.masked_fill(effect.isnan(), float("nan"))  # no site: no overwrite either
    ds["effect"] = (dims, effect.numpy())
    ds["overwrite"] = (dims, overwrite.numpy())
    ds.attrs.update(pairs_provenance(vlm, pairs, **noted))
    return ds


def patched_chunk(
    vlm: VLM,
    make_edits: Callable[[PairBatch], Sequence[Edit | None]],
    coords: dict,
    experts: bool,
    metric: Metric | None = None,
) -> Callable[[tuple[int, Sequence]], xr.Dataset]:
    """One chunk of a patching sweep as a pure function: (first pair's index, the chunk's pairs) → its
    per-pair ``metric`` values (a bound `Metric`; None: the logit difference) on the ``coords`` grid
    (corrupt run recorded, one edit per site on the clean batch)."""
    metric = logit_diff() if metric is None else metric
    shape = tuple(len(v) for v in coords.values())
    dims = tuple(coords)

    def chunk_result(chunk: tuple[int, Sequence]) -> xr.Dataset:
        start, chunk = chunk
        pb = batch_pairs(vlm, chunk)
        edits = make_edits(pb)  # before any forward: positions that a sample lacks are refused here
        cache = cache_run(vlm, pb.corrupt, range(-1, vlm.arch.n_layers), experts=experts)
        clean = cache_run(vlm, pb.clean, [], resid=False, z=False)["logits"]
        pb = metric.at_clean(pb, clean)

        # Per replica only (the metric, arg-max is the corrupt answer): the full logits of an L×H sweep would
        # be L·H·pairs·vocab floats (28·28·16·152k ≈ 7.6 GB at 7B).
        def read(rows: Tensor) -> Tensor:
            to_corrupt = (rows.argmax(-1) == pb.corrupt_id.to(rows.device)).float()
            return torch.stack([metric(rows, pb).float(), to_corrupt])

        live = [i for i, e in enumerate(edits) if e is not None]  # None: a slot with no site (NaN)
        ran = run_edits(vlm, pb.clean, cache, [edits[i] for i in live], reduce=read)
        out = torch.full((len(edits), *ran.shape[1:]), float("nan"))
        out[live] = ran
        ld, pred = out[:, 0].contiguous(), out[:, 1] == 1
        pair = np.arange(start, start + len(chunk))
        name = metric.name
        return xr.Dataset(
            {
                name: (dims + ("pair",), ld.view(*shape, len(chunk)).numpy()),
                "to_corrupt": (dims + ("pair",), pred.view(*shape, len(chunk)).numpy()),
                f"clean_{name}": ("pair", metric(clean.cpu(), _on_cpu(pb)).numpy()),
                f"corrupt_{name}": ("pair", metric(cache["logits"].cpu(), _on_cpu(pb)).numpy()),
                "clean_correct": ("pair", (clean.argmax(-1).cpu() == pb.clean_id).numpy()),
            },
            coords={**coords, "pair": pair},
        )

    return chunk_result


def pairs_store(store, spec: dict, pairs: Sequence) -> SweepStore | None:
    """`open_store` for a sweep over ``pairs``: ``spec`` and a digest of every pair's two samples."""
    return open_store(
        store, lambda: {**spec, "pairs_digest": samples_digest(side for p in pairs for side in (p.clean, p.corrupt))}
    )


def _on_cpu(pb: PairBatch) -> PairBatch:
    """``pb`` with the clean logits (if any) on the CPU, where a chunk's summary values are read."""
    return pb if pb.clean_logits is None else replace(pb, clean_logits=pb.clean_logits.cpu())


def _summarise(patched: Tensor, pred_corrupt: Tensor, clean: Tensor, corrupt: Tensor, metric: Metric) -> tuple:
    """Per site (effect, overwrite rate) from per-pair (site…, pair) metric values and corrupt predictions,
    and the normaliser's attrs (`countlens.circuits.engine.pair_batch.normalised`)."""
    denom, noted = normalised(float(clean.sum()), float(corrupt.sum()), (corrupt - clean).numpy(), metric)
    effect = (patched.sum(-1) - clean.sum()) / denom
    return effect, pred_corrupt.float().mean(-1), noted
