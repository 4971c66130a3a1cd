"""Sharded sweeps: two torchrun ranks sharing a store give one process's results bit for bit,
and a rank that dies costs only its own chunks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import sharded_sweep
from launch import CLI, TWO_RANKS, one_thread_here, run
from shared_run import TOY_RUN

from countlens.results import load

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m 'not slow'` leaves it out of the inner loop

WORKER = Path(__file__).with_name("sharded_sweep.py")
SWEEPS = ("layers", "heads", "ablation")


def _same(a, b) -> None:
    assert set(a.data_vars) == set(b.data_vars)
    for v in a.data_vars:
        assert np.array_equal(a[v].values, b[v].values), v  # bit for bit
    for c in a.coords:
        assert np.array_equal(a[c].values, b[c].values), c


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    with one_thread_here():
        sharded_sweep.main(out)
    return out


def test_two_torchrun_ranks_give_one_process_results_bit_for_bit(single, tmp_path):
    run([*TWO_RANKS, str(WORKER), str(tmp_path)])
    for name in SWEEPS:
        want = load(single / "0_of_1" / f"{name}.nc")
        for rank in (0, 1):
            _same(load(tmp_path / f"{rank}_of_2" / f"{name}.nc"), want)
    # Each rank wrote its own chunks: every 2nd key, from its rank.
    chunks = sorted(p.stem for p in (tmp_path / "stores" / "heads" / "chunks").glob("*.nc"))
    assert chunks == [f"pairs_{s:06d}_{min(s + 3, 10):06d}" for s in range(0, 10, 3)]


def test_a_rank_that_dies_costs_only_its_chunks(single, tmp_path):
    # Rank 0 alone, of a world of 2: it writes its chunks, then gives up waiting for rank 1's.
    lone = run(
        [sys.executable, str(WORKER), str(tmp_path), "heads"],
        env={"RANK": "0", "WORLD_SIZE": "2", "COUNTLENS_SHARD_TIMEOUT": "1"},
        check=False,
    )
    assert lone.returncode != 0 and "never wrote" in lone.stderr and "relaunch" in lone.stderr
    chunks = tmp_path / "stores" / "heads" / "chunks"
    written = {p.stem: p.stat().st_mtime_ns for p in chunks.glob("*.nc")}
    assert sorted(written) == ["pairs_000000_000003", "pairs_000006_000009"]
    # Relaunched, both ranks finish; rank 0's chunks are read, not recomputed.
    run([*TWO_RANKS, str(WORKER), str(tmp_path), "heads"])
    assert {k: (chunks / f"{k}.nc").stat().st_mtime_ns for k in written} == written
    _same(load(tmp_path / "0_of_2" / "heads.nc"), load(single / "0_of_1" / "heads.nc"))


@pytest.fixture(scope="module")
def discovered(toy_run, tmp_path_factory) -> dict[str, Path]:
    """`countlens discover` on the organism at small sizes: one process (the shared run, made with one
    thread as each rank has), and two torchrun ranks."""
    root = tmp_path_factory.mktemp("discover")
    ranks = run([*TWO_RANKS, "--no-python", str(CLI), "discover", *TOY_RUN, "--out", str(root / "two")])
    return {"one": toy_run, "two": root / "two", "stdout": ranks.stdout}


def test_sharded_discover_matches_one_process(discovered):
    assert "rank 1 of 2: its share of the sweeps is done" in discovered["stdout"]
    for stage in ("vap", "heads", "ablation", "cases", "temperature"):
        _same(load(discovered["two"] / "results" / f"{stage}.nc"), load(discovered["one"] / "results" / f"{stage}.nc"))
    assert (discovered["two"] / "report.md").read_text() == (discovered["one"] / "report.md").read_text()


def test_data_parallel_finetune_command_writes_one_table(discovered):
    circuit = discovered["two"]
    done = run(
        [
            *TWO_RANKS,
            "--no-python",
            str(CLI),
            "finetune",
            "--model",
            "toy",
            "--circuit",
            str(circuit),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--n-train",
            "16",
            "--n-eval",
            "8",
        ]
    )
    table = (circuit / "finetune" / "before_after.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in table[1:]] == [
        "baseline",
        "+SFT",
        "+SFT+focus",
        "+SFT+focus+temperature",
        "+SFT+focus+MAS",
    ]
    assert done.stdout.count("+SFT+focus+MAS ") == 1  # the table, printed by rank 0 alone
    assert (circuit / "report.md").read_text().count("Circuit-guided fine-tune") == 1
