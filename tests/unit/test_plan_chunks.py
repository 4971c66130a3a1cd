"""Rows per chunk: the planner takes as many pairs or samples a chunk as the memory holds, the run takes
the same (one rule, `countlens.pipeline.costs.fit_rows`), and every discover stage of the papers' 7B
models fits 80 GiB (issue 76, item 3)."""

from __future__ import annotations

import math

import pytest
from real_checkpoints import TOKENIZER_FROM, planning_dir
from tolerance import assert_close, assert_normalised, logit_scale
from typer.testing import CliRunner

from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.methods import registry
from countlens.cli import app
from countlens.errors import ConfigError
from countlens.model import memory
from countlens.model.loading import meta_vlm
from countlens.pipeline import costs, plan
from countlens.pipeline.config import DiscoverConfig, resolved_prompt
from countlens.pipeline.inputs import stage_inputs
from countlens.pipeline.stages import base, edges, patching
from countlens.pipeline.stages.base import RunContext

GIB = 1 << 30
SMALL = DiscoverConfig(n_per_case=2, n_pairs=4, n_samples=4, batch_size=4)
#: The default discover's batch (16) on few pairs and samples: the same rows a chunk and the same peaks
#: as the default run (a peak is one chunk's), at a fraction of the samples to make.
BATCH16 = DiscoverConfig(n_per_case=1, n_pairs=16, n_samples=16, batch_size=16)
#: The papers' 7B models, each at its image size (Qwen's pixel budget pinned to 448 px; LLaVA-1.5's 336 px).
PAPERS = {"Qwen__Qwen2.5-VL-7B-Instruct": 448, "llava-hf__llava-1.5-7b-hf": None}
#: Stages whose pairs or samples a chunk the planner chooses, and what a chunk's row is.
CHUNKED = {
    **dict.fromkeys(("cases", "conflict_std", "conflict", "attention_metrics", "temperature"), "sample"),
    **dict.fromkeys(("atp", "eap_ig", "edge_faithfulness"), "pair"),
}
#: Two pairs in one chunk, or one a chunk where memory holds one: AtP through its stage both ways.
TWO_PAIRS = DiscoverConfig(n_per_case=2, n_pairs=2, n_samples=4, batch_size=2)


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def paper_vlm(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            path = planning_dir(name, tiny_checkpoint(TOKENIZER_FROM[name]), tmp_path_factory.mktemp(name))
            made[name] = meta_vlm(str(path), dtype="bfloat16", image_size=PAPERS[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def planner(organism):
    """The organism's planner for SMALL: its pairs, their tokens and patches."""
    return costs.Planner(organism, SMALL, free=1 << 36)


def _eap_ig_row(organism, planner) -> int:
    w = memory.widths(organism)
    return patching.gradient_row_bytes(w, planner.pair_seq, planner.patches, patching.KEPT_SETS["eap_ig"])


def _holding(organism, row: int, k: float) -> int:
    """A device's memory whose free share holds ``k`` rows of ``row`` bytes beside the organism's weights."""
    return memory.widths(organism).weight_bytes + math.ceil(k * row / memory.FREE_SHARE) + 8


def _run(organism, config=SMALL) -> RunContext:
    prompt = resolved_prompt(organism, config)
    run = RunContext(organism, config, prompt, stage_inputs(organism, config, prompt), None, None, print)
    run.pairs = run.inputs["pairs"]()
    return run


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.slow] if n.startswith("Qwen") else []) for n in PAPERS],
)
def test_every_discover_stage_fits_80_gib_on_the_papers_7b_models(name, paper_vlm):
    """LLaVA-1.5-7B was over 80 GiB at discover's 16 pairs a chunk (EAP-IG 84.2 GiB, the edge stage 86.8);
    Qwen2.5-VL-7B fitted (its meta model with the real Qwen vocabulary takes about 9 s: slow)."""
    vlm = paper_vlm(name)
    on80, on141 = plan.plans(vlm, BATCH16, memories=[80 * GIB, 141 * GIB], device="cuda")
    for p in (on80, on141):
        assert p.over() == [], {s.name: round(p.peak(s) / GIB, 1) for s in p.stages if s.name in p.over()}
        assert all(p.peak(s) <= p.memory and s.fits for s in p.stages)
    by80, by141 = ({s.name: s for s in p.stages} for p in (on80, on141))
    for stage, unit in CHUNKED.items():
        assert 1 <= by80[stage].batch <= by141[stage].batch <= 16, stage
        said = f"{by80[stage].batch} {unit}s a chunk"
        assert any(note.startswith(said) and "to fit 80.0 GiB" in note for note in by80[stage].notes), stage
    if name.startswith("llava"):
        for stage in ("eap_ig", "edge_faithfulness"):
            assert by80[stage].batch < 16 and "(16 asked) to fit 80.0 GiB" in by80[stage].notes[-1], stage
            assert by141[stage].batch == 16 and "(as asked)" in by141[stage].notes[-1], stage


def test_the_planner_takes_the_most_pairs_that_fit_and_fewer_as_memory_shrinks(organism, planner):
    row = _eap_ig_row(organism, planner)
    sizes = [1 << 36, *(_holding(organism, row, k) for k in (3.5, 3, 2, 1))]
    chosen = []
    for p in plan.plans(organism, SMALL, memories=sizes, base=0):
        s = {s.name: s for s in p.stages}["eap_ig"]
        assert s.fits and "eap_ig" not in p.over()
        chosen.append(s.batch)
        if s.batch < SMALL.batch_size:
            assert s.notes == [f"{s.batch} pairs a chunk (4 asked) to fit {p.memory / GIB:.1f} GiB"]
            assert (s.batch + 1) * row > memory.FREE_SHARE * p.free  # one more would not fit
        assert max(f.rows for f in s.forwards) == s.batch
    assert chosen == [4, 3, 3, 2, 1]


