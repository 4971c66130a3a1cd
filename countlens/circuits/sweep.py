"""The one driver of long sweeps: chunks, this rank's share, a resumable store, and the wait.

A sweep (head patching, mean ablation) is a list of named chunks whose results are independent.
`run_chunks` computes each chunk this process owns (`countlens.distributed.Shard.mine`), writes it
to a `countlens.results.SweepStore` as soon as it is done, and reads the chunks an earlier run
already finished instead of recomputing them, so a killed sweep resumes where it stopped. Launched
as several processes, every rank waits until all chunks are in the store and returns all of them:
every rank then holds the whole sweep, as one process would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import xarray as xr

from countlens import distributed
from countlens.distributed import Shard
from countlens.results import SweepStore

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
        from countlens.progress import track

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
