"""discover's ``objects`` stage: which scenes it measures, what it stores, what it costs, and the report's
section (`countlens.pipeline.stages.objects`), on the organism's COUNTINGTRICKS scenes, one per case."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from PIL import Image

from countlens import results
from countlens.analysis.object_misses import run_misses
from countlens.pipeline.config import DiscoverConfig, resolved_prompt
from countlens.pipeline.costs import Planner
from countlens.pipeline.inputs import stage_inputs
from countlens.pipeline.rundir import Stages
from countlens.pipeline.stages import REQUIRED, SECTIONS, STAGES, ReportContext, RunContext
from countlens.pipeline.stages import objects as stage

CONFIG = DiscoverConfig(n_per_case=1, n_pairs=1, n_samples=1, batch_size=8)


def render(values: dict, number: int = 11) -> str:
    env = Environment(
        loader=FileSystemLoader(Path(stage.__file__).parent.parent / "templates"), undefined=StrictUndefined
    )
    env.filters["fmt"] = format
    return env.get_template(f"sections/{stage.SECTION.template}").render(number=number, **values)


def test_pick_takes_evenly_spaced_samples_of_each_case_in_run_order():
    cases = ["1A"] * 10 + ["2A"] * 3 + ["5A"]
    assert stage.pick(cases, 4).tolist() == [0, 3, 6, 9, 10, 11, 12, 13]
    assert stage.pick(cases, 1).tolist() == [0, 10, 13]
    # an empty scene (count 0: nothing to measure) is never picked, and a case of only such scenes drops out
    usable = [i != 0 for i in range(10)] + [True, True, True, False]
    assert stage.pick(cases, 4, usable).tolist() == [1, 4, 6, 9, 10, 11, 12]
    assert stage.pick(cases, 4, [False] * len(cases)).tolist() == []


@pytest.fixture(scope="module")
def run_dir(loaded, tmp_path_factory):
    """The organism's cases answered (one scene per case), the stage computed and stored, forward rows
    counted at the first decoder layer, then resumed from disk."""
    vlm = loaded("toy")
    out = tmp_path_factory.mktemp("run")
    prompt = resolved_prompt(vlm, CONFIG)
    run = RunContext(vlm, CONFIG, prompt, stage_inputs(vlm, CONFIG, prompt), out, None, print)
    run.results["cases"] = run.answers(run.inputs["cases"]())
    rows = []
    hook = vlm.hf.get_decoder().layers[0].register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    try:
        stages = Stages(out, {"model": vlm.name, "arch": vlm.arch.name})
        first = stages.run("objects", lambda: stage.OBJECTS.compute(run))
    finally:
        hook.remove()
    again = stages.run("objects", lambda: pytest.fail("a finished stage is recomputed"))
    return vlm, out, run, first, again, rows


def test_the_stage_measures_the_picked_scenes_stores_them_and_resumes(run_dir):
    _, out, run, first, again, _ = run_dir
    assert "objects" in REQUIRED and stage.OBJECTS in STAGES and stage.SECTION in SECTIONS
    xr.testing.assert_identical(again, results.load(out / "results" / "objects.nc"))
    cases, samples = run.results["cases"], run.inputs["cases"]()
    index = first["index"].values
    assert index.tolist() == stage.pick([s.meta["case"] for s in samples]).tolist() and len(index) == 32
    assert (first.answered_right.values == cases.correct.values[index]).all()
    assert first.attrs["reference"] == "removed" and first.attrs["site"] == "L-1.resid"
    assert int(first["count"].sum()) == sum(len(samples[i].scene.objects) for i in index)
    drawn = first["drawn_scene"].values
    right = first.answered_right.values[drawn]
    assert 0 < right.sum() <= stage.PER_OUTCOME and 0 < (~right).sum() <= stage.PER_OUTCOME
    for k, s in enumerate(drawn):  # the stored image is the scene's, each object's label its index + 1
        sample = samples[index[s]]
        assert (first.image.values[k] == np.asarray(sample.image.convert("RGB"))).all()
        masks = sample.scene.masks()
        assert set(np.unique(first.labels.values[k])) <= set(range(len(masks) + 1))
        assert (first.labels.values[k][masks[-1]] == len(masks)).all()  # the last object is painted on top


def test_the_plan_counts_the_forwards_the_stage_runs(run_dir):
    """S clean rows, then N reference and N patched rows, for S scenes and N objects: the rows the
    organism's first decoder layer saw while the stage ran."""
    vlm, _, _, first, _, rows = run_dir
    planned = stage.OBJECTS.plan(Planner(vlm, CONFIG, 1 << 34))
    n_scenes, n_objects = first.sizes["scene"], int((first.n_tokens > 0).sum())
    assert sum(f.rows * f.count for f in planned.forwards) == n_scenes + 2 * n_objects == sum(rows)
    assert sum(f.count for f in planned.forwards) == len(rows)
    assert max(f.rows for f in planned.forwards) <= CONFIG.batch_size and planned.kept > 0


def test_the_section_shows_the_placement_table_and_draws_both_figures(run_dir):
    _, out, _, _, again, _ = run_dir
    ctx = ReportContext("toy", "qwen2_vl", out, {}, {"objects": again}, None)
    values = stage.SECTION.values(ctx)
    stage.SECTION.draw(ctx)
    text = render(values)
    assert text.startswith("## 11. Which objects does the model count?")
    assert "figures/object_effects.png" in text and "figures/object_offset.png" in text
    assert "reference `removed`" in text and "`embed`" in text
    table = run_misses(again)
    for placement in ("centred", "edge", "intersection", "all"):
        n = int(table.n_objects.sel(group="all" if placement == "all" else f"placement:{placement}"))
        assert re.search(rf"\| {placement} +\| +{n} \|", values["placement_table"]), values["placement_table"]
    assert "| touches " in values["other_table"] and values["n_objects"] == int(table.n_objects.sel(group="all"))
    scenes = Image.open(out / "figures" / "object_effects.png")
    assert scenes.size[1] > scenes.size[0] / 3  # two rows of scenes
    assert Image.open(out / "figures" / "object_offset.png").size[0] > 0


def test_a_refused_stage_is_said_in_the_section():
    ds = xr.Dataset(attrs={"refused": "no chosen object covers an image token"})
    ctx = ReportContext("m", "mllama", Path("."), {}, {"objects": ds}, None)
    stage.SECTION.draw(ctx)  # nothing to draw, nothing written
    text = render(stage.SECTION.values(ctx))
    assert "No object effect was measured on this model's COUNTINGTRICKS scenes: no chosen object" in text
    assert "figures/" not in text