def test_a_device_below_a_stages_floor_names_the_stage_and_the_knob(organism, planner):
    row = _eap_ig_row(organism, planner)
    p = plan.plan(organism, SMALL, memory=_holding(organism, row, 0.5), base=0)
    s = {s.name: s for s in p.stages}["eap_ig"]
    assert not s.fits and s.batch == 1 and "eap_ig" in p.over()
    assert "even at 1 pair a chunk" in s.notes[-1] and p.knobs()["eap_ig"] == costs.FLOOR_KNOB
    # The command prints the plan, then refuses, naming each stage over and what makes it fit.
    gib = _holding(organism, row, 0.5) / GIB
    args = ["plan", "--model", "toy", "--device", "cuda", "--memory", f"{gib:.6f}"]
    result = CliRunner().invoke(app, [*args, "--n-per-case", "2", "--n-pairs", "4", "--n-samples", "4"])
    assert result.exit_code == 2, result.output
    assert "| eap_ig " in result.output and "eap_ig: give a device with more memory" in result.output


def test_the_run_takes_the_plans_rows_and_refuses_below_the_floor(organism, planner, monkeypatch):
    row = _eap_ig_row(organism, planner)
    size = _holding(organism, row, 2)
    by = {s.name: s for s in plan.plan(organism, SMALL, memory=size, base=0).stages}
    free = size - memory.widths(organism).weight_bytes
    monkeypatch.setattr(costs, "model_free_bytes", lambda vlm: free)
    run = _run(organism)
    assert patching.gradient_rows(run, patching.EAP_IG_METHOD, patching.KEPT_SETS["eap_ig"]) == by["eap_ig"].batch == 2
    assert patching.gradient_rows(run, patching.ATP_METHOD, patching.KEPT_SETS["atp"]) == by["atp"].batch
    first = prepare_pairs(organism, run.pairs[: SMALL.batch_size]).clean
    assert edges.attribution_rows(run, first) == by["edge_faithfulness"].batch
    for stage in ("cases", "conflict", "temperature", "attention_metrics"):
        assert costs.score_rows(organism, stage, run.inputs[stage](), SMALL.batch_size) == by[stage].batch, stage
    # The stage's own computation gets them: EAP-IG's node attribution is called with the plan's rows.
    seen = []
    monkeypatch.setattr(registry, "node_attribution", lambda vlm, pairs, batch_size, **kw: seen.append(batch_size))
    patching.EAP_IG.compute(run)
    assert seen == [2]
    # Below the floor the run refuses before its first forward, naming the stage and the knob.
    monkeypatch.setattr(costs, "model_free_bytes", lambda vlm: row // 2)
    with pytest.raises(ConfigError, match=r"eap_ig: one pair a chunk needs .* give a device with more memory"):
        patching.EAP_IG.compute(run)
    assert seen == [2]


def test_candidate_scoring_in_the_plans_chunks_gives_the_default_chunks_answers(organism, monkeypatch):
    """The cases stage's answers (`RunContext.answers`) one sample a chunk, where a small device holds one,
    against the four asked: the same answers, their probabilities within float32 rounding."""
    run = _run(organism)
    samples = run.inputs["cases"]()[:4]
    full = run.answers(samples)
    w = memory.widths(organism)
    per, width = costs.score_shape(organism, samples)
    batch = organism.prepare_samples(samples)
    row = costs.score_row_bytes(w, batch.inputs["input_ids"].shape[1], per, width, batch.patches(w.merge))
    monkeypatch.setattr(costs, "model_free_bytes", lambda vlm: _holding(organism, row, 1) - w.weight_bytes)
    calls = []
    real = base.score
    monkeypatch.setattr(
        base, "score", lambda *a, batch_size, **kw: calls.append(batch_size) or real(*a, batch_size=batch_size, **kw)
    )
    chunked = run.answers(samples)
    assert calls == [1]
    assert (chunked.pred.values == full.pred.values).all()
    assert_close(chunked.p_gold, full.p_gold, what="P(gold), 1 vs 4 samples a chunk")


@pytest.mark.slow
def test_a_chunk_of_the_plans_rows_gives_the_default_rows_result(organism, monkeypatch):
    """AtP through its stage with the one pair a chunk a small device holds, against the two asked
    (about 5 s: nnsight's three traced passes a chunk, three chunks)."""
    run = _run(organism, TWO_PAIRS)
    full = patching.ATP.compute(run)
    w = memory.widths(organism)
    seq, patches = costs.pair_shape(organism, run.pairs, 2)
    row = patching.gradient_row_bytes(w, seq, patches, patching.KEPT_SETS["atp"])
    monkeypatch.setattr(costs, "model_free_bytes", lambda vlm: _holding(organism, row, 1) - w.weight_bytes)
    calls = []
    real = registry.attribution_patch

    def spy(*args, batch_size, **kw):
        calls.append(batch_size)
        return real(*args, batch_size=batch_size, **kw)

    monkeypatch.setattr(registry, "attribution_patch", spy)
    chunked = patching.ATP.compute(run)
    assert calls == [1]
    scale = logit_scale(organism, prepare_pairs(organism, run.pairs))
    for var in ("effect", "resid_effect"):
        assert_normalised(
            chunked[var],
            full[var],
            denominator=full.attrs["normaliser"],
            n=len(run.pairs),
            scale=scale,
            what=f"AtP {var}, 1 vs 2 pairs a chunk",
            want_rounded=True,
        )
