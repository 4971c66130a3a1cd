"""Detection probes on the organism: AP@50 per tap, and the wall time, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/probes.py          # writes bench/probes.json

COUNTINGTRICKS position cases 1A–4D at the organism's 192 px geometry: 19 train images per case
(seed 0, 304 in all) and 7 test images per case (seed 1, 112), counts 3–12. One `ProbeConfig()`
(the defaults) for every tap: vision blocks 0 and 1 (12×12 patch grid), the projector output and
decoder layers 0, 2 and 5 (6×6 token grid). Reported per tap: AP@50 on the test images (all cases,
and per position anchor 1–4), parameters, final training loss and seconds; plus, for context, the
count separation (silhouette, `analysis.representations`) of the last-token states of the test
images at every decoder layer. One torch thread (the probes' tensors are tiny, and the CPUs are shared).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

import countlens
from countlens.analysis.probes import ProbeConfig, probe_taps
from countlens.analysis.representations import last_token_states, separation
from countlens.datasets.countingtricks import countingtricks

CASES = [f"{k}{letter}" for k in range(1, 5) for letter in "ABCD"]
TAPS = [("vision", 0), ("vision", 1), ("projector", None), ("llm", 0), ("llm", 2), ("llm", 5)]


def _r(x: float) -> float:
    return round(float(x), 4)


def main(train_per_case: int = 19, test_per_case: int = 7) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    vlm = countlens.load("toy")
    train = countingtricks(CASES, train_per_case, grid=vlm.geometry, seed=0, prompt="short")
    test = countingtricks(CASES, test_per_case, grid=vlm.geometry, seed=1, prompt="short")
    config = ProbeConfig()
    ds = probe_taps(vlm, train, test, TAPS, config)
    by_anchor = ds.ap50_case.groupby(xr_anchor(ds)).mean()
    layers = list(range(vlm.arch.n_layers))
    t = time.perf_counter()
    sep = separation(last_token_states(vlm, test, layers), [s.meta["count"] for s in test], layers=layers)
    sep_seconds = time.perf_counter() - t
    result = {
        "model": "toy",
        "threads": 1,
        "cases": f"{CASES[0]}-{CASES[-1]}",
        "train": len(train),
        "test": len(test),
        "config": ds.attrs["config"],
        "taps": {
            tap: {
                "ap50": _r(ds.ap50.sel(tap=tap)),
                "n_params": int(ds.n_params.sel(tap=tap)),
                "channels": int(ds.channels.sel(tap=tap)),
                "grid": int(ds.grid.sel(tap=tap)),
                "train_loss": _r(ds.train_loss.sel(tap=tap)),
                "seconds": round(float(ds.seconds.sel(tap=tap)), 1),
                "ap50_by_anchor": {str(a): _r(by_anchor.sel(tap=tap, anchor=a)) for a in by_anchor.anchor.values},
            }
            for tap in ds.tap.values
        },
        "separation_last_token": {
            f"llm.{layer}": {r: _r(sep.sel(layer=layer, range=r)) for r in sep.range.values} for layer in layers
        },
        "separation_seconds": round(sep_seconds, 1),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
    }
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def xr_anchor(ds):
    """The position anchor of each case: 1 cell centre, 2 vertical line, 3 horizontal line, 4 intersection."""
    anchors = {"1": "1 centre", "2": "2 vline", "3": "3 hline", "4": "4 cross"}
    return ds.case.copy(data=np.array([anchors[c[0]] for c in ds.case.values])).rename("anchor")


if __name__ == "__main__":
    out = main()
    print(json.dumps({k: v["ap50"] for k, v in out["taps"].items()} | {"wall_seconds": out["wall_seconds"]}, indent=2))
