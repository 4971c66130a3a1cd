"""Shards: who computes which chunks, from the launcher's environment; bad shards named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from countlens import distributed
from countlens.distributed import Shard, ShardError
from countlens.errors import ConfigError
from countlens.files import writer_id
from countlens.results import ResultError
from countlens.sweep_store import SweepStore, writer_alive


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
    with pytest.raises(ConfigError, match="not integers"):
        distributed.current()
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ConfigError, match="0 ≤ r < W"):
        distributed.current()


def test_a_sharded_sweep_needs_a_store_and_gives_up_naming_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="store="):
        distributed.resolve(Shard(0, 2), None, "patch_heads")
    assert distributed.resolve(Shard(0, 2), tmp_path, "x") == Shard(0, 2)
    store = SweepStore(tmp_path / "s", {"sweep": "t"})
    with pytest.raises(ShardError, match=r"2 chunks of .*\(a, b\)"):
        distributed.wait_for(store, ["a", "b"], Shard(0, 2), timeout=0.05, poll=0.01)


def test_opening_a_store_spares_live_writers_temps(tmp_path):
    store = SweepStore(tmp_path, {"sweep": "t"})
    live = store.chunks / f".a.nc.{writer_id()}-0123abcd.tmp"
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    host = writer_id().split("~")[0]
    dead = store.chunks / f".b.nc.{host}~{dead_pid}-0123abcd.tmp"
    other_host = store.chunks / f".c.nc.elsewhere~{os.getpid()}-0123abcd.tmp"
    for p in (live, dead, other_host):
        p.write_text("partial")
    SweepStore(tmp_path, {"sweep": "t"})
    assert live.exists() and other_host.exists() and not dead.exists()
    assert writer_alive(live.name) and not writer_alive(dead.name)


def test_a_temp_that_does_not_name_its_writer_is_refused_naming_it(tmp_path):
    """A temp named without <host>~<pid> (as an older countlens named them): opening the store
    names the file and the fix instead of guessing whether its writer is alive."""
    store = SweepStore(tmp_path, {"sweep": "t"})
    unnamed = store.chunks / ".d.nc.0123abcd.tmp"
    unnamed.write_text("partial")
    with pytest.raises(
        ResultError, match=r"chunks/\.d\.nc\.0123abcd\.tmp .*lacks its writer's <host>~<pid>.*delete it"
    ):
        SweepStore(tmp_path, {"sweep": "t"})
    assert unnamed.exists()  # refused, not removed
    unnamed.unlink()
    SweepStore(tmp_path, {"sweep": "t"})  # the fix the message names works


def test_the_accelerate_configs_in_the_repo_load():
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    root = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
    ddp, fsdp = (load_config_from_file(str(root / f"{name}.yaml")) for name in ("ddp", "fsdp"))
    assert ddp.distributed_type == "MULTI_GPU" and fsdp.distributed_type == "FSDP"
    wrapped = fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
    assert hasattr(modeling_qwen2_5_vl, wrapped)  # the layer class FSDP wraps exists under that name
    assert fsdp.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # rank 0 writes the whole adapter


def test_cuda_means_this_ranks_gpu_under_a_launcher(monkeypatch):
    from countlens.model.loading import rank_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert rank_device("cuda") == "cuda:3"
    assert [rank_device(d) for d in ("cpu", "cuda:1", None, "auto")] == ["cpu", "cuda:1", None, "auto"]
    assert rank_device({"": 0}) == {"": 0}
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_device("cuda") == "cuda"


def test_a_world_without_a_rank_is_refused(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="RANK is unset"):
        distributed.current()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.current() == Shard(0, 1)
