"""Sharded sweeps: which share of a sweep's chunks this process computes, and how ranks meet.

A sweep (`patch_layers`, `patch_heads`, `ablation_scan`, `countlens discover`) is a list of
independent chunks, each a fixed slice of the pairs or samples. Launched as several processes —
``torchrun --nproc_per_node N``, ``accelerate launch --num_processes N``, or anything else that sets
``RANK`` and ``WORLD_SIZE`` (or an initialised ``torch.distributed`` process group) — rank r
computes chunks r, r + N, r + 2N, … and writes each to the sweep's `countlens.sweep_store.SweepStore`,
a directory every rank can see. Then every rank waits until all the sweep's chunks are on disk and
assembles them in chunk order. No tensors cross between processes and no process group is needed:
the store is the meeting place, so a killed rank costs only its unfinished chunks, and relaunching
resumes. Each chunk is computed by the same code on the same inputs as in one process, so the
assembled result is the one a single process gives, bit for bit on CPU at equal thread counts
(``torchrun`` sets ``OMP_NUM_THREADS=1``; a single process given one thread gives the same bits).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from countlens.errors import ConfigError, CountlensError

#: How long a rank waits for the others' chunks before it gives up (seconds; env override).
WAIT_ENV = "COUNTLENS_SHARD_TIMEOUT"
DEFAULT_WAIT_S = 24 * 3600.0


class ShardError(CountlensError):
    """A sharded sweep whose ranks disagree or whose other ranks never finished."""


@dataclass(frozen=True)
class Shard:
    """This process's place among the sweep's processes: ``rank`` of ``world``."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not (
            isinstance(self.world, int)
            and self.world >= 1
            and isinstance(self.rank, int)
            and 0 <= self.rank < self.world
        ):
            raise ConfigError(
                f"a shard is rank r of world W with 0 ≤ r < W, got rank={self.rank!r} world={self.world!r}"
            )

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def mine(self, keys: Sequence[str]) -> list[str]:
        """This rank's keys: every ``world``-th, starting at ``rank``."""
        return list(keys[self.rank :: self.world])


def current() -> Shard:
    """The shard of this process: the ``torch.distributed`` group if one is initialised, else the
    launcher's ``RANK`` / ``WORLD_SIZE`` environment, else a single process."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return Shard(dist.get_rank(), dist.get_world_size())
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if world is None:
        return Shard()
    try:
        world_n = int(world)
        if world_n > 1 and rank is None:
            # Else every process would take rank 0's share and wait for the rest forever.
            raise ConfigError(
                f"WORLD_SIZE={world} but RANK is unset: launch with torchrun / accelerate launch "
                "(which set both), set RANK per process, or unset WORLD_SIZE"
            )
        return Shard(int(rank or 0), world_n)
    except ValueError:
        raise ConfigError(
            f"RANK={rank!r} WORLD_SIZE={world!r} are not integers; unset them or launch "
            "with torchrun / accelerate launch"
        ) from None


def check_process_group() -> Shard:
    """The current shard, refused when it is one of several processes whose launcher did not set up
    the rendezvous a process group needs (``MASTER_ADDR``, ``MASTER_PORT``): what data-parallel
    fine-tuning joins, unlike the sweeps, which meet on disk. Checked before anything runs, so a
    mis-launched job fails at once instead of after its baseline evaluation."""
    shard = current()
    dist = sys.modules.get("torch.distributed")
    if not shard.sharded or (dist is not None and dist.is_available() and dist.is_initialized()):
        return shard
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={shard.world} RANK={shard.rank} are set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: a data-parallel fine-tune is launched with "
            "`accelerate launch --num_processes N` or `torchrun --nproc_per_node N` (which set all four); "
            "to run one process, unset WORLD_SIZE and RANK"
        )
    return shard


def resolve(shard: Shard | None, store, what: str) -> Shard:
    """``shard`` or the current one; a sharded sweep must have a store to meet in."""
    shard = current() if shard is None else shard
    if shard.sharded and store is None:
        raise ConfigError(
            f"{what} runs as rank {shard.rank} of {shard.world} but has no store=; ranks share "
            "their chunks through a SweepStore directory every rank can see: pass store=DIR"
        )
    return shard


def wait_for(store, keys: Sequence[str], shard: Shard, timeout: float | None = None, poll: float = 0.2) -> None:
    """Block until every key is a finished chunk in ``store`` (the other ranks' too)."""
    if timeout is None:
        timeout = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    deadline = time.monotonic() + timeout
    while True:
        done = store.done()  # one directory listing per poll
        missing = [k for k in keys if k not in done]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise ShardError(
                f"rank {shard.rank} of {shard.world} waited {timeout:g} s for {len(missing)} chunks of "
                f"{store.path} ({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}) that other ranks "
                f"never wrote; relaunch the same command to resume (finished chunks are kept), or raise "
                f"{WAIT_ENV}"
            )
        time.sleep(poll)
