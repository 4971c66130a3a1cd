"""`countlens plan`: FLOPs equal torch's FLOP counter, widths read the same off a meta model, sweeps
take their rows from free memory (and give the same results with fewer), the CLI writes a plan."""

from __future__ import annotations

import json

import pytest
import torch
from tolerance import assert_effect, logit_scale
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from countlens.circuits.methods.patching import patch_heads, prepare_pairs
from countlens.cli import app
from countlens.datasets.pairs import count_pairs
from countlens.datasets.tasks import task_samples
from countlens.errors import ConfigError
from countlens.model import memory
from countlens.model.loading import meta_vlm
from countlens.model.memory import MAX_ROWS
from countlens.pipeline import costs, plan
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.stages import REQUIRED

SMALL = DiscoverConfig(n_per_case=2, n_pairs=4, n_samples=4, batch_size=4)


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.mark.parametrize("name", ["toy", "llava"])
def test_forward_flops_equal_torch_flop_counter(name, loaded):
    """Eager attention runs as matmuls, which torch counts: the plan's count is exact."""
    vlm = loaded(name, attn_implementation="eager")
    samples = task_samples("count", 3, 0, image_size=vlm.geometry.image_height)
    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples])
    w = memory.widths(vlm)
    seq = batch.inputs["input_ids"].shape[1]
    for keep in (1, 3):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            vlm.hf(**batch.inputs, logits_to_keep=keep, use_cache=False)
        planned = costs.forward_flops(w, costs.Forward(3, seq, keep=keep), len(batch.image_pos[0]) * w.merge**2)
        if name == "toy":
            assert planned == counter.get_total_flops()
        else:  # CLIP's class token, one vision position more than the patches, is not planned
            assert 0 < counter.get_total_flops() - planned < 0.01 * planned


def test_meta_model_reads_the_loaded_models_widths(organism):
    assert memory.widths(meta_vlm("toy")) == memory.widths(organism)


def test_rows_per_forward_fit_free_memory(organism):
    w = memory.widths(organism)
    per_row = memory.stacked_row_bytes(w, 50)
    assert memory.rows_per_forward(w, 50, 1 << 40) == MAX_ROWS
    assert memory.rows_per_forward(w, 50, 0) == 1
    rows = memory.rows_per_forward(w, 50, int(10.5 * per_row / memory.FREE_SHARE))
    assert rows == 10
    assert memory.rows_per_forward(w, 100, int(10.5 * per_row / memory.FREE_SHARE)) < rows  # longer rows, fewer


@pytest.mark.numeric
def test_a_sweep_on_little_memory_stacks_fewer_rows_and_gives_the_same_effects(organism, monkeypatch):
    pairs = count_pairs(4, kind="dots", grid=organism.geometry, seed=0, prompt="short", counts=range(1, 10))
    full = patch_heads(organism, pairs, batch_size=4)
    w = memory.widths(organism)
    seen = []
    rows_per_forward = memory.rows_per_forward

    def spy(*args, **kwargs):
        seen.append(rows_per_forward(*args, **kwargs))
        return seen[-1]

    seq = 60
    monkeypatch.setattr(
        memory, "free_bytes", lambda device: int(9 * memory.stacked_row_bytes(w, seq) / memory.FREE_SHARE)
    )
    monkeypatch.setattr(memory, "rows_per_forward", spy)
    small = patch_heads(organism, pairs, batch_size=4)
    assert seen and max(seen) < 4 * full.sizes["layer"] * full.sizes["head"]  # not every replica in one forward
    assert max(seen) < MAX_ROWS
    # Fewer replicas per forward: other GEMM shapes, so the two sweeps agree up to rounding.
    scale = logit_scale(organism, prepare_pairs(organism, pairs))
    assert_effect(
        small.effect,
        full.effect,
        clean=full.clean_logit_diff,
        corrupt=full.corrupt_logit_diff,
        scale=scale,
        want_rounded=True,
        what="few-rows vs all-rows effect",
    )
    # to_corrupt is an arg-max per (head, pair), 96 of them: another stacking can flip only one whose top two
    # logits tie within rounding. (A share above 0.99 of 96 allowed none.) Allow one such flip, no more.
    assert int((small.to_corrupt.values != full.to_corrupt.values).sum()) <= 1


