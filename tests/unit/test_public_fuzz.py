"""Fuzzing the public API: every public function and class of `countlens.circuits`, `countlens.analysis`,
`countlens.datasets`, `countlens.training` and `countlens.features` (from ``__all__``, so new names join
automatically), `graph_page`, `ProbeConfig`, and toy planting (`TOY`: `countlens.toy` has no ``__all__``)
gets, one parameter at a time, values of the wrong type, wrong shape, empty, NaN / ±inf and out of
range, the others valid. Each call must end in a `CountlensError` (a clear message) or a valid result
(no ±inf in it) — never another exception. A name that cannot be fuzzed this way says why in `UNFUZZED`;
one with no valid call below fails `test_every_public_function_is_fuzzed`.

A class is fuzzed through its constructor (`CONSTRUCTORS`: `HeadLens.fit`), every parameter of its
signature; the object it builds must then work in a valid call (`USE`: a site in a `Patch` under
`effect`, positions under a `Patch`, an intervention under `effect` or `intervene`, a config in the
function it configures), and a configuration's fields hold what they are annotated with (`_typed`: an
``int`` field no 2.5, a ``bool`` no "nonsense"). Toy planting runs up to its training, which `no_training`
replaces by a stub that passes one log row to ``progress`` and stops: a refusal must come before it.

Two sweeps per name: every parameter × every value of `BAD`, and `EXAMPLES` (parameter, value) draws of
hypothesis (any float, an integer ≤ 0, a string). The valid calls use the organism with two samples or
pairs, and one set of random transcoders (16 features, no training); calls run in a temporary folder, so
a path such as "nonsense" writes there, and `test_the_valid_calls_are_valid` runs each valid call as given.
145 names (functions and classes): each with every parameter × every `BAD` value, and 20 hypothesis draws.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import os
import signal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_transcoders import random_set

import countlens.analysis as analysis
import countlens.circuits as circuits
import countlens.datasets as datasets
import countlens.features as features
import countlens.training as training
from countlens.analysis.probes import ProbeConfig
from countlens.errors import CountlensError
from countlens.features.graph_page import graph_page
from countlens.toy.catalogue import FEATURES
from countlens.toy.edge_plant import plant_edges
from countlens.toy.feature_plant import FeatureConfig, plant_feature
from countlens.toy.plant import PlantConfig, check_plant, plant
from countlens.toy.planted import EdgeCircuit, PlantedCircuit, PlantedNode, Sharpening, edge_circuit, planted_circuit
from countlens.toy.recipe import ToyConfig
from countlens.toy.regions import plant_regions
from countlens.toy.schedule import TrainConfig
from countlens.toy.train import train

MODULES = (circuits, analysis, datasets, training, features)
#: Toy planting: `countlens.toy` has no ``__all__``; these are what ``countlens toy plant`` / ``train`` call.
TOY = (plant, plant_edges, plant_feature, plant_regions, train, planted_circuit, edge_circuit, check_plant)
TOY_CLASSES = (
    PlantConfig,
    FeatureConfig,
    TrainConfig,
    ToyConfig,
    PlantedNode,
    Sharpening,
    PlantedCircuit,
    EdgeCircuit,
)
#: Public names outside the modules' ``__all__``.
EXTRA = (graph_page, ProbeConfig, *TOY, *TOY_CLASSES)
#: A class built by another constructor than its own.
CONSTRUCTORS = {"HeadLens": circuits.HeadLens.fit}
#: (parameter, value) cases hypothesis draws per name, beyond the exhaustive `BAD` sweep.
EXAMPLES = 20

#: Names not fuzzed here, and why.
UNFUZZED = {
    "finetune": "trains a model (minutes); its config is a validated dataclass (FinetuneConfig, fuzzed here) and "
    "its samples and output are refused in tests/unit/test_training.py",
    "with_adapter": "loads a checkpoint from disk; its paths are refused in tests/unit/test_training.py",
    "compare_runs": "reads discover run folders from disk; refused in tests/unit/test_compare.py",
    "export_heads": "writes files; its table and folder are refused in tests/unit/test_bad_inputs.py",
    "eager_attention": "a context manager whose only argument is the model",
    "tolerate_noise": "a context manager without arguments (tests/unit/test_metrics.py runs it)",
    "edge_graph": "takes the model alone; a model it cannot graph is refused in tests/unit/test_edges.py",
    "Intervention": "the base of the interventions, each fuzzed here (its site and positions checks are theirs)",
    "Activations": "a result (collect_activations returns it); fuzzed as the argument of fidelity",
    "AttributionGraph": "a result (attribution_graph returns it); fuzzed as the argument of prune, graph_json …",
    "Training": "a result (train_transcoders returns it)",
    "Case": "a COUNTINGTRICKS case, looked up by name (countingtricks' cases, fuzzed)",
    "CountPair": "a record count_pair builds (fuzzed); a pair is fuzzed as the argument of effect, patch_heads …",
    "Obj": "a record the scene generators build (fuzzed); it refuses an unknown shape, colour or size itself",
    "Scene": "a record the scene generators build (fuzzed); it refuses an object outside the image itself",
    "TaskSample": "a record task_sample builds (fuzzed); a sample is fuzzed as the argument of score, record …",
}

#: Values no parameter takes.
BAD = [
    None,
    "",
    "nonsense",
    -1,
    0,
    2.5,
    float("nan"),
    float("inf"),
    -float("inf"),
    [],
    [float("nan")],
    {},
    (),
    torch.zeros(0),
    torch.full((3,), float("inf")),
    xr.Dataset(),
    xr.DataArray([1.0, 2.0], dims=("x",)),
    object(),
]


def _registry() -> dict:
    names: dict = {}
    for obj in [getattr(m, n) for m in MODULES for n in m.__all__] + list(EXTRA):
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert names.get(obj.__name__, obj) is obj, f"two public names {obj.__name__}"
            names[obj.__name__] = obj
    return names


#: Every public function and class, by name.
PUBLIC = _registry()


def public() -> list[str]:
    return sorted(PUBLIC)


def fuzzed() -> list[str]:
    return [n for n in public() if n not in UNFUZZED]


def function(name: str):
    return CONSTRUCTORS.get(name, PUBLIC[name])


#: The valid calls, once the fixture has built them (module-level for `_outcome`): keyword arguments …
VALID: dict = {}
#: … and for a class, what is done with the object it builds.
USE: dict = {}
#: A call past this many seconds took a bad value as valid.
SECONDS = 30


class _Trained(Exception):
    """A toy planting reached its training (`no_training`): its arguments passed the door."""


class _Fresh:
    """An output folder in a valid call: a new one for every call, in the working (temporary) folder."""

    counter = itertools.count()

    def __call__(self) -> Path:
        return Path.cwd() / f"out{next(self.counter)}"


FRESH = _Fresh()


@pytest.fixture(scope="module", autouse=True)
def workdir(tmp_path_factory):
    """Calls run in a temporary folder: a path such as "nonsense" is written there."""
    before = Path.cwd()
    os.chdir(tmp_path_factory.mktemp("fuzz"))
    yield
    os.chdir(before)


@pytest.fixture(scope="module", autouse=True)
def no_training():
    """Toy planting stops where training begins (after one log row to ``progress``, as training gives);
    transcoders' default data mix (``mix=None``, valid) is two scenes, not 640."""

    def train_and_save(start, out, train, progress):
        if progress:
            progress({"step": 0, "loss": 0.0})
        raise _Trained

    def train_regions(model, steps, seed, batch, lr, log=None):
        if log:
            log({"step": 0, "loss": 0.0})
        raise _Trained

    def build_model(cfg, seed=0):
        raise _Trained

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("countlens.toy.plant.train_and_save", train_and_save)
        mp.setattr("countlens.toy.edge_plant.train_and_save", train_and_save)
        mp.setattr("countlens.toy.feature_plant.train_and_save", train_and_save)
        mp.setattr("countlens.toy.regions.train_regions", train_regions)
        mp.setattr("countlens.toy.train.build_model", build_model)
        mp.setattr("countlens.features.activations.DEFAULT_MIX", {"count": 2})
        yield


