"""Every public function that returns a Dataset or DataArray gives it provenance: the model, countlens's
version, the date, the method, and the data's recipe — enough to make every sample again.

The functions are found from ``__all__`` of `countlens.circuits` and `countlens.analysis` by their return
annotation, so a new one joins this test and fails until it has a call below (or a stated reason)."""

from __future__ import annotations

import inspect
import json

import pytest

import countlens.analysis as analysis
import countlens.circuits as circuits
from countlens.analysis.probes import ProbeConfig
from countlens.circuits import HeadLens, Patch, Residual
from countlens.datasets import count_pairs, countingtricks, task_samples
from countlens.datasets.recipe import rebuild
from countlens.results import recipe_of

#: Functions whose result is not a measurement on data: they reshape another result, which keeps its own.
DERIVED = {"jaccard": "the overlap of an ablation_scan's top heads: a view of that result"}


def _returns_xarray(fn) -> bool:
    return "xr." in str(inspect.signature(fn).return_annotation)


def _public() -> list[str]:
    names = []
    for module in (circuits, analysis):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                names += [f"{name}.{m}" for m, f in inspect.getmembers(obj, inspect.isfunction) if _returns_xarray(f)]
            elif callable(obj) and _returns_xarray(obj):
                names.append(name)
    return sorted(names)


@pytest.fixture(scope="module")
def calls(loaded):
    vlm, moe = loaded("toy"), loaded("qwen3_vl_moe")
    pairs = count_pairs(2, 3, 5, kind="shapes", grid=vlm.geometry, prompt="short", seed=2)
    moe_pairs = count_pairs(2, 3, 5, kind="polygons", image_size=64, prompt="short", seed=1)
    samples = task_samples("count", 4, seed=1)
    tricks = countingtricks(["1A"], 3, grid=vlm.geometry, seed=0, prompt="short")
    lens = HeadLens.fit(vlm, samples, layers=[0, 1])
    scores = circuits.patch_heads(vlm, pairs).effect
    config = ProbeConfig(hidden=8, groups=4, epochs=1, batch_size=4)
    return {
        "HeadLens.decode": lambda: lens.decode(vlm, samples[:2], top_k=2),
        "HeadLens.r2_array": lens.r2_array,
        "ablate": lambda: circuits.ablate(vlm, samples, [(0, 0)]),
        "ablate_experts": lambda: circuits.ablate_experts(
            moe, task_samples("count", 2, seed=1, image_size=64), [(1, 0)]
        ),
        "ablation_scan": lambda: circuits.ablation_scan(vlm, {"count": samples[:2]}),
        "ablate_edges": lambda: circuits.ablate_edges(vlm, pairs, [("L0H0", "logits")]),
        "keep_edges": lambda: circuits.keep_edges(vlm, pairs, [("L0H0", "logits")]),
        "path_patch": lambda: circuits.path_patch(vlm, pairs, "L0H0", "logits"),
        "gradients": lambda: circuits.gradients(vlm, samples[:2], [Residual(1)], positions="last"),
        "attribution_patch": lambda: circuits.attribution_patch(vlm, pairs),
        "edge_attribution": lambda: circuits.edge_attribution(vlm, pairs, method="eap"),
        "edge_attributions": lambda: circuits.edge_attributions(vlm, pairs, ("eap",))["eap"],
        "effect": lambda: circuits.effect(vlm, pairs, Patch(Residual(1), positions="last")),
        "expert_ablation_scan": lambda: circuits.expert_ablation_scan(
            moe, task_samples("count", 2, seed=1, image_size=64)
        ),
        "expert_usage": lambda: circuits.expert_usage(moe, task_samples("count", 2, seed=1, image_size=64)),
        "faithfulness": lambda: circuits.faithfulness(vlm, pairs, scores, sizes=[0.5]),
        "faithfulness_curves": lambda: circuits.faithfulness_curves(vlm, pairs, {"patching": scores}, sizes=[0.5]),
        "image_attention_share": lambda: circuits.image_attention_share(vlm, samples[:2], layers=[0]),
        "logit_lens": lambda: circuits.logit_lens(vlm, samples[:2]),
        "node_attribution": lambda: circuits.node_attribution(vlm, pairs, steps=1),
        "object_attribution": lambda: circuits.object_attribution(vlm, tricks, method="eap-ig", steps=2),
        "object_edge_attribution": lambda: circuits.object_edge_attribution(vlm, tricks, method="eap-ig", steps=2),
        "object_effects": lambda: circuits.object_effects(vlm, tricks, reference="background"),
        "object_misses": lambda: analysis.object_misses(circuits.object_effects(vlm, tricks[:1]), n_boot=50),
        "patch_experts": lambda: circuits.patch_experts(moe, moe_pairs),
        "patch_heads": lambda: circuits.patch_heads(vlm, pairs, layers=[0]),
        "patch_layers": lambda: circuits.patch_layers(vlm, pairs, layers=[0]),
        "attention_metrics": lambda: analysis.attention_metrics(vlm, tricks, layers=[0]),
        "generate": lambda: analysis.generate(vlm, samples[:2], max_new_tokens=2),
        "probe_taps": lambda: analysis.probe_taps(vlm, tricks, tricks, taps=[("llm", 0)], config=config),
        "representation_view": lambda: analysis.representation_view(vlm, samples, layers=[0]),
        "score": lambda: analysis.score(vlm, samples),
    }


def test_every_public_result_has_a_call_here(calls):
    missing = [name for name in _public() if name not in calls and name not in DERIVED]
    assert not missing, f"add a call for {missing} to this test (or a reason to DERIVED)"


@pytest.mark.parametrize("name", _public())
def test_every_result_carries_its_provenance(calls, name):
    if name in DERIVED:
        pytest.skip(DERIVED[name])
    attrs = calls[name]().attrs
    for key in ("model", "arch", "countlens_version", "date", "method", "data_recipe"):
        assert key in attrs, f"{name}: no {key!r} attr"
    recipe = json.loads(attrs["data_recipe"])
    assert recipe and all(entry["generator"].startswith("countlens.datasets.") for entry in recipe)


def test_a_recipe_makes_the_samples_again():
    samples = [*task_samples("count", 3, seed=4), *countingtricks(["4A"], 2, image_size=192, patch_size=16)]
    folded = recipe_of(samples)
    assert [entry["index"] for entry in folded] == [[[0, 2]], [[0, 1]]]
    for entry, sample in zip(folded, (samples[2], samples[4])):
        again = rebuild({**entry, "index": entry["index"][0][1]})
        assert again.scene == sample.scene and again.question == sample.question
    pair = count_pairs(3, 3, 5, prompt="short", image_size=192, seed=9)[2]
    again = rebuild(pair.clean.recipe)
    assert again.clean.scene == pair.clean.scene and again.corrupt.scene == pair.corrupt.scene


def test_save_all_writes_every_result_or_none(tmp_path, calls):
    from countlens.results import ResultError, load_all, save_all

    results = {"score": calls["score"](), "lens": calls["HeadLens.r2_array"]()}
    with pytest.raises(ResultError, match="not an xarray"):
        save_all({**results, "bad": [1, 2]}, tmp_path / "many")
    assert not (tmp_path / "many").exists()
    save_all(results, tmp_path / "many")
    again = load_all(tmp_path / "many")
    assert (
        set(again) == {"score", "lens"} and again["score"].attrs["data_recipe"] == results["score"].attrs["data_recipe"]
    )
