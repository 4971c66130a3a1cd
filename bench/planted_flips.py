"""Where the answers lost to a different-count donor go, on every shipped planted organism.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/planted_flips.py   # writes bench/planted_flips.json

The fresh bar (`countlens.toy.strictness`) counts the answers that move when everything outside C is
resampled from a scene of another count. Moved answers can mean two things: the rest of the model
carries the count (then the new answer leans toward the donor's count), or resampling 22 of 24 heads
(or 835 of 839 edges) perturbs a borderline answer (then it moves either way, mostly by one). Per
organism, on the bar's 1,024 fresh samples: the answers lost, how many by one, and how many toward the
donor's count (half of them by chance alone).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import countlens  # noqa: E402
from countlens.model.shipped import SHIPPED_EDGES, SHIPPED_PLANTED  # noqa: E402
from countlens.toy.edge_plant import fresh_edge_strictness  # noqa: E402
from countlens.toy.planted import CIRCUITS, EDGE_CIRCUITS  # noqa: E402
from countlens.toy.strictness import fresh_strictness  # noqa: E402


def main() -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in SHIPPED_PLANTED:
        model = countlens.load(f"planted-{name}").hf.float()
        f = fresh_strictness(model, CIRCUITS[name])
        out[f"planted-{name}"] = {"drop_different": f["outside"]["different"]["drop"], **f["lost_different"]}
    for name in SHIPPED_EDGES:
        circuit = EDGE_CIRCUITS[name]
        model = countlens.load(f"planted-{name}").hf.float()
        f = fresh_edge_strictness(model, circuit)
        out[f"planted-{name} (edges)"] = {"drop_different": f["outside"]["different"]["drop"], **f["lost_different"]}
        f = fresh_strictness(model, circuit.node_circuit)
        out[f"planted-{name} (nodes)"] = {"drop_different": f["outside"]["different"]["drop"], **f["lost_different"]}
    Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