@pytest.fixture(scope="module")
def valid(loaded):
    """A valid, cheap call of every fuzzed name: its keyword arguments (and `USE`)."""
    if not VALID:
        VALID.update(_valid_calls(loaded))
        VALID.update(_feature_calls(loaded("toy")))
        VALID.update(_toy_calls())
        VALID.update(_class_calls(loaded("toy")))
    return VALID


def _valid_calls(loaded) -> dict:
    vlm = loaded("toy")
    pairs = datasets.count_pairs(2, 3, 5, kind="shapes", grid=vlm.geometry, prompt="short", seed=1)
    samples = datasets.task_samples("count", 2, seed=1)
    batch = vlm.prepare_samples(samples)
    heads = circuits.patch_heads(vlm, pairs).effect
    scan = circuits.ablation_scan(vlm, {"count": samples})
    scored = analysis.score(vlm, samples)
    lens = circuits.HeadLens.fit(vlm, samples, layers=[0, 1])
    rng = np.random.default_rng(0)
    attn = [torch.softmax(torch.randn(2, 4, 5, 5), -1)]
    scenes = datasets.countingtricks(["1A"], 1, grid=vlm.geometry, prompt="short", counts=[3])
    return {
        "ablate": dict(vlm=vlm, samples=samples, heads=[(0, 0)]),
        "ablation_scan": dict(vlm=vlm, tasks={"count": samples}),
        "attribution_patch": dict(vlm=vlm, pairs=pairs),
        "beta_from_importance": dict(importance=heads),
        "compare": dict(estimate=heads, exact=heads, k=3),
        "edge_attribution": dict(vlm=vlm, pairs=pairs, method="eap", steps=1),
        "edge_attributions": dict(vlm=vlm, pairs=pairs, methods=("eap",), steps=1),
        "checked_graph": dict(vlm=vlm, batch=batch),
        "effect": dict(vlm=vlm, pairs=pairs, interventions=circuits.Patch(circuits.Residual(1), positions="last")),
        "prepare_pairs": dict(vlm=vlm, pairs=pairs),
        "gradients": dict(vlm=vlm, data=samples, sites=[circuits.Residual(1)], positions="last"),
        "path_patch": dict(vlm=vlm, pairs=pairs, senders="L0H0", receivers="logits"),
        "ablate_edges": dict(vlm=vlm, pairs=pairs, edges=[("L0H0", "logits")]),
        "keep_edges": dict(vlm=vlm, pairs=pairs, edges=[("L0H0", "logits")]),
        "faithfulness": dict(vlm=vlm, pairs=pairs, scores=heads, sizes=[0.5, 1.0]),
        "faithfulness_curves": dict(vlm=vlm, pairs=pairs, rankings={"exact": heads}, sizes=[0.5, 1.0]),
        "group_means": dict(vlm=vlm, samples=samples),
        "head_temperature": dict(vlm=vlm, betas={(0, 0): 1.5}),
        "image_attention_share": dict(vlm=vlm, samples=samples, layers=[0]),
        "intervene": dict(vlm=vlm, interventions=[circuits.Scale(circuits.HeadZ(0, 0), 0.5)]),
        "jaccard": dict(scan=scan, k=3),
        "last_token_attention": dict(vlm=vlm, batch=batch, layers=[0]),
        "logit_lens": dict(vlm=vlm, samples=samples),
        "mean_activation": dict(vlm=vlm, samples=samples, site=circuits.Residual(1), positions="last"),
        "mean_difference": dict(vlm=vlm, a=samples, b=samples[::-1], site=circuits.Residual(1)),
        "node_attribution": dict(vlm=vlm, pairs=pairs, steps=1),
        "object_attribution": dict(vlm=vlm, samples=scenes, method="atp"),
        "object_edge_attribution": dict(vlm=vlm, samples=scenes, method="eap", peak=True),
        "object_effects": dict(vlm=vlm, samples=scenes, reference="background"),
        "object_misses": dict(effects=circuits.object_effects(vlm, scenes, reference="background"), n_boot=50),
        "patch_heads": dict(vlm=vlm, pairs=pairs, layers=[0]),
        "patch_layers": dict(vlm=vlm, pairs=pairs, layers=[0]),
        "record": dict(vlm=vlm, batch=batch, sites=[circuits.Residual(0)]),
        "tap": dict(vlm=vlm, samples=samples, kind="llm", index=0),
        "top_heads": dict(scan=scan, k=3),
        # Mixture-of-experts functions on the organism refuse it by name (it has no experts): a valid
        # refusal, so their other arguments are fuzzed on the same call.
        "ablate_experts": dict(vlm=vlm, samples=samples, experts=[(1, 0)]),
        "expert_ablation_scan": dict(vlm=vlm, samples=samples),
        "expert_means": dict(vlm=vlm, samples=samples),
        "expert_usage": dict(vlm=vlm, samples=samples),
        "patch_experts": dict(vlm=vlm, pairs=pairs),
        "routing": dict(vlm=vlm, batch=batch),
        "accuracy": dict(ds=scored, by="count"),
        "attention_metrics": dict(
            vlm=vlm, samples=datasets.countingtricks(["1A"], 2, grid=vlm.geometry, prompt="short"), layers=[0]
        ),
        "case_table": dict(results={"cases": analysis.score(vlm, scenes)}),
        "classify_heads": dict(
            vgs=lens.decode(vlm, samples).vgs,
            cter=lens.decode(vlm, samples).cter,
            image_attention=xr.zeros_like(heads.sel(layer=[0, 1])),
            importance=heads.sel(layer=[0, 1]),
        ),
        "digit_in_conflict": dict(std_ds=scored, conflict_ds=scored),
        "generate": dict(vlm=vlm, samples=samples, max_new_tokens=2),
        "number_avoidance": dict(ds=scored),
        "parse_count": dict(text="3"),
        "parse_shape_count": dict(text="3 circles", shape="circle"),
        "probe_taps": dict(
            vlm=vlm,
            train_samples=datasets.countingtricks(["1A"], 2, grid=vlm.geometry, prompt="short"),
            test_samples=datasets.countingtricks(["1A"], 2, grid=vlm.geometry, prompt="short", seed=1),
            taps=[("llm", 0)],
            config=analysis.probes.ProbeConfig(hidden=8, groups=4, epochs=1, batch_size=2),
        ),
        "representation_view": dict(vlm=vlm, samples=datasets.task_samples("count", 4, seed=2), layers=[0]),
        "score": dict(vlm=vlm, samples=samples),
        "summary": dict(ds=scored),
        "answer_text": dict(style="std", shape="circle", count=3),
        "count_pair": dict(seed=0, index=0, image_size=64),
        "count_pairs": dict(n=2, image_size=64),
        "count_table": dict(pairs=[(3, 5), (5, 3)]),
        "pair_counts": dict(seed=0, index=3),
        "count_scene": dict(seed=0, index=0, image_size=64),
        "count_scenes": dict(n=2, image_size=64),
        "countingtricks": dict(cases=["1A"], n_per_case=2, image_size=192, patch_size=16),
        "make_question": dict(style="std", shape="circle", count=3, rng=None),
        "place_objects": dict(rng=rng, width=64, height=64, specs=[("circle", "red", 8.0)]),
        "rebuild": dict(recipe=samples[0].recipe),
        "task_sample": dict(task="count", seed=0, index=0),
        "task_samples": dict(task="count", n=2, seed=0),
        "trick_sample": dict(name="1A", seed=0, index=0, image_size=192, patch_size=16),
        "answer_ce": dict(logits=torch.randn(2, 3, 5), labels=torch.tensor([[-100, 1, 2], [-100, -100, 3]])),
        "focus_loss": dict(
            attn=attn,
            targets=torch.tensor([[0, 0, 0, 0, 1]] * 2),
            image_pos=[torch.tensor([0, 1])] * 2,
            priors=[torch.tensor([0.5, 0.5])] * 2,
        ),
        "gaussian_prior": dict(centres=[(1.0, 1.0)], grid=(3, 3)),
        "mas_loss": dict(
            attn=attn,
            targets=torch.tensor([[0, 0, 0, 0, 1]] * 2),
            image_mask=torch.tensor([[1, 1, 0, 0, 0]] * 2).bool(),
        ),
        "target_layers_from": dict(
            circuit=pd.DataFrame({"layer": [0], "head": [0], "importance": [1.0], "class": ["visual grounding"]})
        ),
        "top_heads_from": dict(circuit=heads, k=2),
    }


