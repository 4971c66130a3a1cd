"""Launching the multi-process tests: torchrun with two CPU ranks, the CLI, and a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

CLI = Path(sys.executable).with_name("countlens")
#: Two ranks on this machine (``--standalone`` picks a free rendezvous port; ``--master_port 0`` hangs).
TWO_RANKS = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2"]


def run(argv: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``argv`` with HF_HUB_OFFLINE=1 and ``env``; asserts success unless ``check=False``."""
    # A launcher's variables in the test's own environment must not leak into the runs.
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        argv, env={**base, "HF_HUB_OFFLINE": "1", **(env or {})}, capture_output=True, text=True, timeout=600
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@contextmanager
def one_thread_here():
    """The one-process side of a comparison, run inside the test process (no start-up of a new
    interpreter, ~8 s here) with the single thread that torchrun gives each rank, so that its
    reductions and bits are the ranks' own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
