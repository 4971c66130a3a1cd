"""Shards: who computes which chunks, from the launcher's environment; bad shards named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from countlens import distributed
from countlens.distributed import Shard, ShardError
from countlens.errors import InputError
from countlens.results import SweepStore, _writer_alive, _writer_id


def test_keys_are_dealt_round_robin():
    keys = [f"k{i}" for i in range(7)]
    deals = [Shard(r, 3).mine(keys) for r in range(3)]
    assert deals == [["k0", "k3", "k6"], ["k1", "k4"], ["k2", "k5"]]
    assert sorted(sum(deals, [])) == sorted(keys)
    assert Shard().mine(keys) == keys and not Shard().sharded


def test_the_shard_comes_from_the_launcher(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.current() == Shard(0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed.current() == Shard(1, 4)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(InputError, match="not integers"):
        distributed.current()
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(InputError, match="0 ≤ r < W"):
        distributed.current()


def test_a_sharded_sweep_needs_a_store_and_gives_up_naming_what_is_missing(tmp_path):
    with pytest.raises(InputError, match="store="):
        distributed.resolve(Shard(0, 2), None, "patch_heads")
    assert distributed.resolve(Shard(0, 2), tmp_path, "x") == Shard(0, 2)
    store = SweepStore(tmp_path / "s", {"sweep": "t"})
    with pytest.raises(ShardError, match=r"2 chunks of .*\(a, b\)"):
        distributed.wait_for(store, ["a", "b"], Shard(0, 2), timeout=0.05, poll=0.01)


def test_opening_a_store_spares_live_writers_temps(tmp_path):
    store = SweepStore(tmp_path, {"sweep": "t"})
    live = store.chunks / f".a.nc.{_writer_id()}-0123abcd.tmp"
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    host = _writer_id().split("~")[0]
    dead = store.chunks / f".b.nc.{host}~{dead_pid}-0123abcd.tmp"
    other_host = store.chunks / f".c.nc.elsewhere~{os.getpid()}-0123abcd.tmp"
    old_style = store.chunks / ".d.nc.0123abcd.tmp"
    for p in (live, dead, other_host, old_style):
        p.write_text("partial")
    SweepStore(tmp_path, {"sweep": "t"})
    assert live.exists() and other_host.exists() and not dead.exists() and not old_style.exists()
    assert _writer_alive(live.name) and not _writer_alive(old_style.name)
