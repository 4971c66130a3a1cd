"""Data-parallel fine-tune on 2 CPU processes (gloo): the adapter equals one process's with the
same global batch, and a run whose rank was killed resumes to the uninterrupted run's adapter."""

from __future__ import annotations

from pathlib import Path

import ddp_finetune
import pytest
import torch
from launch import TWO_RANKS, one_thread_here, run
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m 'not slow'` leaves it out of the inner loop

WORKER = Path(__file__).with_name("ddp_finetune.py")
TWO = [*TWO_RANKS, str(WORKER)]


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    with one_thread_here():
        ddp_finetune.main(one, die=False)
    run([*TWO, str(two)])
    return {"one": one, "two": two}


def test_two_ranks_train_the_single_process_adapter(runs):
    a, b = _adapter(runs["one"]), _adapter(runs["two"])
    assert a.keys() == b.keys() and len(a) > 0
    # Each rank pads its 4 samples to its own longest prompt, and DDP sums two half-batch
    # gradients: the same arithmetic in another order, so equal to float rounding, not bit for bit.
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)  # seen: ≤ 2.4e-6 on weights ≤ 0.09
    moved = max(
        float((a[k] - load_file(runs["one"] / "checkpoint" / "adapter_model.safetensors")[k]).abs().max()) for k in a
    )
    assert moved == 0.0  # the final checkpoint is the adapter (steps 4 = a checkpoint step)
    log_one = (runs["one"] / "train_log.jsonl").read_text().splitlines()
    log_two = (runs["two"] / "train_log.jsonl").read_text().splitlines()
    assert len(log_one) == len(log_two) == 4


def test_a_killed_rank_resumes_to_the_uninterrupted_adapter(runs, tmp_path):
    died = run([*TWO, str(tmp_path), "--die-after-checkpoint"], check=False)
    assert died.returncode != 0
    assert (tmp_path / "checkpoint" / "state.pt").exists() and not (tmp_path / "adapter").exists()
    run([*TWO, str(tmp_path)])
    a, b = _adapter(runs["two"]), _adapter(tmp_path)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # same ranks, same steps from the checkpoint: bit for bit
