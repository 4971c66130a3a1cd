"""The main job end to end on the organism, at toy sizes: every stage, the report, resume, errors."""

from __future__ import annotations

import pandas as pd
import pytest
import xarray as xr
from benchmark_files import mathvista_copy, mmmu_copy, mmmu_rows, realworldqa_copy
from shared_run import TOY_RUN
from tolerance import assert_effect, logit_scale
from typer.testing import CliRunner

import countlens
from countlens.circuits.methods.patching import prepare_pairs
from countlens.cli import app
from countlens.datasets.pairs import count_pairs

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m 'not slow'` leaves it out of the inner loop

runner = CliRunner()
SMALL = ["--n-per-case", "1", "--n-pairs", "4", "--n-samples", "4", "--batch-size", "8"]


def test_discover_writes_a_report_and_resumes(tmp_path, toy_run_copy):
    refused = runner.invoke(app, ["discover", *TOY_RUN, "--out", str(tmp_path / "new"), "--seed", "-1"])
    assert refused.exit_code == 2 and not (tmp_path / "new").exists(), refused.output  # nothing to block a rerun
    out = toy_run_copy  # the shared run (conftest.py), made by the same command
    report, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "Warning" not in report  # the organism answers its own prompt
    for section in (
        "COUNTINGTRICKS",
        "visual activation patching",
        "Logit lens",
        "Head classes",
        "Head temperature",
        "Is it a circuit?",
        "EAP-IG",
        "Which objects does the model count?",
    ):
        assert section in report
    # The objects section's panels: the scenes outlined by effect and the effect against the offset, in the page too.
    assert '<img alt="object effects"' in page and '<img alt="object effect against offset"' in page
    assert "| centred " in report.split("Which objects does the model count?")[1]
    assert len(list((out / "figures").glob("*.png"))) >= 7 and (out / "figures" / "faithfulness.png").exists()
    faith = xr.open_dataset(out / "results" / "faithfulness.nc")
    assert {"exact patching", "AtP", "EAP-IG", "mean-ablation drop", "AtP*", "random"} <= set(faith.ranking.values)
    assert (faith.atp_star_effect >= 0).all()  # AtP*'s scores are magnitudes
    edges = xr.open_dataset(out / "results" / "edge_faithfulness.nc")
    assert {"EAP-IG edges", "EAP edges", "random"} <= set(edges.ranking.values) and edges.attrs["level"] == "edge"
    assert "Circuits of edges." in report and (out / "figures" / "edge_faithfulness.png").exists()
    # The end points are set by definition, not divided out (every node kept is the clean run, none kept
    # the fully ablated one; 0.001 of 24 heads keeps none): exactly 1 and 0 on any CPU's kernels.
    assert (faith.faithfulness.sel(size=1.0) == 1).all() and (faith.faithfulness.sel(size=0.001) == 0).all()
    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == 24 and set(heads["class"]) <= {
        "visual grounding",
        "cross-modal routing",
        "counting aggregation",
        "awareness",
        "other",
    }
    # The spec names the prompt that ran, not "auto", so a re-rendered report says it too.
    import json

    assert json.loads((out / "spec.json").read_text())["prompt"] == "short"
    assert runner.invoke(app, ["report", "--run", str(out)]).exit_code == 0
    assert "Prompt style: `short`" in (out / "report.md").read_text()
    assert (out / "report.md").read_text() == report  # re-rendered from results/ and heads.csv, byte for byte
    assert (out / "report.html").read_text() == page  # the page too: heads.csv's numbers, not discover's float32
    # A second run loads every stage instead of recomputing it.
    (out / "results" / "lens.nc").unlink()
    again = runner.invoke(app, ["discover", *TOY_RUN, "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert "[lens] running" in again.output and "[vap] done before" in again.output
    # Other settings in the same directory are refused.
    other = runner.invoke(app, ["discover", "--model", "toy", "--out", str(out), "--n-pairs", "5", "--n-per-case", "1"])
    assert other.exit_code == 2 and "different spec" in other.output


def _fsc147_fixture(root, splits=(("test", 3),)):
    """An FSC-147 layout made of COUNTINGTRICKS scenes (points = object centres), ``n`` images per split."""
    import json

    from countlens.datasets.countingtricks import trick_sample

    (root / "images_384_VarV2").mkdir(parents=True)
    ann, names = {}, {"train": [], "val": [], "test": []}
    for split, n in splits:
        for _ in range(n):
            s = trick_sample("4A", 0, len(ann), image_size=192, patch_size=16)
            s.image.save(root / "images_384_VarV2" / f"{len(ann)}.jpg")
            names[split].append(f"{len(ann)}.jpg")
            ann[f"{len(ann)}.jpg"] = {"points": [[o.cx, o.cy] for o in s.scene.objects], "box_examples_coordinates": []}
    (root / "annotation_FSC147_384.json").write_text(json.dumps(ann))
    (root / "Train_Test_Val_FSC_147.json").write_text(json.dumps(names))


def _pixmo_fixture(path):
    """A three-image PixMo-Count JSONL file made of task scenes."""
    import json

    from countlens.datasets.tasks import task_samples

    lines = []
    for i, s in enumerate(task_samples("count", 3, seed=11, image_size=192)):
        s.image.save(path.parent / f"p{i}.png")
        lines.append(json.dumps({"image": f"p{i}.png", "count": s.meta["count"], "label": "shapes"}))
    path.write_text("\n".join(lines) + "\n")


def test_finetune_adds_the_before_after_table(tmp_path, toy_run_copy, monkeypatch):
    out = toy_run_copy
    _fsc147_fixture(tmp_path / "fsc")
    refused = runner.invoke(app, ["finetune", "--circuit", str(out), "--lr", "-1e-3", "--steps", "2"])
    assert refused.exit_code == 2 and not (out / "finetune").exists(), refused.output  # the rerun below is not blocked
    result = runner.invoke(
        app,
        [
            "finetune",
            "--circuit",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--n-train",
            "16",
            "--n-eval",
            "16",
            "--fsc147",
            str(tmp_path / "fsc"),
        ],
    )
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "finetune" / "before_after.csv", index_col=0)
    assert list(table.index) == ["baseline", "+SFT", "+SFT+focus", "+SFT+focus+temperature", "+SFT+focus+MAS"]
    assert "FSC-Test" in table.columns and table["FSC-Test"].between(0, 1).all()
    # Counting sets carry their MAE beside the accuracy; colour and shape questions have none.
    assert {"count (in-dist.) MAE", "tricks adjacency MAE", "FSC-Test MAE"} <= set(table.columns)
    assert "color MAE" not in table.columns and (table["count (in-dist.) MAE"] >= 0).all()
    assert "PixMo-Count" not in table.columns and "PixMo-Count" not in result.output  # no copy, no column
    assert "Circuit-guided fine-tune" in (out / "report.md").read_text()
    assert "Circuit-guided fine-tune" in (out / "report.html").read_text()  # the page shows it too
    # A rerun (a resume after a kill) neither retrains nor re-evaluates a finished row.
    from countlens.pipeline import finetune_job as before_after_module

    calls = []
    real = before_after_module.evaluation_metrics
    monkeypatch.setattr(before_after_module, "evaluation_metrics", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = runner.invoke(
        app,
        [
            "finetune",
            "--circuit",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--n-train",
            "16",
            "--n-eval",
            "16",
            "--fsc147",
            str(tmp_path / "fsc"),
        ],
    )
    assert again.exit_code == 0 and again.output.count("done before") == 3 and calls == [], again.output
    assert pd.read_csv(out / "finetune" / "before_after.csv", index_col=0).equals(table)  # the file, read back
    # Re-rendering the report from results/ keeps the fine-tune section.
    assert runner.invoke(app, ["report", "--run", str(out)]).exit_code == 0
    assert (out / "report.md").read_text().count("Circuit-guided fine-tune") == 1


def test_finetune_presets_run_each_papers_recipe(tmp_path, undrawn_report):
    """Each preset end to end on the organism: discover, then the fine-tune. counting-circuits: Baseline /
    +SFT / +SFT+focus / Full on SynDot + SynPoly scenes, with SynReal and PixMo-Count accuracy and MAE;
    counting-to-four: SFT against SFT+MAS on FSC-147's train split (the fixtures' small copies)."""
    import json

    run, run4 = tmp_path / "run", tmp_path / "run4"  # each paper's discover on the organism, at toy sizes
    # counting-to-four's run reads its answers by generation, as the papers do (--evaluate generate).
    for preset, out, extra in (("counting-circuits", run, []), ("counting-to-four", run4, ["--evaluate", "generate"])):
        found = runner.invoke(
            app, ["discover", "--model", "toy", "--preset", preset, "--out", str(out), *SMALL, *extra]
        )
        assert found.exit_code == 0, found.output
        assert f"Preset `{preset}`" in (out / "report.md").read_text()
    from countlens import results

    generated = results.load(run4 / "results" / "cases.nc")
    assert "text" in generated and generated.parsed.dtype == bool  # generate's result, not score's
    assert "of them hold no count" in (run4 / "report.md").read_text()
    # counting-to-four follows the paper's code: its 18 cases, attention at the last generation step with
    # the code's 4-way share, VRA and ARS beside countlens's.
    report4 = (run4 / "report.md").read_text()
    assert "18 red-circle cases" in report4 and "As the MAS paper's code reads them" in report4
    assert "last generation step" in report4 and "As the MAS paper's code" not in (run / "report.md").read_text()
    probes = results.load(run4 / "results" / "probes.nc")  # the code's probes on its three taps
    assert probes.attrs["recipe"] == "counting-to-four" and probes.sizes["tap"] == 3
    assert "Detection probes as the MAS paper's code trains them" in report4
    # The organism cannot write Pstd's "circle: 7" answers: the report says its numbers measure nothing.
    assert "the model does not answer this prompt" in (run / "report.md").read_text().split("## 1.")[0]
    # Counting Circuits' overlap: count against math, spatial and colour, a 4 × 4 Jaccard matrix.
    ablation = results.load(run / "results" / "ablation.nc")
    assert list(ablation.task.values) == ["count", "math", "spatial", "color"]
    section = (run / "report.md").read_text().split("## 8.")[1].split("## 9.")[0]
    assert all(f"| {t} " in section for t in ablation.task.values) and "procedural stand-in" in section
    _fsc147_fixture(tmp_path / "fsc", splits=(("train", 4), ("val", 2), ("test", 2)))
    _pixmo_fixture(tmp_path / "pixmo.jsonl")
    tiny = ["--n-train", "4", "--n-eval", "4"]
    # The general-reasoning columns from local copies in the benchmarks' layouts; a broken row is refused
    # before anything is written.
    benchmarks = [
        "--mmmu",
        str(mmmu_copy(tmp_path)),
        "--realworldqa",
        str(realworldqa_copy(tmp_path)),
        "--mathvista",
        str(mathvista_copy(tmp_path)),
    ]
    rows = mmmu_rows("Math")
    rows[1]["image_1"] = None
    broken = mmmu_copy(tmp_path / "broken", {"Math": rows})
    refused = runner.invoke(
        app,
        [
            "finetune",
            "--circuit",
            str(run),
            "--preset",
            "counting-circuits",
            "--out",
            str(tmp_path / "b"),
            "--mmmu",
            str(broken),
            *tiny,
        ],
    )
    assert refused.exit_code == 2 and "row 1: the question shows <image 1>" in refused.output, refused.output
    assert not (tmp_path / "b").exists()
    cc = runner.invoke(
        app,
        [
            "finetune",
            "--circuit",
            str(run),
            "--preset",
            "counting-circuits",
            "--out",
            str(tmp_path / "cc"),
            "--pixmo",
            str(tmp_path / "pixmo.jsonl"),
            *benchmarks,
            *tiny,
        ],
    )
    assert cc.exit_code == 0, cc.output
    table = pd.read_csv(tmp_path / "cc" / "before_after.csv", index_col=0)
    assert list(table.index) == ["baseline", "+SFT", "+SFT+focus", "+SFT+focus+temperature"]
    reasoning = {f"{b}{part}" for b in ("MMMU", "RealWorldQA", "MathVista") for part in ("", " options", " unparsed")}
    assert {"SynReal", "SynReal MAE", "PixMo-Count", "PixMo-Count MAE", "color", "shape"} | reasoning == set(
        table.columns
    )
    # The organism cannot write MMMU's and RealWorldQA's option letters: those options cells are blank, and
    # the note says why; MathVista's options (numbers) are scored.
    blank = ["MMMU options", "RealWorldQA options"]
    filled = table[sorted(reasoning - set(blank))]
    assert ((filled >= 0) & (filled <= 1)).all().all() and table[blank].isna().all().all()
    note = (tmp_path / "cc" / "before_after.md").read_text()
    assert "MMMU 54.89 → 56.33" in note and "{'MMMU': 1, 'RealWorldQA': 1, 'MathVista': 1}" in note
    assert 'An options cell "—"' in note and "| — " in note and "nan" not in note
    assert "MMMU: 1 questions with several images left out" in cc.output
    spec = json.loads((tmp_path / "cc" / "sft_focus" / "finetune.json").read_text())
    # The paper's recipe; 2 epochs of 4 scenes at batch 2 = 4 steps.
    assert {k: spec[k] for k in ("lora_r", "lr", "batch_size", "warmup", "focus", "ce_on", "steps", "samples")} == {
        "lora_r": 64,
        "lr": 2e-5,
        "batch_size": 2,
        "warmup": 0.03,
        "focus": 1.0,
        "ce_on": "digits",
        "steps": 4,
        "samples": 4,
    }
    assert "preset `counting-circuits`" in (tmp_path / "cc" / "before_after.md").read_text()
    c4 = runner.invoke(
        app,
        [
            "finetune",
            "--circuit",
            str(run4),
            "--preset",
            "counting-to-four",
            "--out",
            str(tmp_path / "c4"),
            "--fsc147",
            str(tmp_path / "fsc"),
            "--epochs",
            "1",
            *tiny,
        ],
    )
    assert c4.exit_code == 0, c4.output
    table = pd.read_csv(tmp_path / "c4" / "before_after.csv", index_col=0)
    assert list(table.index) == ["baseline", "+SFT", "+SFT+MAS"]
    assert list(table.columns) == [
        "Circles (Syn)",
        "Circles (Syn) MAE",
        "FSC-Val",
        "FSC-Val MAE",
        "FSC-Test",
        "FSC-Test MAE",
    ]
    spec = json.loads((tmp_path / "c4" / "sft_mas" / "finetune.json").read_text())
    assert (spec["mas"], spec["tau"], spec["focus"], spec["samples"], spec["target_layers"]) == (
        0.1,
        0.4,
        0.0,
        4,
        list(range(6)),
    )
    # The code's recipe: the whole language model at lr 1e-5, its MAS reduction (wrong answers only).
    assert (spec["method"], spec["lr"], spec["mas_reduce"], spec["grad_accum"]) == ("full", 1e-5, "paper", 32)
    assert (tmp_path / "c4" / "sft_mas" / "adapter" / "full_finetune.json").exists()
    missing = runner.invoke(
        app, ["finetune", "--circuit", str(run), "--preset", "counting-to-four", "--out", str(tmp_path / "none")]
    )
    assert missing.exit_code == 2 and "--fsc147" in missing.output and not (tmp_path / "none").exists()


def test_bad_arguments_exit_2_and_write_nothing(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for args, message in (
        (["discover", "--model", "nope/none", "--out", str(tmp_path / "a")], "nope/none"),
        (["discover", "--out", str(f)], "is a file"),
        (["discover", "--out", str(tmp_path / "b"), "--prompt", "loud"], "--prompt"),
        (["finetune", "--circuit", str(tmp_path / "missing")], "heads.csv is missing"),
        (["finetune", "--circuit", str(tmp_path), "--layers", "x"], "heads.csv"),
        (["finetune", "--circuit", str(tmp_path), "--steps", "3", "--epochs", "1"], "give one of them"),
        (["finetune", "--circuit", str(tmp_path), "--preset", "counting-to-five"], "unknown preset"),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_discover_presets_set_the_papers_protocol(tmp_path, tiny_checkpoint, undrawn_report):
    """Each preset end to end at small sizes (the flags override its sizes), on the real Qwen
    vocabulary, since both presets ask the Pstd prompt; spec and report name what the preset set.
    Qwen writes "12" as "1", "2": every stage must take multi-token answers ("circle: 12"), so the
    first run draws 10 scenes per case (counts 3 … 12)."""
    import json

    from countlens import results

    model = tiny_checkpoint("qwen2_5_vl", image_side=128)  # a 16×16 patch grid: every case fits 3 … 9+
    sizes = ["--n-pairs", "4", "--n-samples", "4", "--batch-size", "16"]
    small = ["--n-per-case", "2", *sizes]
    out = tmp_path / "circuits"
    result = runner.invoke(
        app,
        [
            "discover",
            "--model",
            str(model),
            "--out",
            str(out),
            "--preset",
            "counting-circuits",
            "--n-per-case",
            "10",
            *sizes,
        ],
    )
    assert result.exit_code == 0, result.output
    cases = results.load(out / "results" / "cases.nc")
    assert cases.attrs["method"] == "candidate scoring"
    assert {10, 11, 12} <= set(cases["count"].values.tolist()) and cases.gold.values[0].startswith("circle: ")
    vap = results.load(out / "results" / "vap.nc")
    # Patching every image embedding is the whole effect, up to rounding over this effect's denominator;
    # the logits' size, which that rounding scales with, read on pairs like the run's.
    vlm = countlens.load(model)
    pairs = count_pairs(4, kind="dots+polygons", image_size=128, prompt="std", seed=0)
    scale = logit_scale(vlm, prepare_pairs(vlm, pairs))
    assert_effect(
        vap.effect.sel(layer=-1, group="image"),
        1.0,
        clean=vap.clean_logit_diff,
        corrupt=vap.corrupt_logit_diff,
        scale=scale,
    )
    assert "Prompt style: `std`" in (out / "report.md").read_text()
    spec = json.loads((out / "spec.json").read_text())
    assert (spec["preset"], spec["pair_kind"], spec["jaccard_k"], spec["n_pairs"]) == (
        "counting-circuits",
        "dots+polygons",
        20,
        4,
    )
    report = (out / "report.md").read_text()
    assert "Preset `counting-circuits`" in report and "routing_from = 0.6" in report
    # The preset's top-20 sets on a model of 8 heads: every head, and the report says so.
    assert "Top-8 heads by drop in log p(gold) (the run asks for the top 20, but the model has 8 heads" in report
    assert "Overwrite rate" in report
    heads = pd.read_csv(out / "heads.csv")
    assert {"alignment", "difficulty", "ablation_drop"} <= set(heads.columns)
    assert heads["alignment"].between(0, 1).all()
    out4 = tmp_path / "four"
    result = runner.invoke(
        app, ["discover", "--model", str(model), "--out", str(out4), "--preset", "counting-to-four", *small]
    )
    assert result.exit_code == 0, result.output
    spec = json.loads((out4 / "spec.json").read_text())
    assert (spec["preset"], spec["n_per_case"], spec["prompt"]) == ("counting-to-four", 2, "std")
    report = (out4 / "report.md").read_text()  # the paper's accuracy, MAE and count-vs-accuracy r
    assert "over all cases, accuracy **" in report and "MAE" in report and "Pearson r between the count" in report
    bad = runner.invoke(app, ["discover", "--model", str(model), "--out", str(tmp_path / "x"), "--preset", "nope"])
    assert bad.exit_code == 2 and "unknown preset" in bad.output and not (tmp_path / "x").exists()
