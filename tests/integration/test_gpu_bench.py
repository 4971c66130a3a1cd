"""bench/gpu.py's CPU dry run: a random-init model at Qwen2.5-VL-7B's widths (depth 1) runs every
measurement the GPU check makes, and reports the widths it was built with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m 'not slow'` leaves it out of the inner loop

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def test_gpu_bench_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["config"] == {
        "hidden": 3584,
        "heads": 28,
        "kv_heads": 4,
        "intermediate": 18944,
        "vocab": 152064,
        "layers": 1,
        "vision_hidden": 1280,
        "vision_heads": 16,
        "vision_intermediate": 3420,
        "vision_depth": 1,
        "patch": 14,
        "merge": 2,
    }
    assert r["image_tokens"] == 16 and r["p2"]["heads"] == 28 and r["vap"]["sites"] == 6
    # `countlens check` on the 7B-width model: every row passes (memory skipped on the CPU).
    assert {row["status"] for row in r["check"]} == {"passed", "skipped"} and len(
        r["check"]
    ) == 16  # with "outputs are finite"
    for section, key in (("p1", "ratio"), ("vap", "ratio"), ("p2", "speedup"), ("edges", "ratio")):
        assert r[section][key] > 0
    # depth 1 at 28 heads and 4 KV heads: 2 inputs → 36 q / k / v receivers, 30 → the MLP, 31 → the logits
    assert r["edges"]["edges"] == 36 * 2 + 30 + 31 and r["edges"]["planned_ratio"] > 1
    assert r["peak_memory_bytes"] > 4 * 2**30  # 1.39 B fp32 parameters are resident
