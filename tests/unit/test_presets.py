"""Presets: their values are the papers' numbers, and the counting-circuits bands class the paper's
own heads (on a 28-layer layout) as the paper does, where countlens's defaults cannot."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from countlens.analysis.heads import HeadThresholds, classify_heads
from countlens.errors import ConfigError, RunDirError
from countlens.pipeline import presets
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.discover import check_preset


def test_preset_values_are_the_papers():
    cc = presets.discover_config("counting-circuits")
    assert (cc.pair_kind, cc.prompt, cc.jaccard_k, cc.preset) == ("dots+polygons", "std", 20, "counting-circuits")
    c4 = presets.discover_config("counting-to-four")
    # The code's evaluation scripts: 100 greedy new tokens, read by their own parser (with --evaluate generate).
    assert (c4.n_per_case, c4.prompt, c4.max_new_tokens, c4.parser, c4.design) == (
        200,
        "std",
        100,
        "paper-code",
        "paper-code",
    )
    t = presets.thresholds("counting-circuits")
    assert (t.early, t.routing_from, t.routing_to, t.late, t.align_min, t.difficulty_min) == (
        0.1,
        0.6,
        0.9,
        0.8,
        0.5,
        0.1,
    )
    assert presets.thresholds("") == HeadThresholds()
    for p in presets.PRESETS.values():  # every value a preset sets says where it comes from
        assert set(p.discover) | set(p.thresholds) | set(p.probe) <= set(p.sources)
        assert set(p.finetune.config) <= set(p.finetune.sources)


def test_finetune_recipes_are_the_papers():
    from countlens.pipeline.finetune_job import VARIANTS, recipe_config

    cc = presets.recipe("counting-circuits")  # paper 002, Training and the ablation table
    config = recipe_config(cc, cc.n_train)
    assert (config.lora_r, config.lr, config.batch_size, config.warmup, config.sigma) == (64, 2e-5, 2, 0.03, 1.0)
    assert (cc.epochs, cc.n_train, cc.training) == (2, 8000, "syn") and config.steps == 8000  # 2 × 8000 / 2
    assert cc.rows == ("+SFT", "+SFT+focus", "+SFT+focus+temperature")
    assert VARIANTS["+SFT+focus"] == {"focus": 1.0, "mas": 0.0}  # λ = 1.0
    assert {"SynReal", "PixMo-Count"} <= set(cc.evaluation)
    assert set(cc.temperature_classes) == {"cross-modal routing", "counting aggregation"}
    c4 = presets.recipe("counting-to-four")  # paper 000, Method steps (4) and Table 4
    config = recipe_config(c4, 3659)  # FSC-147's train split
    assert (config.tau, c4.epochs, c4.training, c4.n_train) == (0.4, 10, "fsc147", None)
    # The code's script: batch 2 × accumulation 32, AdamW weight decay 0.1, 3 % warm-up, cosine, clip 1.0,
    # and its MAS reduction (mean before the hinge, wrong answers only).
    assert config.steps == -(-10 * 3659 // (2 * 32)) == 572
    assert (config.weight_decay, config.warmup, config.schedule, config.max_grad_norm, config.mas_reduce) == (
        0.1,
        0.03,
        "cosine",
        1.0,
        "paper",
    )
    assert c4.rows == ("+SFT", "+SFT+MAS") and VARIANTS["+SFT+MAS"] == {"focus": 0.0, "mas": 0.1}
    assert c4.evaluation == ("Circles (Syn)", "FSC-Val", "FSC-Test")
    assert presets.recipe("") == presets.DEFAULT_RECIPE and recipe_config(presets.DEFAULT_RECIPE, 10).steps == 300
    # A given field wins over the recipe, and given steps over its epochs; an epoch counts accumulated steps.
    assert recipe_config(cc, 8000, steps=5, lr=1e-3).steps == 5 and recipe_config(cc, 8000, lr=1e-3).lr == 1e-3
    assert recipe_config(cc, 8000, grad_accum=4).steps == 2000


def test_a_local_copy_given_adds_its_column_where_the_recipe_has_none():
    from countlens.pipeline.finetune_sets import evaluation_names

    c4, cc = presets.recipe("counting-to-four"), presets.recipe("counting-circuits")
    assert evaluation_names(c4, {"pixmo": "p", "fsc147": "f"}) == (*c4.evaluation, "PixMo-Count")
    assert evaluation_names(cc, {"fsc147": "f"}) == (*cc.evaluation, "FSC-Test")
    assert evaluation_names(presets.DEFAULT_RECIPE) == presets.DEFAULT_RECIPE.evaluation


def test_the_paper_probe_has_the_papers_capacity():
    from countlens.analysis.probes import DetectionProbe

    config = presets.probe_config("counting-to-four")
    encoder, projector = (DetectionProbe(d, config).n_params for d in (1024, 2048))  # Table 3's tap widths
    assert 1.65e6 < encoder < 1.75e6 and 2.15e6 < projector < 2.25e6  # "1.7 M–2.2 M"
    assert abs((projector - encoder) - 0.5e6) < 0.05e6  # "differ by only 0.5 M"
    assert DetectionProbe(1024).n_params < 0.11e6  # countlens's default: 16× smaller
    assert presets.probe_config("counting-to-four", epochs=2).epochs == 2


def test_syn_training_data_is_half_dots_half_polygons_with_counts_to_ten():
    from countlens.model.geometry import Geometry
    from countlens.pipeline.finetune_sets import training_data

    scenes = training_data(presets.recipe("counting-circuits"), Geometry(192, 192, 16), "std", n=40)
    kinds = [s.meta["kind"] for s in scenes]
    assert kinds.count("dots") == kinds.count("polygons") == 20
    for kind in ("dots", "polygons"):
        assert sorted({s.meta["count"] for s in scenes if s.meta["kind"] == kind}) == list(range(1, 11))
    with pytest.raises(ConfigError, match="--fsc147"):
        training_data(presets.recipe("counting-to-four"), Geometry(192, 192, 16), "std")


def test_overrides_win_and_bad_names_are_refused():
    small = presets.discover_config("counting-to-four", n_per_case=2)
    assert small.n_per_case == 2 and small.prompt == "std"
    with pytest.raises(ConfigError, match="unknown preset"):
        presets.get("counting-to-five")
    with pytest.raises(ConfigError, match="not DiscoverConfig fields"):
        presets.discover_config("counting-circuits", n_pair=3)
    with pytest.raises(ConfigError, match="unknown preset"):
        check_preset(DiscoverConfig(preset="nope"))


def _paper_heads():
    """Measurements of a 28-layer, 28-head model where the paper's example heads look as the paper
    describes them (layers counted from 0); every other head is unremarkable."""
    shape = (28, 28)
    coords = {"layer": np.arange(28), "head": np.arange(28)}
    m = {k: np.zeros(shape) for k in ("vgs", "cter", "image", "importance", "constancy", "alignment", "difficulty")}
    m["constancy"][:] = 0.3
    m["vgs"][1, 5], m["image"][1, 5] = 0.5, 0.6  # visual grounding, layer 1
    m["image"][19, 23], m["cter"][19, 23], m["importance"][19, 23] = 0.5, 0.8, 0.3  # routing L19H23
    m["image"][26, 26], m["cter"][26, 26], m["importance"][26, 26], m["alignment"][26, 26] = 0.05, 0.9, 0.2, 0.9
    m["image"][25, 3], m["cter"][25, 3], m["importance"][25, 3], m["alignment"][25, 3] = 0.05, 0.9, 0.2, 0.1
    m["image"][5, 0], m["cter"][5, 0], m["importance"][5, 0] = 0.5, 0.8, 0.3  # routing-like, but early
    m["constancy"][26, 8] = 0.95  # existence: always "1"
    m["difficulty"][23, 19] = 0.3  # "difficult", "impossible"
    da = {k: xr.DataArray(v, dims=("layer", "head"), coords=coords) for k, v in m.items()}
    return da


def _classes(thresholds):
    d = _paper_heads()
    df = classify_heads(
        d["vgs"],
        d["cter"],
        d["image"],
        d["importance"],
        d["constancy"],
        thresholds,
        alignment=d["alignment"],
        difficulty=d["difficulty"],
    )
    return {(int(la), int(h)): c for la, h, c in zip(df["layer"], df["head"], df["class"])}


def test_counting_circuits_bands_class_the_papers_heads():
    got = _classes(presets.thresholds("counting-circuits"))
    assert got[(1, 5)] == "visual grounding"
    assert got[(19, 23)] == "cross-modal routing"
    assert got[(26, 26)] == "counting aggregation"
    assert got[(25, 3)] == "other"  # decodes numbers but not the count: not aggregation
    assert got[(26, 8)] == "awareness" and got[(23, 19)] == "awareness"
    assert got[(5, 0)] == "other"  # depth 0.19: before the paper's routing layers
    assert sum(c != "other" for c in got.values()) == 5


def test_the_defaults_cannot_class_the_papers_routing_or_difficulty_heads():
    got = _classes(HeadThresholds())
    assert got[(19, 23)] != "cross-modal routing"  # depth 0.70 ≥ late = 0.5
    assert got[(23, 19)] == "other"  # difficulty words are not tested
    assert got[(25, 3)] == "counting aggregation"  # alignment is not tested
    assert got[(5, 0)] == "cross-modal routing"


def test_head_table_alignment_is_the_share_of_samples_decoding_the_count():
    """A head's alignment: the share of samples (with a known count) whose top-1 token is the
    first token of the count; ablation_drop is copied, unscaled, beside importance."""
    from countlens.analysis.heads import head_table

    coords = {"layer": [0, 1], "head": [0, 1]}
    count_token = np.array([7, 8, 9, -1])  # the last sample has no count
    top1 = np.zeros((2, 2, 4), dtype=int)
    top1[1, 1] = [7, 8, 0, 5]  # 2 of 3 known samples
    top1[0, 1] = [7, 8, 9, 9]  # 3 of 3
    hl = xr.Dataset(
        {
            "token_id": (("layer", "head", "sample", "k"), top1[..., None]),
            "token": (("layer", "head", "sample", "k"), top1[..., None].astype(str)),
            "vgs": (("layer", "head"), np.zeros((2, 2))),
            "cter": (("layer", "head"), np.zeros((2, 2))),
            "difficulty": (("layer", "head"), np.zeros((2, 2))),
            "count_token": ("sample", count_token),
        },
        coords={**coords, "sample": np.arange(4), "k": [0]},
    )
    heads = xr.Dataset({"effect": (("layer", "head"), np.array([[0.5, -0.2], [0.1, 0.0]]))}, coords=coords)
    abl = xr.Dataset(
        {"logp_drop": (("task", "layer", "head"), np.array([[[2.0, 0.5], [-0.1, 0.0]]]))},
        coords={"task": ["count"], **coords},
    )
    att = xr.Dataset(
        {"image_attention": (("layer", "head", "sample"), np.zeros((2, 2, 4)))},
        coords={**coords, "sample": np.arange(4)},
    )
    t = head_table(heads, abl, hl, att).set_index("head_id")
    assert t.loc["L1H1", "alignment"] == pytest.approx(2 / 3) and t.loc["L0H1", "alignment"] == 1.0
    assert t.loc["L0H0", "alignment"] == 0.0
    assert t.loc["L0H1", "importance"] == pytest.approx(0.2) and t.loc["L0H0", "ablation_drop"] == 2.0


def test_headlens_results_without_count_token_or_difficulty_are_refused():
    """HeadLens.decode writes count_token and difficulty: results without them (an older
    countlens's) are refused whatever the thresholds, naming the variables and the fix."""
    import re

    from countlens.analysis.heads import head_table

    coords = {"layer": [0], "head": [0]}
    full = xr.Dataset(
        {
            "token_id": (("layer", "head", "sample", "k"), np.zeros((1, 1, 2, 1), dtype=int)),
            "token": (("layer", "head", "sample", "k"), np.full((1, 1, 2, 1), "a")),
            "vgs": (("layer", "head"), [[0.0]]),
            "cter": (("layer", "head"), [[0.0]]),
            "difficulty": (("layer", "head"), [[0.0]]),
            "count_token": ("sample", [3, -1]),
        },
        coords={**coords, "sample": [0, 1], "k": [0]},
    )
    heads = xr.Dataset({"effect": (("layer", "head"), [[0.1]])}, coords=coords)
    abl = xr.Dataset({"logp_drop": (("task", "layer", "head"), [[[0.1]]])}, coords={"task": ["count"], **coords})
    att = xr.Dataset(
        {"image_attention": (("layer", "head", "sample"), np.zeros((1, 1, 2)))}, coords={**coords, "sample": [0, 1]}
    )
    assert len(head_table(heads, abl, full, att, presets.thresholds("counting-circuits"))) == 1
    fix = "delete results/headlens.nc and rerun `countlens discover` with the same --out"
    for lacking in (["count_token"], ["difficulty"], ["count_token", "difficulty"]):
        hl = full.drop_vars(lacking)
        for thresholds in (HeadThresholds(), presets.thresholds("counting-circuits")):
            with pytest.raises(RunDirError, match=re.escape(f"lack {lacking}") + ".*" + re.escape(fix)):
                head_table(heads, abl, hl, att, thresholds)


def test_a_spec_json_that_lacks_fields_is_refused_naming_them(tmp_path):
    """spec.json without fields of today's spec (jaccard_k / preset: an older countlens's) is
    refused, naming them; a spec with every field but other values is another run."""
    import json
    from dataclasses import asdict

    from countlens.pipeline.rundir import Stages

    spec = {**asdict(DiscoverConfig()), "model": "toy", "arch": "toy"}
    old = {k: v for k, v in spec.items() if k not in ("jaccard_k", "preset")}
    (tmp_path / "spec.json").write_text(json.dumps(old))
    with pytest.raises(RunDirError, match=r"spec.json lacks \['jaccard_k', 'preset'\].*new --out directory"):
        Stages(tmp_path, spec, log=lambda _: None)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    Stages(tmp_path, spec, log=lambda _: None)  # the same settings resume
    with pytest.raises(RunDirError, match="different spec"):
        Stages(tmp_path, {**spec, "jaccard_k": 20}, log=lambda _: None)


def test_the_full_rows_temperature_sharpens_the_classes_the_recipe_names(tmp_path):
    import pandas as pd

    from countlens.circuits.engine.temperature import beta_from_importance
    from countlens.pipeline.finetune_job import importance_from

    pd.DataFrame(
        {
            "layer": [0, 1, 2, 3],
            "head": [0, 0, 0, 0],
            "importance": [0.9, 0.5, 0.45, 0.2],
            "class": ["visual grounding", "cross-modal routing", "counting aggregation", "other"],
        }
    ).to_csv(tmp_path / "heads.csv", index=False)
    classes = presets.recipe("counting-circuits").temperature_classes
    betas = beta_from_importance(importance_from(tmp_path, classes), alpha=1.2, top_k=3)
    assert set(betas) == {(1, 0), (2, 0)}  # the routing and aggregation heads, not the more important VG head
    assert set(beta_from_importance(importance_from(tmp_path), alpha=1.2, top_k=3)) == {(0, 0)}
    # A circuit with no head of those classes falls back to all heads.
    assert importance_from(tmp_path, ("awareness",)).sel(layer=0, head=0) == 0.9


def test_a_recipe_no_run_can_finish_is_refused_before_a_model_loads(tmp_path):
    import json
    from dataclasses import replace

    from PIL import Image

    from countlens.model.geometry import Geometry
    from countlens.pipeline.finetune_job import check_recipe
    from countlens.pipeline.finetune_sets import EVALUATION, LOCAL_SETS, evaluation_sets

    base = presets.DEFAULT_RECIPE
    for change, message in (
        ({"rows": ("+SFT", "+LoRA")}, "Recipe.rows"),
        ({"rows": ("+SFT+focus+temperature",)}, "list '\\+SFT\\+focus' too"),
        ({"evaluation": ("MMLU",)}, "Recipe.evaluation"),
        ({"layers": "some"}, "Recipe.layers"),
        ({"training": "web"}, "Recipe.training"),
        ({"config": {"lora_rank": 8}}, "not FinetuneConfig fields"),
        ({"temperature_classes": ("routing",)}, "Recipe.temperature_classes"),
        ({"training": "fsc147", "rows": ("+SFT+focus",)}, "object centres"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_recipe(replace(base, **change), local={"fsc147": "."})
    with pytest.raises(ConfigError, match="--pixmo /nowhere: no such file"):
        check_recipe(base, local={"pixmo": "/nowhere"})
    with pytest.raises(ConfigError, match="not FinetuneConfig fields"):
        check_recipe(base, overrides={"step": 3})
    # A recipe that trains on FSC-147 reads its train split first (a copy of one image here).
    (tmp_path / "images_384_VarV2").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images_384_VarV2" / "1.jpg")
    (tmp_path / "annotation_FSC147_384.json").write_text(json.dumps({"1.jpg": {"points": [[1, 1]]}}))
    (tmp_path / "Train_Test_Val_FSC_147.json").write_text(json.dumps({"train": ["1.jpg"], "val": [], "test": []}))
    for p in presets.PRESETS.values():
        check_recipe(p.finetune, local={"fsc147": tmp_path})
    # Every name check_recipe accepts builds (the local ones are left out without a copy).
    lines = []
    sets = evaluation_sets(Geometry(192, 192, 16, 2), n=8, prompt="short", names=EVALUATION, log=lines.append)
    assert set(sets) == set(EVALUATION) - set(LOCAL_SETS) and len(lines) == len(LOCAL_SETS)
