"""One rank of a data-parallel fine-tune of the organism (run by tests/integration/test_ddp_finetune.py).

    python ddp_finetune.py OUT [--die-after-checkpoint]
    torchrun --nproc_per_node 2 ddp_finetune.py OUT [--die-after-checkpoint]

Four steps of SFT + focus on 32 counting scenes, global batch 8, a checkpoint every 2 steps, one
thread per process. With --die-after-checkpoint, rank 1 kills itself (SIGKILL) as soon as the first
checkpoint is on disk: the test then relaunches and checks the resumed adapter.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import countlens  # noqa: E402
from countlens import distributed  # noqa: E402
from countlens.datasets import task_samples  # noqa: E402
from countlens.training.finetune import FinetuneConfig, finetune  # noqa: E402

CONFIG = FinetuneConfig(
    steps=4, batch_size=8, lr=1e-3, lora_r=8, lora_alpha=16, target_layers=(0,), focus=1.0, save_every=2
)


def _die_after_checkpoint(out: Path) -> None:
    def watch():
        while not (out / "checkpoint" / "state.pt").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def main(out: Path, die: bool) -> None:
    torch.set_num_threads(1)
    if die and distributed.current().rank == 1:
        _die_after_checkpoint(out)
    vlm = countlens.load("toy")
    finetune(vlm, task_samples("count", 32, seed=1000), out, CONFIG)


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--die-after-checkpoint" in sys.argv)
