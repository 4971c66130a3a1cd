"""The README walk-through (examples/walkthrough.py) runs as written."""

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m 'not slow'` leaves it out of the inner loop


def test_walkthrough_runs(tmp_path):
    module = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "walkthrough.py"))
    out = module["main"](tmp_path)
    assert 0 <= out["accuracy"] <= 1 and (tmp_path / "vap.nc").exists()
    assert len(out["vap_last_token_effect"]) == 7  # embeddings + 6 layers
    assert out["sharpened_logits_shape"][0] == 4
