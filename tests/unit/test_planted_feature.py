"""The planted feature organism (`countlens.toy.feature_plant`): the shipped weights still compute
"count ≥ 5" in their planted unit on fresh samples, the unit's hooks against a by-hand computation, the
recipe trains only what it names and is a pure function of its seed, and bad input is refused first."""

from __future__ import annotations

import json

import pytest
import torch

from countlens.errors import ConfigError, InputError
from countlens.model.shipped import ORGANISMS
from countlens.toy.catalogue import FEATURES, planted_circuit_of, planted_feature_of
from countlens.toy.feature_plant import (
    FEATURE_CHECKS,
    FeatureConfig,
    auroc_of,
    check_feature,
    correlation,
    feature_checks,
    fresh_feature,
    plant_feature,
    train_feature,
    unit_read,
)
from countlens.toy.planter import pair_batch, pairs_at
from countlens.toy.recipe import ToyConfig
from countlens.toy.train import Collator

NAME = "planted-count-ge-5"
FEATURE = FEATURES["count-ge-5"]


def _hf(name: str = NAME):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(ORGANISMS[name], dtype=torch.float32).eval()


def test_the_feature_organism_is_named_and_its_record_passes_its_checks():
    assert planted_feature_of(NAME) is FEATURE and planted_circuit_of(NAME) is None
    assert planted_feature_of("planted-route") is None and planted_feature_of("toy") is None
    record = json.loads((ORGANISMS[NAME] / "planted.json").read_text())
    assert record["feature"]["layer"] == FEATURE.layer and record["feature"]["unit"] == FEATURE.unit
    assert all(record["fresh_checks"].values()), record["fresh"]
    assert record["fresh"]["n_samples"] >= FEATURE_CHECKS["n_samples_min"]
    assert feature_checks(record["fresh"]) == record["fresh_checks"]


def test_the_shipped_unit_computes_count_at_least_5_on_fresh_samples():
    """The first 64 of the record's fresh samples (never trained on): the bars hold there too, and each
    rate agrees with the 1,024-sample record within what 64 samples can move it."""
    figures = fresh_feature(_hf(), FEATURE, n_samples=64)
    checks = feature_checks(figures)
    assert {k for k, ok in checks.items() if not ok} == {"n_samples"}, figures
    record = json.loads((ORGANISMS[NAME] / "planted.json").read_text())["fresh"]
    for key in ("accuracy", "unit_auroc", "interchange_follows_donor", "elsewhere_zeroed_accuracy"):
        assert abs(figures[key] - record[key]) <= 0.06, key
    assert figures["unit_mean_h1"] > FEATURE.target / 2 > figures["unit_mean_h0"]


def test_the_units_hooks_read_and_write_what_a_by_hand_mlp_computes(loaded):
    hf = loaded("toy").hf
    mlp = hf.model.language_model.layers[FEATURE.layer].mlp
    inputs, _, _ = pair_batch(Collator(ToyConfig()), pairs_at(3, 0, 2))
    seen_in = []
    handle = mlp.register_forward_pre_hook(lambda m, args: seen_in.append(args[0].detach()))
    try:
        with torch.no_grad(), unit_read(hf, FEATURE) as seen:
            clean = hf(**inputs).logits[:, -1]
        x = seen_in[0]
        by_hand = mlp.act_fn(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
        torch.testing.assert_close(seen[0], by_hand[..., FEATURE.unit])
        # Writing the last token's unit = adding (new − old) × the down projection's column there.
        new = torch.tensor([3.0, -1.0, 0.5, 2.0])
        column = mlp.down_proj.weight[:, FEATURE.unit]
        delta = torch.zeros_like(x[..., :1] * column)
        delta[:, -1] = (new - seen[0][:, -1])[:, None] * column
        with torch.no_grad(), unit_read(hf, FEATURE, new) as written:
            patched = hf(**inputs).logits[:, -1]
        out_hook = mlp.register_forward_hook(lambda m, args, out: out + delta)
        with torch.no_grad():
            added = hf(**inputs).logits[:, -1]
        out_hook.remove()
    finally:
        handle.remove()
    torch.testing.assert_close(written[0][:, -1], new)
    torch.testing.assert_close(patched, added, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(patched, clean)


def test_planting_trains_only_the_mlp_and_above_and_is_a_pure_function_of_its_seed():
    def run(seed):
        model = _hf("toy")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rows = []
        train_feature(model, FEATURE, FeatureConfig(seed=seed, steps=2, batch_pairs=2, warmup=1), rows.append)
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        return rows, moved, torch.cat([p.detach().flatten() for p in model.parameters()])

    (rows, moved, first), (_, _, again), (_, _, other) = run(0), run(0), run(1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert {"clean", "swap", "separation", "elsewhere"} <= rows[-1].keys()
    layer = FEATURE.layer
    assert any(f"layers.{layer}.mlp." in n for n in moved) and "lm_head.weight" in moved
    frozen = ("visual.", "embed_tokens", f"layers.{layer}.self_attn", *(f"layers.{i}." for i in range(layer)))
    assert not {n for n in moved if any(f in n for f in frozen)}


def test_auroc_and_correlation_on_hand_worked_values():
    labels = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert auroc_of(torch.tensor([3.0, 2.0, 1.0, 0.0]), labels) == 1.0
    assert auroc_of(torch.tensor([3.0, 0.0, 1.0, 0.0]), labels) == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])) == pytest.approx(1.0)
    assert torch.isnan(torch.tensor(auroc_of(torch.ones(2), torch.ones(2))))


def test_bad_feature_and_recipe_are_refused_before_any_forward_or_write(tmp_path):
    from dataclasses import replace

    for bad, match in (
        (replace(FEATURE, layer=6), "layer 6"),
        (replace(FEATURE, unit=384), "unit 384"),
        (replace(FEATURE, unit=True), "unit True"),
        (replace(FEATURE, threshold=10), "threshold 10"),
        (replace(FEATURE, threshold=3), "threshold 3"),
        (replace(FEATURE, target=float("nan")), "target nan"),
        (replace(FEATURE, target=float("inf")), "target inf"),
        ("count-ge-5", "PlantedFeature"),
    ):
        with pytest.raises(InputError, match=match):
            check_feature(bad)
        with pytest.raises(InputError, match=match):
            plant_feature(tmp_path / "out", bad)
        with pytest.raises(InputError, match=match):
            fresh_feature(None, bad)
    with pytest.raises(InputError, match="even"):
        fresh_feature(None, FEATURE, n_samples=3)
    with pytest.raises(ConfigError, match="FeatureConfig"):
        plant_feature(tmp_path / "out", FEATURE, {"steps": 3})
    with pytest.raises(ConfigError, match="FeatureConfig"):
        train_feature(None, FEATURE, {"steps": 3})
    with pytest.raises(ConfigError, match="steps"):
        FeatureConfig(steps=0)
    with pytest.raises(ConfigError, match="elsewhere_weight"):
        FeatureConfig(elsewhere_weight=-1.0)
    with pytest.raises(InputError, match="progress"):
        plant_feature(tmp_path / "out", FEATURE, progress=3)
    assert not (tmp_path / "out").exists()
