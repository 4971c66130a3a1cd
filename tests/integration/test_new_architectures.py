"""The papers' other backbones and the families released since, end to end at toy sizes: every
discover stage and `countlens plan` on the tiny InternVL, Ovis2, Phi-4-multimodal, Llama-3.2-Vision,
Qwen3.5, Qwen3-VL-MoE, GLM-4.1V, Gemma 4, PaliGemma, Mistral 3, Idefics3, SmolVLM and Llama 4, and the MAS
paper's fine-tune (focus + MAS) on InternVL and Ovis2, its backbones, with tiled training images."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import countlens
from countlens.cli import app
from countlens.datasets.tasks import task_samples
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.discover import discover
from countlens.pipeline.stages import REQUIRED
from countlens.training.finetune import FinetuneConfig, finetune

pytestmark = pytest.mark.slow

# Each with a 16×16 patch grid per image or tile, so every COUNTINGTRICKS case fits 3 … 9+ objects.
NEW = {
    "internvl": {"tile": 64},
    "ovis2": {"tile": 64},
    "phi4_multimodal": {"tile": 64},
    "mllama": {"tile": 128},
    "qwen3_5": {"image_side": 128},
    "qwen3_vl_moe": {"image_side": 128},
    "glm4v": {"image_side": 128},
    "gemma4": {},  # 70 pooled tokens: a square image at 128 px
    "paligemma": {"tile": 128},
    "mistral3": {"tile": 128},
    "idefics3": {"tile": 64},
    "smolvlm": {"tile": 64},
    "llama4": {"tile": 64},
}


#: The families whose report figures are drawn here too: one of each layout the figures place an image's
#: tokens in (tiles with a thumbnail, a cross-attention model's image states in tiles, a single
#: dynamic-resolution image with ragged heads, pooled tokens, rows ended by break tokens). The others'
#: results are checked and their report written without its figures (drawn from results of the same
#: kinds), to keep the suite within its time budget.
DRAWN = {"internvl", "mllama", "qwen3_5", "gemma4", "mistral3"}


@pytest.mark.parametrize("name", NEW)
def test_every_discover_stage_and_the_plan(name, tiny_checkpoint, tmp_path, request):
    path = tiny_checkpoint(name, **NEW[name])
    vlm = countlens.load(path)
    if name not in DRAWN:
        request.getfixturevalue("undrawn_report")
    report = discover(
        vlm,
        tmp_path / "run",
        DiscoverConfig(n_per_case=1, n_pairs=4, n_samples=4, batch_size=8, tasks=("count", "color")),
        log=lambda _: None,
    )
    text = report.read_text()
    assert any((tmp_path / "run" / "figures").glob("*.png")) == (name in DRAWN)
    for section in ("COUNTINGTRICKS", "visual activation patching", "Logit lens", "Head classes", "Head temperature"):
        assert section in text, (name, section)
    heads = pd.read_csv(tmp_path / "run" / "heads.csv")
    # Every layer's own heads (Qwen3.5's softmax layers have fewer than its linear ones).
    assert len(heads) == sum(vlm.arch.head_counts) and heads["importance"].notna().all()

    out = tmp_path / "plan.json"
    small = ["--n-per-case", "1", "--n-pairs", "4", "--n-samples", "4", "--memory", "8", "--json", str(out)]
    result = CliRunner().invoke(app, ["plan", "--model", str(path), *small])
    assert result.exit_code == 0, result.output
    planned = json.loads(out.read_text())
    assert list(planned["stages"]) == list(REQUIRED) and planned["patches"] > 0


@pytest.mark.parametrize("name", ["internvl", "ovis2"])
def test_focus_and_mas_finetune_on_the_mas_papers_backbones(name, loaded, tmp_path):
    """64-px images: 2×2 tiles and a thumbnail, so the focus prior is laid over every view's tokens."""
    vlm = loaded(name)
    samples = task_samples("count", 4, 1000, image_size=64)
    rows = []
    config = FinetuneConfig(steps=2, batch_size=2, save_every=2, target_layers=(1,), focus=1.0, mas=0.1, lr=1e-3)
    adapter = finetune(vlm, samples, tmp_path / "ft", config, progress=rows.append)
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert {"focus", "mas"} <= set(rows[0]), rows[0]