def _feature_calls(vlm) -> dict:
    samples = datasets.task_samples("count", 2, seed=1)
    tcs = random_set(width=16, k=2)
    graph = features.attribution_graph(vlm, tcs, samples[0], max_logits=2, max_features=4, batch_size=16)
    cards = features.feature_cards(vlm, tcs, samples, [(0, 1)], top=1, batch_size=2)
    shares = features.head_shares(vlm, tcs, samples[0], graph=graph)
    folder = features.save_transcoders(tcs, FRESH())
    y = torch.randn(4, 3)
    return {
        "attribution_graph": dict(
            vlm=vlm, transcoders=tcs, sample=samples[0], max_logits=2, logit_prob=0.95, max_features=4, batch_size=16
        ),
        "collect_activations": dict(vlm=vlm, layers=[0], samples=samples, texts=(), batch_size=2),
        "clamp_feature": dict(transcoders=tcs, layer=0, feature=1, value=2.0, positions="last"),
        "draw_card": dict(cards=cards, card=str(cards.card.values[0]), samples=samples, path="card.png"),
        "feature_cards": dict(vlm=vlm, transcoders=tcs, samples=samples, features=[(0, 1)], top=1, batch_size=2),
        "feature_effects": dict(
            vlm=vlm, transcoders=tcs, graph=graph, sample=samples[0], features=2, factor=2.0, logit=None
        ),
        "fidelity": dict(transcoders=tcs, activations=features.collect_activations(vlm, range(6), samples), chunk=64),
        "fvu": dict(y=y, y_hat=y + 0.1),
        "graph_dataset": dict(graph=graph),
        "graph_json": dict(graph=graph, slug="g", scan=None, prompt_tokens=None),
        "graph_scores": dict(graph=graph),
        "graph_page": dict(graph_or_json=graph, path="graph.html", title=None, cards=cards),
        "head_shares": dict(
            vlm=vlm,
            transcoders=tcs,
            sample=samples[0],
            graph=graph,
            target=None,
            batch_size=16,
            features="frozen",
            against=None,
        ),
        "load_transcoders": dict(folder=folder, vlm=vlm, dtype=None),
        "node_influence": dict(graph=graph),
        "planted_path_recovery": dict(shares=shares, circuit_heads=[(0, 2)]),
        "prune": dict(graph=graph, node_threshold=0.8, edge_threshold=0.98),
        "removal_effects": dict(graph=graph, logit=None),
        "remove_feature": dict(transcoders=tcs, layer=0, feature=1, positions="last"),
        "replacement": dict(vlm=vlm, transcoders=tcs),
        "replacement_accuracy": dict(vlm=vlm, transcoders=tcs, samples=samples, batch_size=2),
        "save_graph": dict(graph=graph, path="graph.json", slug=None),
        "save_transcoders": dict(transcoders=tcs, folder=FRESH, model_name=None, scan=None),
        "steer_feature": dict(transcoders=tcs, layer=0, feature=1, factor=2.0, positions="last"),
        "train_transcoders": dict(
            vlm=vlm,
            layers=[0],
            width=16,
            k=2,
            steps=1,
            batch_tokens=64,
            lr=0.002,
            seed=0,
            mix={"count": 2},
            out=None,
            progress=False,
            resume=True,
            held_out=0.25,
            checkpoint_every=1,
            batch_size=2,
        ),
        # Classes
        "LocalReplacement": dict(vlm=vlm, transcoders=tcs, sample=samples[0]),
        "Transcoder": dict(d_model=128, d_transcoder=16, activation="topk", k=2),
        "TranscoderSet": dict(transcoders=list(tcs), layers=None, model_name="toy", scan=""),
    }


