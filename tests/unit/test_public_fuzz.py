"""Fuzzing the public API: every public function of `countlens.circuits`, `countlens.analysis`,
`countlens.datasets` and `countlens.training` (from ``__all__``, so new functions join automatically)
gets, one parameter at a time, values of the wrong type, wrong shape, empty, NaN / ±inf and out of
range, the others valid. Each call must end in a `CountlensError` (a clear message) or a valid result
(no ±inf in it) — never another exception. A function that cannot be fuzzed this way says why in
`UNFUZZED`; one with no valid call below fails `test_every_public_function_is_fuzzed`.

Two sweeps per function: every parameter × every value of `BAD`, and `EXAMPLES` (parameter, value)
draws of hypothesis (any float, an integer ≤ 0, a string). The valid calls use the organism with two
samples or pairs; the whole test takes about 15 s on 2 cores, most of it building the valid calls.
"""

from __future__ import annotations

import inspect
import math
import signal

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import countlens.analysis as analysis
import countlens.circuits as circuits
import countlens.datasets as datasets
import countlens.training as training
from countlens.errors import CountlensError

MODULES = (circuits, analysis, datasets, training)
#: (parameter, value) cases hypothesis draws per function, beyond the exhaustive `BAD` sweep.
EXAMPLES = 20

#: Functions not fuzzed here, and why.
UNFUZZED = {
    "finetune": "trains a model (minutes); its config is a validated dataclass (FinetuneConfig) and its samples and "
    "output are refused in tests/unit/test_training.py",
    "with_adapter": "loads a checkpoint from disk; its paths are refused in tests/unit/test_training.py",
    "compare_runs": "reads discover run folders from disk; refused in tests/unit/test_compare.py",
    "export_heads": "writes files; its table and folder are refused in tests/unit/test_bad_inputs.py",
    "eager_attention": "a context manager whose only argument is the model",
    "edge_graph": "takes the model alone; a model it cannot graph is refused in tests/unit/test_edges.py",
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


def public() -> list[str]:
    return sorted(name for module in MODULES for name in module.__all__ if inspect.isfunction(getattr(module, name)))


def function(name: str):
    return next(getattr(m, name) for m in MODULES if name in m.__all__)


#: The valid calls, once the fixture has built them (module-level for `_outcome`).
VALID: dict = {}
#: A call past this many seconds took a bad value as valid.
SECONDS = 30


@pytest.fixture(scope="module")
def valid(loaded):
    """A valid, cheap call of every fuzzed function: its keyword arguments."""
    if not VALID:
        VALID.update(_valid_calls(loaded))
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
        "case_table": dict(results={"cases": scored}),
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
            attn=attn, targets=torch.tensor([[0, 0, 0, 0, 1]] * 2), image_mask=torch.tensor([1, 1, 0, 0, 0]).bool()
        ),
        "target_layers_from": dict(
            circuit=pd.DataFrame({"layer": [0], "head": [0], "importance": [1.0], "class": ["visual grounding"]})
        ),
        "top_heads_from": dict(circuit=heads, k=2),
    }


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


def _call(fn, kwargs):
    out = fn(**kwargs)
    if inspect.isgenerator(out) or hasattr(out, "__enter__"):  # a context manager: enter and leave it
        with out:
            pass
        return None
    return out


class _TooSlow(Exception):
    pass


def _outcome(name: str, param: str, bad) -> str | None:
    """None where ``name`` with ``param`` = ``bad`` ends in a `CountlensError` or a finite result (within
    `SECONDS`), else what went wrong."""

    def alarm(*_):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS)
    try:
        result = _call(function(name), {**VALID[name], param: bad})
    except CountlensError:
        return None
    except _TooSlow:
        return f"{name}({param}={bad!r:.40}) ran past {SECONDS} s: a bad value was accepted"
    except Exception as err:  # noqa: BLE001 — the point: any other exception is a bug
        return f"{name}({param}={bad!r:.40}) raised {type(err).__name__}: {str(err)[:100]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return None if _finite(result) else f"{name}({param}={bad!r:.40}) returned ±inf"


@pytest.mark.parametrize("name", [n for n in public() if n not in UNFUZZED])
def test_bad_arguments_get_a_clear_error(valid, name):
    """Every parameter × every value of `BAD`."""
    failures = [f for param in valid[name] for bad in BAD if (f := _outcome(name, param, bad))]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", [n for n in public() if n not in UNFUZZED])
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
        param=st.sampled_from(list(valid[name])),
        value=st.one_of(st.floats(), st.integers(max_value=0), st.text(max_size=8)),
    )
    def check(param, value):
        failure = _outcome(name, param, value)
        assert failure is None, failure

    check()
