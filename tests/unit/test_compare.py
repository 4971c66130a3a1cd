"""`countlens compare`: runs side by side on relative depth, protocol checks, missing stages.

The runs here are built on disk as `countlens discover` stores them (spec.json, report.md,
results/<stage>.nc, heads.csv), of two "models" of different depths with seeded random results, so
every number can be recomputed by hand from the run's own files (a real organism run is compared in
``tests/integration/test_compare_runs.py``).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from typer.testing import CliRunner

from countlens import results
from countlens.analysis import compare_runs
from countlens.analysis.depth import class_counts, depth_bin, falls_below, handoff, relative_depth, rises_above
from countlens.analysis.heads import CLASSES
from countlens.cli import app
from countlens.datasets.countingtricks import CASES
from countlens.errors import ConfigError, RunDirError

runner = CliRunner()
SPEC = {
    "arch": "qwen2_vl",
    "preset": "",
    "prompt": "short",
    "prompt_template": "how many {plural} are there in the image?",
    "answer_form": "{n}",
    "design": "countlens",
    "evaluate": "score",
    "parser": "countlens",
    "max_new_tokens": 8,
    "attention_at": "prompt",
    "pair_kind": "shapes",
    "tasks": ["count", "color", "shape"],
    "n_per_case": 6,
    "n_pairs": 8,
    "n_samples": 8,
    "seed": 0,
    "batch_size": 16,
    "top_k": 5,
}
CASE_NAMES = list(CASES)[:4] + ["5A", "6A", "9A", "10A"]  # two of each family's cases
COUNTS = (3, 4, 5, 6, 7)
RANKINGS = ("exact patching", "AtP", "random", "random 0", "random 1")
SIZES = np.array([0.0, 0.1, 0.25, 0.5, 1.0])
TAPS = ("vision", "projector", "llm")


def _answers(rng, n: int, cases: list[str]) -> xr.Dataset:
    count = rng.choice(COUNTS, n)
    pred = np.where(rng.random(n) < 0.6, count, count + rng.choice([-1, 1, 2], n))
    return xr.Dataset(
        {
            "correct": ("sample", pred == count),
            "count": ("sample", count),
            "pred_count": ("sample", pred),
            "parsed": ("sample", np.ones(n, bool)),
            "case": ("sample", np.array(cases)),
            "distractor": ("sample", count + rng.choice([-2, -1, 1, 2], n)),
        }
    )


def make_run(root, name: str, model: str, n_layers: int, n_heads: int = 2, seed: int = 0, **spec) -> xr.Dataset:
    """A finished run of ``model`` with ``n_layers`` × ``n_heads`` heads at ``root / name``."""
    rng = np.random.default_rng(seed)
    out = root / name
    (out / "results").mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps({**SPEC, "model": model, **spec}))
    (out / "report.md").write_text("# report\n")
    per = SPEC["n_per_case"]
    save = {"cases": _answers(rng, per * len(CASE_NAMES), [c for c in CASE_NAMES for _ in range(per)])}
    save["conflict_std"] = _answers(rng, 12, ["1A"] * 12)
    save["conflict"] = _answers(rng, 12, ["1A"] * 12)
    layers = np.arange(-1, n_layers)
    image = np.clip(1.0 - (layers + 1) / (n_layers * 0.6), 0, 1)  # falls from 1 at the embeddings
    last = 1.0 - image
    effect = np.stack([image, last, rng.random(len(layers)) * 0.1], axis=1)
    save["vap"] = xr.Dataset(
        {"effect": (("layer", "group"), effect)}, coords={"layer": layers, "group": ["image", "last", "text"]}
    )
    heads = rng.random((n_layers, n_heads))
    save["heads"] = xr.Dataset(
        {"effect": (("layer", "head"), heads)}, coords={"layer": np.arange(n_layers), "head": np.arange(n_heads)}
    )
    f = np.sort(rng.random((len(RANKINGS), len(SIZES))), axis=1)
    f[:, 0], f[:, -1] = 0.0, 1.0
    save["faithfulness"] = xr.Dataset(
        {
            "faithfulness": (("ranking", "size"), f),
            "kept_fraction": ("size", SIZES),
            "cpr": ("ranking", rng.random(len(RANKINGS))),
            "cmd": ("ranking", rng.random(len(RANKINGS))),
        },
        coords={"ranking": list(RANKINGS), "size": SIZES},
        attrs={"n_nodes": n_layers * n_heads},
    )
    n = 10
    save["attention_metrics"] = xr.Dataset(
        {m: (("layer", "sample"), rng.random((n_layers, n))) for m in ("mas", "vra", "iou", "ars")}
        | {"correct": ("sample", np.arange(n) % 3 == 0)}
        # The MAS code's raw attention sums per token set (special, system, image, text).
        | {"sets": (("layer", "sample", "set"), rng.random((n_layers, n, 4)))},
        coords={"layer": np.arange(n_layers), "set": ["special", "system", "image", "text"]},
    )
    save["probes"] = xr.Dataset({"ap50": ("tap", rng.random(3))}, coords={"tap": list(TAPS)})
    so, shape = ("scene", "object"), (6, 4)  # the objects stage: 6 scenes of 4 objects, every other answered wrong
    save["objects"] = xr.Dataset(
        {
            "effect": (so, rng.normal(2.0, 2.0, shape)),
            "exists": (so, np.ones(shape, bool)),
            "n_tokens": (so, np.ones(shape, int)),
            "placement": (so, rng.choice(["centred", "edge", "intersection"], shape)),
            "size": (so, np.ones(shape)),
            "touches": (so, np.zeros(shape, bool)),
            "clean_correct": ("scene", np.ones(6, bool)),  # not what compare reads: the run's own answers are
            "answered_right": ("scene", np.arange(6) % 2 == 0),
        }
    )
    for stage, ds in save.items():
        results.save(ds, out / "results" / f"{stage}.nc")
    rows = [
        {"head_id": f"L{la}H{h}", "layer": la, "head": h, "class": CLASSES[rng.integers(5)], "importance": heads[la, h]}
        for la in range(n_layers)
        for h in range(n_heads)
    ]
    pd.DataFrame(rows).to_csv(out / "heads.csv", index=False)
    return out


@pytest.fixture
def two_runs(tmp_path):
    return [make_run(tmp_path, "a", "small-model", 4, seed=1), make_run(tmp_path, "b", "deep-model", 10, seed=2)]


# The relative-depth hand-off, by hand.


def test_relative_depth_puts_the_embeddings_and_the_first_layer_at_zero():
    assert relative_depth(np.array([-1, 0, 2, 4]), 5).tolist() == [0.0, 0.0, 0.5, 1.0]
    assert relative_depth(3, 7) == 0.5 and relative_depth(0, 1) == 0.0
    # 3/5 is 0.6 a hair below in floating point: still bin 3 of 5; depth 1 is in the last bin.
    assert depth_bin(np.array([0.0, 0.2, 3 / 5, 0.8, 1.0])).tolist() == [0, 1, 3, 4, 4]


def test_handoff_on_a_constructed_curve():
    # 5 layers: depths 0, 0.25, 0.5, 0.75, 1; the embeddings (layer −1) at 0 too.
    d = relative_depth(np.arange(-1, 5), 5)
    image = [1.0, 0.9, 0.7, 0.3, 0.1, 0.0]
    last = [0.0, 0.1, 0.2, 0.4, 0.8, 1.0]
    # image: last point ≥ 0.5 is layer 1 (0.7 at 0.25), then 0.3 at 0.5: 0.25 + 0.2 / 0.4 · 0.25
    assert falls_below(d, image) == pytest.approx(0.375)
    # last: first point ≥ 0.5 is layer 3 (0.8 at 0.75), after 0.4 at 0.5: 0.5 + 0.1 / 0.4 · 0.25
    assert rises_above(d, last) == pytest.approx(0.5625)
    # The image curve rising again past 0.5 moves its hand-off to the last crossing.
    assert falls_below(d, [1.0, 0.2, 0.6, 0.7, 0.2, 0.0]) == pytest.approx(0.5 + 0.2 / 0.5 * 0.25)
    # Between the embeddings and layer 0 (both at depth 0): the hand-off is at 0.
    assert falls_below(d, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]) == 0.0
    assert math.isnan(falls_below(d, [0.4] * 6)) and math.isnan(falls_below(d, [0.9] * 6))
    assert math.isnan(rises_above(d, [0.4] * 6)) and rises_above(d, [0.6] * 6) == 0.0
    vap = xr.Dataset(
        {"effect": (("layer", "group"), np.array([image, last]).T)},
        coords={"layer": np.arange(-1, 5), "group": ["image", "last"]},
    )
    assert handoff(vap, 5) == pytest.approx({"image_below": 0.375, "last_above": 0.5625})


def test_class_counts_per_depth_bin():
    table = pd.DataFrame(
        {
            "layer": [0, 0, 1, 3, 5, 5],
            "head": [0, 1, 0, 0, 0, 1],
            "class": ["visual grounding", "other", "visual grounding", "cross-modal routing", "other", "other"],
            "importance": [0.1] * 6,
        }
    )
    counts = class_counts(table, 6)  # depths 0, 0, 0.2, 0.6, 1, 1
    assert counts.loc["0.0–0.2", "visual grounding"] == 1 and counts.loc["0.0–0.2", "other"] == 1
    assert counts.loc["0.2–0.4", "visual grounding"] == 1 and counts.loc["0.6–0.8", "cross-modal routing"] == 1
    assert counts.loc["0.8–1.0", "other"] == 2 and counts.to_numpy().sum() == 6


# The tables: every number recomputed from the run's own files.


def _load(run, stage):
    return results.load(run / "results" / f"{stage}.nc")


def test_every_number_equals_its_runs_own_results(two_runs, tmp_path):
    out = tmp_path / "cmp"
    md = compare_runs(two_runs, out).read_text()
    acc = pd.read_csv(out / "accuracy.csv", index_col=0)
    counting = pd.read_csv(out / "counting.csv", index_col=0)
    hand = pd.read_csv(out / "handoff.csv", index_col=0)
    mas = pd.read_csv(out / "mas.csv", index_col=0)
    probes = pd.read_csv(out / "probes.csv", index_col=0)
    faith = pd.read_csv(out / "faithfulness.csv")
    classes = pd.read_csv(out / "head_classes.csv")
    top = pd.read_csv(out / "top_heads.csv")
    placement = pd.read_csv(out / "placement.csv")
    assert list(acc.index) == ["small-model", "deep-model"]
    assert list(acc.columns[: len(CASE_NAMES)]) == CASE_NAMES  # the design's order
    for run, model in zip(two_runs, acc.index):
        cases = _load(run, "cases")
        correct, case = cases.correct.values.astype(float), cases.case.values.astype(str)
        by_case = {c: correct[case == c].mean() for c in CASE_NAMES}
        for c in CASE_NAMES:
            assert acc.loc[model, c] == pytest.approx(by_case[c])
        for fam in ("position", "dilation", "adjacency"):
            mean = np.mean([by_case[c] for c in CASE_NAMES if CASES[c].family == fam])
            assert acc.loc[model, f"mean ({fam})"] == pytest.approx(mean)
        assert acc.loc[model, "mean (all)"] == pytest.approx(np.mean(list(by_case.values())))
        assert counting.loc[model, "accuracy"] == pytest.approx(correct.mean())
        per_count = [correct[cases["count"].values == n].mean() for n in COUNTS]
        r = np.corrcoef(COUNTS, per_count)[0, 1]
        assert counting.loc[model, "number-avoidance r"] == pytest.approx(r)
        std, conflict = _load(run, "conflict_std"), _load(run, "conflict")
        assert counting.loc[model, "DiC drop"] == pytest.approx(
            std.correct.values.mean() - conflict.correct.values.mean()
        )
        repeated = conflict.pred_count.values == conflict.distractor.values
        assert counting.loc[model, "DiC distractor share"] == pytest.approx(repeated.mean())
        # Hand-off: the constructed image curve is 1 − (ℓ + 1) / (0.6 L) until it is clipped at 0, so it
        # crosses 0.5 at ℓ = 0.3 L − 1 (linear there, so interpolation is exact); the last token is 1 − image.
        n_layers = _load(run, "heads").sizes["layer"]
        assert hand.loc[model, "layers"] == n_layers
        crossing = (0.3 * n_layers - 1) / (n_layers - 1)
        assert hand.loc[model, "image effect < 0.5 (depth)"] == pytest.approx(crossing)
        assert hand.loc[model, "last-token effect ≥ 0.5 (depth)"] == pytest.approx(crossing)
        am = _load(run, "attention_metrics")
        per_sample = am.mas.values.mean(0)
        right = am.correct.values.astype(bool)
        assert mas.loc[model, "MAS (all)"] == pytest.approx(per_sample.mean())
        assert mas.loc[model, "MAS (correct)"] == pytest.approx(per_sample[right].mean())
        assert mas.loc[model, "MAS (wrong)"] == pytest.approx(per_sample[~right].mean())
        # The MAS code's reduction, by hand: mean sums over samples, each layer's renormalised, mean over layers.
        sums = am.sets.transpose("sample", "layer", "set").values.mean(0)
        shares = (sums / sums.sum(-1, keepdims=True)).mean(0)
        for name, share in zip(am.set.values, shares):
            assert mas.loc[model, f"{name} share (MAS code)"] == pytest.approx(share)
        assert probes.loc[model].to_dict() == pytest.approx(dict(zip(TAPS, _load(run, "probes").ap50.values)))
        # Object placement, by hand: the mean effect per class; on the scenes answered wrong, the object
        # with the least effect is missed, its class's rate = missed / that class's objects there.
        obj = _load(run, "objects")
        effect, where = obj.effect.values, obj.placement.values
        wrong = ~obj.answered_right.values
        missed = wrong[:, None] & (effect == effect.min(1, keepdims=True))
        mine = placement[placement.model == model].set_index("placement")
        assert list(mine.index) == ["centred", "edge", "intersection", "all"]
        for c in ("centred", "edge", "intersection"):
            assert mine.loc[c, "mean effect"] == pytest.approx(effect[where == c].mean())
            in_wrong = wrong[:, None] & (where == c)
            assert mine.loc[c, "objects in wrong scenes"] == in_wrong.sum()
            assert mine.loc[c, "missed"] == (missed & (where == c)).sum()
        assert mine.loc["all", "mean effect"] == pytest.approx(effect.mean()) and mine.loc["all", "missed"] == 3
        ds = _load(run, "faithfulness")
        mine = faith[faith.model == model].set_index("ranking")
        assert list(mine.index) == ["exact patching", "AtP", "random"]  # the draws as their mean only
        for name in mine.index:
            f = ds.faithfulness.sel(ranking=name).values
            smallest = SIZES[f >= 0.8].min()
            assert mine.loc[name, "CPR"] == pytest.approx(float(ds.cpr.sel(ranking=name)))
            assert mine.loc[name, "CMD"] == pytest.approx(float(ds.cmd.sel(ranking=name)))
            assert mine.loc[name, "smallest f ≥ 0.8 (fraction)"] == pytest.approx(smallest)
            assert mine.loc[name, "smallest f ≥ 0.8 (heads)"] == round(smallest * ds.attrs["n_nodes"])
        table = pd.read_csv(run / "heads.csv")
        bins = np.minimum((table.layer / (n_layers - 1) * 5 + 1e-9).astype(int), 4)
        mine = classes[classes.model == model].reset_index(drop=True)
        for b in range(5):
            for name in CLASSES:
                assert mine.loc[b, name] == ((bins == b) & (table["class"] == name)).sum()
            best = table[bins == b].sort_values("importance", ascending=False).head(3)
            shown = top[(top.model == model) & (top["rank"] <= 3) & (top["bin"] == mine.loc[b, "depth"])]
            assert shown["head"].tolist() == best["head_id"].tolist()
            assert shown["importance"].to_numpy() == pytest.approx(best["importance"].to_numpy())
    assert (out / "figures" / "handoff.png").exists() and (out / "figures" / "head_classes.png").exists()
    assert "share one protocol" in md and "Missing results" not in md
    sections = ("COUNTINGTRICKS accuracy", "hand-off on relative depth", "Head classes", "Faithfulness", "MAS")
    for section in (*sections, "Detection probes", "Which objects does the model count?"):
        assert section in md
    assert "| small-model / centred " in md and "| deep-model / all " in md
    # compare.html: compare.md as one page that loads nothing, both figures embedded where they stand.
    page = (out / "compare.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    figures = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,', page)
    assert figures == ["VAP effect over relative depth", "head classes by relative depth"]
    assert page.count("<table>") == len(re.findall(r"(?m)^\|[\s:|-]+\|$", md)) > 5 and "Not embedded" not in page
    for section in (*sections, "Detection probes"):
        assert section in page


# Protocols, missing stages and paths that are no finished run.


def test_mixed_protocols_are_refused_unless_allowed(tmp_path):
    runs = [make_run(tmp_path, "a", "m1", 4), make_run(tmp_path, "b", "m2", 6, prompt="std", n_pairs=64)]
    with pytest.raises(ConfigError) as err:
        compare_runs(runs, tmp_path / "cmp")
    text = str(err.value)
    assert "prompt: m1 = 'short', m2 = 'std'" in text and "n_pairs: m1 = 8, m2 = 64" in text
    assert "--allow-mixed" in text and not (tmp_path / "cmp").exists()
    md = compare_runs(runs, tmp_path / "cmp", allow_mixed=True).read_text()
    assert "differ in protocol" in md and "- prompt: m1 = 'short', m2 = 'std'" in md
    protocol = pd.read_csv(tmp_path / "cmp" / "protocol.csv", index_col=0)
    assert protocol.loc["n_pairs"].tolist() == ["8", "64"]


def test_a_missing_stage_leaves_empty_cells_and_a_note(two_runs, tmp_path):
    for stage in ("conflict", "faithfulness", "attention_metrics", "probes", "objects"):
        (two_runs[1] / "results" / f"{stage}.nc").unlink()
    md = compare_runs(two_runs, tmp_path / "cmp").read_text()
    counting = pd.read_csv(tmp_path / "cmp" / "counting.csv", index_col=0)
    assert counting.loc["deep-model", ["DiC drop", "DiC distractor share"]].isna().all()
    assert counting.loc["small-model", ["DiC drop"]].notna().all() and counting["accuracy"].notna().all()
    assert set(pd.read_csv(tmp_path / "cmp" / "faithfulness.csv").model) == {"small-model"}
    assert pd.read_csv(tmp_path / "cmp" / "mas.csv", index_col=0).loc["deep-model"].isna().all()
    assert "Missing results" in md
    assert pd.read_csv(tmp_path / "cmp" / "probes.csv", index_col=0).loc["deep-model"].isna().all()
    notes = (("conflict", "Digit-in-Conflict"), ("faithfulness", "faithfulness"), ("attention_metrics", "MAS"))
    notes += (("probes", "probe AP"), ("objects", "object-placement"))
    placement = pd.read_csv(tmp_path / "cmp" / "placement.csv")
    assert placement[placement.model == "deep-model"].placement.tolist() == ["not run"]
    assert "| deep-model / not run " in md and "| small-model / edge " in md
    for stage, what in notes:
        assert f"deep-model has no results/{stage}.nc ({two_runs[1]}): its {what} cells are empty" in md


def test_a_path_that_is_no_finished_run_is_refused_by_name(two_runs, tmp_path):
    unfinished = make_run(tmp_path, "c", "m3", 4)
    (unfinished / "report.md").unlink()
    for bad, why in (
        (tmp_path / "nowhere", "is not a directory"),
        (tmp_path, "no spec.json"),
        (unfinished, "is not a finished run (no report.md"),
    ):
        with pytest.raises(RunDirError, match=re.escape(why)) as err:
            compare_runs([two_runs[0], bad], tmp_path / "cmp")
        assert str(bad) in str(err.value)
    with pytest.raises(ConfigError, match="more than once"):
        compare_runs([two_runs[0], two_runs[0]], tmp_path / "cmp")
    with pytest.raises(ConfigError, match="a run is never written into"):
        compare_runs(two_runs, two_runs[0])
    assert not (tmp_path / "cmp").exists()


def test_the_command(two_runs, tmp_path):
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", *map(str, two_runs), "--out", str(out), "--top-k", "2"])
    assert result.exit_code == 0, result.output
    assert f"comparison: {out / 'compare.md'}" in result.output
    assert pd.read_csv(out / "top_heads.csv").groupby(["model", "bin"]).size().max() == 2
    other = make_run(tmp_path, "c", "m3", 4, design="paper-code")
    refused = runner.invoke(app, ["compare", str(two_runs[0]), str(other), "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2 and refused.output.startswith("error: the runs differ in protocol")
    assert "design: small-model = 'countlens', m3 = 'paper-code'" in refused.output
    assert refused.output.strip().count("\n") == 0 and not (tmp_path / "x").exists()


def test_two_runs_of_one_model_are_told_apart_by_folder(tmp_path):
    runs = [make_run(tmp_path, "first", "same", 4, seed=1), make_run(tmp_path, "second", "same", 4, seed=2)]
    compare_runs(runs, tmp_path / "cmp")
    assert pd.read_csv(tmp_path / "cmp" / "accuracy.csv", index_col=0).index.tolist() == [
        "same (first)",
        "same (second)",
    ]


def test_a_checkpoint_path_or_hub_id_is_labelled_by_its_last_part(tmp_path):
    runs = [make_run(tmp_path, "a", "/data/models/Qwen2.5-VL-7B-Instruct/", 4), make_run(tmp_path, "b", "org/m2", 6)]
    runs.append(make_run(tmp_path, "c", "/elsewhere/Qwen2.5-VL-7B-Instruct", 4, seed=3))
    compare_runs(runs, tmp_path / "cmp")
    labels = pd.read_csv(tmp_path / "cmp" / "accuracy.csv", index_col=0).index.tolist()
    assert labels == ["Qwen2.5-VL-7B-Instruct (a)", "m2", "Qwen2.5-VL-7B-Instruct (c)"]