def _toy_calls() -> dict:
    threads = torch.get_num_threads()  # `train` sets torch's threads: leave them as they are
    return {
        "plant": dict(out=FRESH, circuit=planted_circuit("route"), pc=PlantConfig(steps=1), progress=None),
        "plant_edges": dict(out=FRESH, circuit=edge_circuit("value-route"), pc=PlantConfig(steps=1), progress=None),
        "plant_feature": dict(out=FRESH, feature=FEATURES["count-ge-5"], fc=FeatureConfig(steps=1), progress=None),
        "plant_regions": dict(out=FRESH, steps=1, seed=0, progress=None),
        "train": dict(out=FRESH, cfg=ToyConfig(), tc=TrainConfig(steps=1, threads=threads), progress=None),
        "planted_circuit": dict(name="route"),
        "edge_circuit": dict(name="value-route"),
        "check_plant": dict(circuit=planted_circuit("two-hop"), pc=PlantConfig()),
        "PlantConfig": dict(steps=1),
        "FeatureConfig": dict(steps=1),
        "TrainConfig": dict(steps=1, threads=threads),
        "ToyConfig": {},
        "PlantedNode": dict(layer=0, head=2, at="all"),
        "Sharpening": {
            f.name: getattr(planted_circuit("two-hop").sharpen, f.name) for f in dataclasses.fields(Sharpening)
        },
        "PlantedCircuit": {
            f.name: getattr(planted_circuit("two-hop"), f.name) for f in dataclasses.fields(PlantedCircuit)
        },
        "EdgeCircuit": {f.name: getattr(edge_circuit("value-route"), f.name) for f in dataclasses.fields(EdgeCircuit)},
        "FinetuneConfig": {},
        "ProbeConfig": dict(hidden=8, groups=4, epochs=1, batch_size=2),
        "HeadThresholds": {},
    }


