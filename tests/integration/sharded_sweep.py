"""One rank of a sharded sweep on the organism (run by tests/integration/test_sharded.py).

    python sharded_sweep.py OUT                      # one process
    torchrun --nproc_per_node 2 sharded_sweep.py OUT # two ranks, sharing OUT/stores

Runs patch_layers, patch_heads and ablation_scan with stores under OUT/stores and saves each
result to OUT/<rank>_of_<world>/<sweep>.nc. One thread per process, so that one process and the
ranks of torchrun (which sets OMP_NUM_THREADS=1) compute with the same reductions.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import countlens  # noqa: E402
from countlens import circuits, distributed  # noqa: E402
from countlens.datasets import count_pairs, task_samples  # noqa: E402
from countlens.results import save  # noqa: E402


def main(out: Path, only: str | None = None) -> None:
    torch.set_num_threads(1)
    shard = distributed.current()
    vlm = countlens.load("toy")
    pairs = count_pairs(10, kind="dots", grid=vlm.geometry, prompt="short", counts=range(2, 8), seed=3)
    tasks = {"count": task_samples("count", 10, seed=5), "color": task_samples("color", 6, seed=5)}
    runs = {
        "layers": lambda: circuits.patch_layers(vlm, pairs, batch_size=3, store=out / "stores" / "layers"),
        "heads": lambda: circuits.patch_heads(vlm, pairs, batch_size=3, store=out / "stores" / "heads"),
        "ablation": lambda: circuits.ablation_scan(vlm, tasks, batch_size=4, store=out / "stores" / "ablation"),
    }
    mine = out / f"{shard.rank}_of_{shard.world}"
    for name, run in runs.items():
        if only is None or name == only:
            save(run(), mine / f"{name}.nc")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
