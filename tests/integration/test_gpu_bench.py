"""bench/gpu.py --all's CPU dry run: a random-init model at Qwen2.5-VL-7B's widths (depth 1, the edge
curve at depths 1 and 2) runs every row the GPU run records, through the same code; and a row past its
time budget is stopped while the run goes on."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

ROWS = [
    "build",
    "check",
    "trace",
    "discover/atp",
    "discover/lens",
    "transcoders",
    "graph",
    "finetune",
    "patch_heads",
    "peer_head_loop",
    "edges_depth_1",
    "edges_depth_2",
]


@pytest.mark.slow  # end-to-end: `pytest -m 'not slow'` leaves it out of the inner loop
def test_gpu_bench_all_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--dry-run", str(out), "--all"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())["dry_run"]
    assert r["finished"] and r["failed"] == [] and r["depth"] == 1 and r["dtype"] == "float32"
    assert r["widths"] == {
        "hidden": 3584,
        "heads": 28,
        "kv_heads": 4,
        "intermediate": 18944,
        "vocab": 152064,
        "vision_hidden": 1280,
        "vision_heads": 16,
        "vision_intermediate": 3420,
        "patch": 14,
        "merge": 2,
    }
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ROWS
    for row in rows.values():
        assert row["status"] == "ok" and math.isfinite(row["seconds"]) and row["seconds"] > 0, row
        assert row["peak_bytes"] > 4 * 2**30, row  # 1.64 B fp32 parameters (depth 2) are resident
    # The plan's figures where a plan exists: discover's stages, the graph, the weights; null elsewhere.
    planned = {name for name, row in rows.items() if row["planned_seconds"] is not None}
    assert planned == {name for name in ROWS if name.startswith("discover/")} | {"graph", "transcoders"}
    assert all(rows[name]["planned_peak_bytes"] > 2**30 for name in planned | {"build"})
    # `countlens check` on the 7B-width model: every row passes (memory skipped on the CPU).
    assert {row["status"] for row in rows["check"]["check"]} == {"passed", "skipped"}
    assert len(rows["check"]["check"]) == 16  # with "outputs are finite"
    assert rows["trace"]["ratio"] > 0 and rows["transcoders"]["steps"] == 2
    assert rows["graph"]["features"] == 16 and rows["graph"]["finite"]
    assert rows["patch_heads"]["heads"] == rows["peer_head_loop"]["heads"] == 28
    assert rows["peer_head_loop"]["heads_run"] >= 1 and rows["peer_head_loop"]["speedup_patch_heads"] > 0
    # depth 1 at 28 heads and 4 KV heads: 2 inputs → 36 q / k / v receivers, 30 → the MLP, 31 → the logits
    assert rows["edges_depth_1"]["edges"] == 36 * 2 + 30 + 31 and rows["edges_depth_1"]["planned_ratio"] > 1
    assert rows["edges_depth_2"]["layers"] == 2 and rows["edges_depth_2"]["edges"] > rows["edges_depth_1"]["edges"]


def test_a_row_past_its_budget_is_stopped_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_rows

    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"recorded": 1}))  # an earlier run's figures stay beside the new rows

    def spin():
        while True:
            pass

    rec = gpu_rows.Recorder(out, "quick", {"mode": "quick"}, "cpu")
    assert rec.row("slow", spin, budget=0.05) is None
    assert rec.row("fast", lambda: {"x": 1}, budget=5.0) == {"x": 1}
    data = json.loads(out.read_text())
    assert data["recorded"] == 1 and rec.failed == ["slow"]
    slow, fast = data["quick"]["rows"]
    assert slow["status"] == "over_budget" and 0.05 <= slow["seconds"] < 1 and fast["status"] == "ok"
    assert fast["x"] == 1 and fast["budget_s"] == 5.0 and fast["peak_bytes"] > 0


def test_a_bfloat16_rms_norm_freezes_as_the_gpu_runs_graph_needs(loaded):
    """The GPU run is bfloat16: Qwen's RMSNorm (the organism's, as Qwen2.5-VL's) normalises in float32 and
    rounds to bfloat16, which the graph's frozen norms recognise (they refused it: 'not weight · x /
    rms(x)'); another form is still refused."""
    import copy

    import torch

    from countlens.circuits.engine.freeze import rms_scale
    from countlens.errors import InputError

    norm = copy.deepcopy(loaded("toy").hf.model.language_model.norm).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = (torch.randn(2, 7, norm.weight.shape[0]) * 3).to(torch.bfloat16)
    s = rms_scale(norm, x, norm(x))
    assert s.dtype == torch.bfloat16 and s.shape == (2, 7, 1)
    exact = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert torch.allclose(s.float(), exact, rtol=2**-7)
    with pytest.raises(InputError, match="not weight"):  # Gemma's (1 + w) ⊙ x · s is another form
        rms_scale(norm, x, (norm.weight + 1) * (x.float() * exact).to(torch.bfloat16))