def _class_calls(vlm) -> dict:
    """The sites, positions and interventions, and what is done with each object they build (`USE`)."""
    pairs = datasets.count_pairs(2, 3, 5, kind="shapes", grid=vlm.geometry, prompt="short", seed=1)
    samples = datasets.task_samples("count", 2, seed=1)
    clean = vlm.prepare_samples([p.clean for p in pairs])
    recorded = circuits.record(vlm, vlm.prepare_samples(samples), [circuits.Residual(1)])[circuits.Residual(1)]
    sites = dict(
        Residual=dict(layer=1),
        HeadZ=dict(layer=0, head=0),
        Q=dict(layer=0, head=0),
        K=dict(layer=0, head=0),
        V=dict(layer=0, head=0),
        MlpIn=dict(layer=1),
        MlpOut=dict(layer=1),
        Expert=dict(layer=1, expert=0),  # the organism has no experts: a refusal by name
        ImageStates=dict(layer=-1),  # nor image states
    )
    positions = dict(
        Group=dict(name="last"),
        Cells=dict(cells=[(0, 0)]),
        Objects=dict(objects=[0], coverage=0.25, peak=True, of="edited"),
        Mask=dict(where=torch.ones_like(clean.inputs["input_ids"], dtype=torch.bool), samples=None),
    )
    at = dict(site=circuits.Residual(1), positions="last")
    interventions = dict(
        Patch=dict(at, values=recorded, into=None),
        Resample=dict(at, donors=samples, seed=0),
        Mean=dict(at, reference=samples),
        Zero=at,
        Add=dict(at, vector=torch.zeros(vlm.arch.d_model), alpha=1.0),
        Scale=dict(at, beta=0.5),
        Apply=dict(at, fn=lambda x: x * 0.5),
        Replace=dict(site=circuits.MlpOut(1), positions="last", fn=lambda x: x * 0.5, reads=circuits.MlpIn(1)),
        Block=dict(layer=1, head=None, queries="last", keys="image"),
    )

    def patched(intervention):
        with circuits.intervene(vlm, intervention):
            return analysis.score(vlm, samples)

    def planted_with(sharpen):
        return plant(FRESH(), dataclasses.replace(planted_circuit("two-hop"), sharpen=sharpen), PlantConfig(steps=1))

    threads = torch.get_num_threads()
    USE.update(
        {name: lambda s: circuits.effect(vlm, pairs, circuits.Patch(s, positions="last")) for name in sites}
        | {
            name: lambda p: circuits.effect(vlm, pairs, circuits.Patch(circuits.Residual(1), positions=p))
            for name in positions
        }
        | {name: lambda i: circuits.effect(vlm, pairs, i) for name in interventions}
        | {
            "Patch": patched,
            "Replace": patched,  # Replace and Block run under intervene only
            "Block": patched,
            "HeadLens": lambda lens: lens.decode(vlm, samples, top_k=2),
            "HeadThresholds": lambda t: analysis.classify_heads(**{**VALID["classify_heads"], "thresholds": t}),
            "Transcoder": lambda tc: features.fidelity(
                features.TranscoderSet([tc] * 6), VALID["fidelity"]["activations"]
            ),
            "TranscoderSet": lambda s: features.fidelity(s, VALID["fidelity"]["activations"]),
            "PlantConfig": lambda pc: plant(FRESH(), planted_circuit("route"), pc),
            "TrainConfig": lambda tc: train(FRESH(), ToyConfig(), tc),
            "ToyConfig": lambda cfg: train(FRESH(), cfg, TrainConfig(steps=1, threads=threads)),
            "PlantedNode": lambda node: plant(
                FRESH(), PlantedCircuit("fuzz", (node,), "one node"), PlantConfig(steps=1)
            ),
            "Sharpening": planted_with,
            "PlantedCircuit": lambda c: plant(FRESH(), c, PlantConfig(steps=1)),
            "EdgeCircuit": lambda c: plant_edges(FRESH(), c, PlantConfig(steps=1)),
            "Metric": lambda m: circuits.effect(
                vlm, pairs, circuits.Patch(circuits.Residual(1), positions="last"), metric=m
            ),
        }
    )
    metric = dict(name="gap", fn=lambda logits, pb: logits[:, 0] - logits[:, 1], params={"rows": [0, 1]})
    return (
        sites
        | positions
        | interventions
        | {"HeadLens": dict(vlm=vlm, samples=samples, layers=[0, 1]), "Metric": metric}
    )