def test_plan_covers_every_stage_and_sizes_sweeps_like_run_edits(organism):
    p = plan.plan(organism, SMALL)
    assert [s.name for s in p.stages] == list(REQUIRED)
    by = {s.name: s for s in p.stages}
    assert by["heads"].rows == MAX_ROWS  # the organism's rows are tiny: the cap holds
    assert all(p.flops(s) > 0 for s in p.stages)
    # Every head of every pair is one stacked row: 6 layers × 4 heads × 4 pairs = 96 rows, one forward.
    stacked = [f for f in by["heads"].forwards if f.images == 0]
    assert sum(f.rows * f.count for f in stacked) == SMALL.n_pairs * organism.arch.n_layers * organism.arch.n_heads


def test_little_memory_shrinks_the_sweeps_and_flags_nothing_it_fits(organism):
    w = memory.widths(organism)
    roomy = plan.plan(organism, SMALL, memory=1 << 36, base=0)
    tight = plan.plan(organism, SMALL, memory=w.weight_bytes + 40 * memory.stacked_row_bytes(w, 60), base=0)
    assert {s.name: s.rows for s in tight.stages}["heads"] < {s.name: s.rows for s in roomy.stages}["heads"]
    assert roomy.over() == []
    # A device between the smallest and the largest stage's peak: exactly the larger stages are flagged.
    peaks = {s.name: roomy.peak(s) for s in roomy.stages}
    cut = (min(peaks.values()) + max(peaks.values())) // 2
    squeezed = plan.plan(organism, SMALL, memory=1 << 36, base=0)
    squeezed.memory = cut
    assert squeezed.over() == [n for n, v in peaks.items() if v > cut] and squeezed.over()
    with pytest.raises(ConfigError, match="do not fit"):
        plan.plan(organism, SMALL, memory=w.weight_bytes // 2, base=0)


def test_plans_for_several_memories_equal_one_plan_each_and_prepare_each_batch_once(organism, monkeypatch):
    w = memory.widths(organism)
    sizes = [1 << 36, w.weight_bytes + 40 * memory.stacked_row_bytes(w, 60)]
    alone = [plan.plan(organism, SMALL, memory=m, base=0) for m in sizes]
    prepared = []
    real = type(organism).prepare_samples
    monkeypatch.setattr(
        type(organism),
        "prepare_samples",
        lambda self, chunk, **kw: (
            prepared.append((tuple(map(id, chunk)), kw.get("teacher_force", False))) or real(self, chunk, **kw)
        ),
    )
    both = plan.plans(organism, SMALL, memories=sizes, base=0)
    assert [p.to_dict() for p in both] == [p.to_dict() for p in alone]
    assert [[s.forwards for s in p.stages] for p in both] == [[s.forwards for s in p.stages] for p in alone]
    heads = [{s.name: s.rows for s in p.stages}["heads"] for p in both]
    assert heads[1] < heads[0]  # each plan sized from its own memory
    assert prepared and len(prepared) == len(set(prepared))  # no chunk of samples prepared twice
    with pytest.raises(ConfigError, match="do not fit"):
        plan.plans(organism, SMALL, memories=[1 << 36, w.weight_bytes // 2], base=0)


def test_cli_plan_writes_json_and_refuses_bad_memory(tmp_path):
    runner = CliRunner()
    out = tmp_path / "plan.json"
    result = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "toy",
            "--n-per-case",
            "2",
            "--n-pairs",
            "4",
            "--n-samples",
            "4",
            "--image-size",
            "224",
            "--memory",
            "8",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert list(data["stages"]) == list(REQUIRED)
    assert data["image_size"] == 224 and data["patches"] == (224 // 16) ** 2
    assert data["memory_bytes"] == 8 * 2**30
    assert "| heads" in result.output
    bad = runner.invoke(app, ["plan", "--model", "toy", "--memory", "0"])
    assert bad.exit_code == 2 and "--memory" in bad.output


def test_remote_models_keep_the_fixed_row_cap(organism, monkeypatch):
    """A remote (NDIF) model's memory is the server's: no free figure is read from this machine."""
    assert memory.model_free_bytes(organism) > 0
    monkeypatch.setattr(organism, "remote", True)
    assert memory.model_free_bytes(organism) is None


@pytest.mark.parametrize("memories", ["80", [], [0], [80.5 * 2**30], 80 * 2**30])
def test_plans_refuse_memories_that_are_no_list_of_byte_counts(organism, memories):
    with pytest.raises(ConfigError, match="memor"):
        plan.plans(organism, SMALL, memories=memories)