def _complete(name: str, kwargs: dict) -> dict:
    """A class's valid call with every parameter of its constructor: the defaults of those not given."""
    if name in CONSTRUCTORS or not inspect.isclass(PUBLIC[name]):
        return kwargs
    given = dict(kwargs)
    for p in inspect.signature(PUBLIC[name]).parameters.values():
        if p.name not in given and p.default is not p.empty and repr(p.default) != "<factory>":
            given[p.name] = p.default
    return given


def test_every_public_function_is_fuzzed(valid):
    missing = [name for name in public() if name not in valid and name not in UNFUZZED]
    assert not missing, f"give {missing} a valid call in this test's `valid` (or a reason in UNFUZZED)"


def _finite(result) -> bool:
    """No ±inf anywhere in a result (NaN may mark an absent site)."""
    if isinstance(result, (xr.Dataset, xr.DataArray)):
        arrays = [result] if isinstance(result, xr.DataArray) else list(result.data_vars.values())
        return all(not np.isinf(a.values).any() for a in arrays if np.issubdtype(a.dtype, np.number))
    if isinstance(result, torch.Tensor):
        return not torch.isinf(result).any()
    if isinstance(result, float):
        return not math.isinf(result)
    if isinstance(result, (list, tuple)):
        return all(_finite(r) for r in result)
    if isinstance(result, dict):
        return all(_finite(v) for v in result.values())
    return True


#: The annotations `_typed` reads, and what a value of each is.
_PLAIN = {
    "int": lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool),
    "float": lambda v: (
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
    ),
    "bool": lambda v: isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and v in (0, 1)),
    "str": lambda v: isinstance(v, str),
    "None": lambda v: v is None,
}


def _typed(obj) -> str | None:
    """Where a dataclass's field of a plain annotation (int, float, bool, str, one of them or None) holds
    something else — 2.5 as a step count, "nonsense" as a switch, NaN as a rate — which."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return None
    for f in dataclasses.fields(obj):
        text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        options = [t.strip() for t in text.split("|")]
        value = getattr(obj, f.name)
        if all(t in _PLAIN for t in options) and not any(_PLAIN[t](value) for t in options):
            return f"{type(obj).__name__}.{f.name}: {f.type} holds {value!r:.40}"
    return None


def _call(fn, kwargs):
    out = fn(**kwargs)
    if inspect.isgenerator(out) or (hasattr(out, "__enter__") and not isinstance(out, torch.nn.Module)):
        with out:  # a context manager: enter and leave it
            pass
        return None
    return out


class _TooSlow(Exception):
    pass


def _run(name: str, kwargs: dict):
    """``name`` called with ``kwargs`` (a `FRESH` folder made new), and for a class, its object used (`USE`)
    and its fields checked (`_typed`)."""
    result = _call(function(name), {k: v() if v is FRESH else v for k, v in kwargs.items()})
    if not inspect.isclass(PUBLIC[name]):
        return result
    # A use the organism refuses by name (Expert, ImageStates: `REFUSED`) would pass any field: fields first.
    if name in REFUSED and (wrong := _typed(result)) is not None:
        raise TypeError(f"accepted: {wrong}")
    try:
        used = USE[name](result) if name in USE else None
    except _Trained:  # the object passed the door of the training it configures: its fields are checked below
        used = None
    if (wrong := _typed(result)) is not None:
        raise TypeError(f"accepted: {wrong}")
    return used


def _outcome(name: str, param: str, bad) -> str | None:
    """None where ``name`` with ``param`` = ``bad`` ends in a `CountlensError` or a finite result (within
    `SECONDS`), else what went wrong."""

    def alarm(*_):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS)
    try:
        result = _run(name, {**_complete(name, VALID[name]), param: bad})
    except (CountlensError, _Trained):
        return None
    except _TooSlow:
        return f"{name}({param}={bad!r:.40}) ran past {SECONDS} s: a bad value was accepted"
    except Exception as err:  # noqa: BLE001 — the point: any other exception is a bug
        return f"{name}({param}={bad!r:.40}) raised {type(err).__name__}: {str(err)[:100]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return None if _finite(result) else f"{name}({param}={bad!r:.40}) returned ±inf"


def test_the_valid_calls_are_valid(valid):
    """Every valid call, as given, runs (a class's object used too), or reaches its training."""
    failures = [f for name in fuzzed() if (f := _valid_outcome(name))]
    assert not failures, "\n".join(failures)


#: Valid calls that the organism refuses by name (it has no experts, no image states): their other
#: arguments are fuzzed on the same call.
REFUSED = {"Expert", "ImageStates", "ablate_experts", "expert_ablation_scan", "expert_means", "expert_usage"}
REFUSED |= {"patch_experts", "routing"}


def _valid_outcome(name: str) -> str | None:
    try:
        _run(name, _complete(name, VALID[name]))
    except _Trained:
        return None
    except CountlensError as err:
        return None if name in REFUSED else f"{name}'s valid call was refused: {str(err)[:200]}"
    except Exception as err:  # noqa: BLE001
        return f"{name}'s valid call raised {type(err).__name__}: {str(err)[:200]}"
    return None


@pytest.mark.parametrize("name", fuzzed())
def test_bad_arguments_get_a_clear_error(valid, name):
    """Every parameter × every value of `BAD`."""
    failures = [f for param in _complete(name, valid[name]) for bad in BAD if (f := _outcome(name, param, bad))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", fuzzed())
def test_drawn_values_get_a_clear_error(valid, name):
    """Hypothesis draws a parameter and a value — any float (NaN and ±inf among them), an integer ≤ 0,
    a string — `EXAMPLES` times; no shrinking (a failure is reported as drawn)."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(
        param=st.sampled_from(list(_complete(name, valid[name]))),
        value=st.one_of(st.floats(), st.integers(max_value=0), st.text(max_size=8)),
    )
    def check(param, value):
        failure = _outcome(name, param, value)
        assert failure is None, failure

    check()
