"""The attribution methods by name: what each scores, where it runs, what it costs.

Every method that ranks a model's components for a behaviour is one `Method` entry of `METHODS`, in
the order tables show them, and this module is the one place a method's facts are written:

- ``name``: its one spelling, which `method`, ``countlens methods`` and ``countlens discover --methods``
  take, and under which a discover run keeps the scores no stage keeps (``faithfulness.nc``'s
  ``<name>_effect``, `Method.variable`);
- ``label``: what tables print (the faithfulness table's rows, the benches' keys);
- ``level`` (``"node"`` or ``"edge"``) and ``scores``, the site kinds it scores (an edge method: the
  edges between them);
- ``compute``: the method's own result, a Dataset; `Method.heads` reads the heads' scores over (layer,
  head) from it (``read``; an edge method's head by its outgoing edges summed, `heads_of_edges`);
- ``cost``: forwards per chunk of pairs, plain and with a backward (`Cost`, which `countlens plan`
  turns into time and memory);
- ``refusal``: None where every family runs it, else why not;
- ``stage``: the discover stage that computes it with ``compute`` and keeps its result (``heads``,
  ``atp`` …), None where discover's faithfulness stage computes it itself (AtP*);
- ``in_discover``: whether discover's faithfulness stage ranks with it (``signed``: False where the
  scores are magnitudes);
- ``variant``: the ``method=`` of a function that computes several (`attribution_patch`'s ``"atp"`` /
  ``"atp*"``, `edge_attribution`'s ``"eap"`` / ``"eap-ig"``);
- ``metric``: which metrics (`countlens.circuits.metrics`) it takes, one of `METRIC_NEEDS`: ``"any"``,
  ``"moving"`` (a first-order estimate at the clean run: not one whose gradient vanishes there, such as
  ``kl``), ``"linear"`` (linear in the logits: RelP) or ``"none"`` (it reads its own measure: the
  ablation scan's log-probability drop). `Method.result` and `Method.ranking` take ``metric=`` (None:
  the method's default, the logit difference, as discover runs it); the method refuses a metric it
  cannot take, by name, before any forward.

The defaults a method runs with are written once, in its own module, and read here: EAP-IG's steps
`IG_STEPS` (`countlens.circuits.graph.integrated`), the random rankings' draws `RANDOM_DRAWS`
(`countlens.circuits.graph.faithfulness`). discover's stages, `bench/attribution.py` and
`bench/planted_recovery.py` read `METHODS`: a new method is one module and one entry here. RelP is
registered but not in discover, so the demo report stays as it is; bench/ measures it.

`OBJECT_RANKERS` are the methods applied per object of a scene (`object_attribution`,
`object_edge_attribution`): each names the `Method` it applies (its label, level, refusal and cost
per chunk) and the ``method=`` its function takes. The object modules sit below this registry and
do not import it; they take their refusal as an argument where they have one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xarray as xr

from countlens.circuits.graph.edge_attribution import edge_attribution
from countlens.circuits.graph.edges import refusal as edge_refusal
from countlens.circuits.graph.faithfulness import RANDOM_DRAWS
from countlens.circuits.graph.integrated import IG_STEPS, node_attribution
from countlens.circuits.methods.ablation import ablation_scan
from countlens.circuits.methods.atp_star import SUPPORTED
from countlens.circuits.methods.patching import attribution_patch, patch_heads
from countlens.circuits.methods.relp import refusal as relp_refusal
from countlens.circuits.methods.relp import relevance_patch
from countlens.circuits.objects.edges import object_edge_attribution
from countlens.circuits.objects.gradients import object_attribution
from countlens.circuits.sites import Embed, HeadZ, MlpOut, Residual
from countlens.errors import InputError
from countlens.labels import head_label

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

__all__ = [
    "IG_STEPS",
    "METHODS",
    "METRIC_NEEDS",
    "OBJECT_RANKERS",
    "RANDOM_DRAWS",
    "Cost",
    "Method",
    "ObjectRanker",
    "check_discover_names",
    "discover_methods",
    "heads_of_edges",
    "method",
]


@dataclass(frozen=True)
class Cost:
    """Forwards per chunk of pairs: ``plain`` without gradients, ``grad`` with the graph kept for a
    backward (each backward counted as two forwards' FLOPs by the plan), as functions of the layer count."""

    plain: Callable[[int], int]
    grad: Callable[[int], int]


def _everywhere(vlm: VLM) -> str | None:
    return None


def _effect(result: xr.Dataset) -> xr.DataArray:
    return result.effect


#: What a `Method`'s ``metric`` says it takes (see the module docstring).
METRIC_NEEDS: tuple[str, ...] = ("any", "moving", "linear", "none")


@dataclass(frozen=True)
class Method:
    """One attribution method (see the module docstring)."""

    name: str
    label: str
    level: str  # "node" or "edge"
    scores: tuple[type, ...]
    compute: Callable[..., xr.Dataset]  # (vlm, pairs, batch_size, **options[, method=variant]): its result
    cost: Cost
    refusal: Callable[[VLM], str | None] = _everywhere
    read: Callable[[xr.Dataset], xr.DataArray] = _effect  # a node method's head scores from its result
    stage: str | None = None
    in_discover: bool = False
    signed: bool = True  # False: scores are magnitudes (AtP*)
    variant: str | None = None
    metric: str = "any"  # one of METRIC_NEEDS

    def __post_init__(self):
        if self.metric not in METRIC_NEEDS:
            raise InputError(f"method {self.name!r}: metric={self.metric!r}; give one of {METRIC_NEEDS}")

    @property
    def variable(self) -> str:
        """Where discover's faithfulness stage keeps the scores of a method no earlier stage computes."""
        return f"{self.name}_effect"

    @property
    def everywhere(self) -> bool:
        """Whether every family runs it (it has no refusal)."""
        return self.refusal is _everywhere

    def supports(self, vlm: VLM) -> bool:
        return self.refusal(vlm) is None

    def result(self, vlm: VLM, pairs: Sequence, batch_size: int = 16, metric=None, **options) -> xr.Dataset:
        """The method's own result (an edge method's: every edge's score), refused by name where the
        family does not support it. ``metric``: `countlens.circuits.metrics` (None: the method's default,
        the logit difference); ``options``: the sweep's (``store``, ``progress``, ``shard``) for exact
        patching, as discover's ``heads`` stage gives them."""
        why = self.refusal(vlm)
        if why is not None:
            raise InputError(f"{self.label} does not run on {vlm.name}: {why}")
        if metric is not None:
            if self.metric == "none":
                raise InputError(
                    f"{self.label} takes no metric (it reads its own measure); leave metric unset, or rank with a "
                    f"method that takes one: {', '.join(m.name for m in METHODS if m.metric != 'none')}"
                )
            options["metric"] = metric
        if self.variant is not None:
            options["method"] = self.variant
        return self.compute(vlm, pairs, batch_size, **options)

    def heads(self, vlm: VLM, result: xr.Dataset) -> xr.DataArray:
        """The heads' scores over (layer, head) from the method's ``result``."""
        return heads_of_edges(vlm, result) if self.level == "edge" else self.read(result)

    def ranking(self, vlm: VLM, pairs: Sequence, batch_size: int = 16, metric=None) -> xr.DataArray:
        """The heads' scores over (layer, head), normalised like the exact sweeps, of ``metric`` (None:
        the logit difference); refused by name where the family does not support the method."""
        return self.heads(vlm, self.result(vlm, pairs, batch_size, metric=metric))

    def from_run(self, results: dict) -> xr.DataArray | None:
        """The method's head scores in a discover run's ``results`` (its stage's result, or the
        faithfulness stage's `variable`), None where the run has none."""
        if self.stage is not None:
            return self.read(results[self.stage]) if self.stage in results else None
        ds = results.get("faithfulness")
        return ds[self.variable] if ds is not None and self.variable in ds else None


def _exact(vlm, pairs, batch_size, **sweep):
    return patch_heads(vlm, pairs, batch_size=batch_size, **sweep)


def _attribution(vlm, pairs, batch_size, method, metric=None):
    return attribution_patch(vlm, pairs, batch_size=batch_size, method=method, metric=metric)


def _atp_star_refusal(vlm) -> str | None:
    if vlm.arch.name not in SUPPORTED:
        return f"AtP*'s attention recomputation supports {', '.join(SUPPORTED)}, not {vlm.arch.name}"
    return "a remote model: AtP* runs the model locally" if vlm.remote else None


def _eap_ig(vlm, pairs, batch_size, metric=None):
    return node_attribution(vlm, pairs, steps=IG_STEPS, batch_size=batch_size, metric=metric)


def _ablation(vlm, pairs, batch_size):
    return ablation_scan(vlm, {"count": [p.clean for p in pairs]}, batch_size=batch_size)


def _count_drop(result: xr.Dataset) -> xr.DataArray:
    return result.logp_drop.sel(task="count", drop=True)


def _edges(vlm, pairs, batch_size, method, metric=None):
    steps = IG_STEPS if method == "eap-ig" else 1
    return edge_attribution(vlm, pairs, method, steps=steps, batch_size=batch_size, metric=metric)


def _relp(vlm, pairs, batch_size, metric=None):
    return relevance_patch(vlm, pairs, batch_size=batch_size, metric=metric)


def heads_of_edges(vlm: VLM, result: xr.Dataset) -> xr.DataArray:
    """A head's edge score: the sum of its outgoing edges' (``node_effect``), over (layer, head)."""
    by_label = dict(zip(result["node"].values.tolist(), result.node_effect.values.tolist(), strict=True))
    arch = vlm.arch
    grid = np.full((arch.n_layers, arch.n_heads), np.nan)
    for layer in range(arch.n_layers):
        for head in range(arch.heads(layer)):
            grid[layer, head] = by_label[head_label((layer, head))]
    return xr.DataArray(
        grid, dims=("layer", "head"), coords={"layer": np.arange(arch.n_layers), "head": np.arange(arch.n_heads)}
    )


_EDGE_SITES = (HeadZ, MlpOut, Residual)

#: Every method, in the order tables show them.
METHODS: tuple[Method, ...] = (
    Method(
        "exact",
        "exact patching",
        "node",
        (HeadZ,),
        _exact,
        Cost(lambda n_layers: 2, lambda n_layers: 0),  # plus the stacked edited copies: `patch_heads`'s plan
        stage="heads",
        in_discover=True,
    ),
    Method(
        "atp",
        "AtP",
        "node",
        (HeadZ, Residual),
        _attribution,
        Cost(lambda n_layers: 1, lambda n_layers: 1),
        stage="atp",
        in_discover=True,
        variant="atp",
        metric="moving",
    ),
    Method(
        "eap_ig",
        "EAP-IG",
        "node",
        (HeadZ, MlpOut, Residual),
        _eap_ig,
        Cost(lambda n_layers: 2, lambda n_layers: IG_STEPS),
        stage="eap_ig",
        in_discover=True,
    ),
    Method(
        "ablation",
        "mean-ablation drop",
        "node",
        (HeadZ,),
        _ablation,
        Cost(lambda n_layers: 2, lambda n_layers: 0),  # plus one edited copy per head: `ablation_scan`'s plan
        read=_count_drop,
        stage="ablation",
        in_discover=True,
        metric="none",
    ),
    Method(
        "atp_star",
        "AtP*",
        "node",
        (HeadZ,),
        _attribution,
        # The corrupt run, and the clean run kept for L + 1 backward passes (GradDrop).
        Cost(lambda n_layers: 1, lambda n_layers: n_layers + 1),
        refusal=_atp_star_refusal,
        in_discover=True,
        signed=False,
        variant="atp*",
        metric="moving",
    ),
    Method(
        "eap_edges",
        "EAP (edges)",
        "edge",
        _EDGE_SITES,
        _edges,
        Cost(lambda n_layers: 2, lambda n_layers: 1),
        refusal=edge_refusal,
        variant="eap",
        metric="moving",
    ),
    Method(
        "eap_ig_edges",
        "EAP-IG (edges)",
        "edge",
        _EDGE_SITES,
        _edges,
        Cost(lambda n_layers: 2, lambda n_layers: IG_STEPS),
        refusal=edge_refusal,
        variant="eap-ig",
    ),
    Method(
        "relp",
        "RelP",
        "node",
        (HeadZ, Residual),
        _relp,
        Cost(lambda n_layers: 1, lambda n_layers: 1),
        refusal=relp_refusal,
        metric="linear",
    ),
)


def method(name: str) -> Method:
    """The registered method called ``name`` (as `METHODS` spells it), else an error listing them."""
    for m in METHODS:
        if m.name == name:
            return m
    raise InputError(f"no attribution method {name!r}; the registered ones are {[m.name for m in METHODS]}")


def discover_methods(vlm: VLM | None = None, names: Sequence[str] = ()) -> list[Method]:
    """The methods discover's faithfulness stage ranks with (those ``vlm`` supports, when given; only
    those named in ``names``, when given), in `METHODS`' order."""
    return [m for m in METHODS if m.in_discover and (vlm is None or m.supports(vlm)) and (not names or m.name in names)]


def check_discover_names(names: Sequence[str], error: type[Exception] = InputError) -> tuple[str, ...]:
    """``names`` as a tuple when each is a method discover ranks with, named once, else ``error`` naming
    the known ones."""
    known = ", ".join(m.name for m in METHODS if m.in_discover)
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise error(f"methods={names!r}: give a tuple of method names, some of {known}")
    for name in names:
        if name not in [m.name for m in METHODS if m.in_discover]:
            registered = name in [m.name for m in METHODS]
            why = " (it is registered, but discover does not rank with it)" if registered else ""
            raise error(
                f"methods: {name!r} is no method discover ranks with{why}; give some of {known} "
                "(`countlens methods` lists every method)"
            )
    if len(set(names)) != len(names):
        raise error(f"methods={list(names)!r} names a method twice; name each once, some of {known}")
    return tuple(names)


@dataclass(frozen=True)
class ObjectRanker:
    """A registered method applied per object of a scene: ``of``'s score summed over each object's span
    of image tokens against the scene's background, by ``function`` (``"object_attribution"``: at a
    decoder layer's input; ``"object_edge_attribution"``: from layer 0's input to every receiver) with
    ``method=variant``. Its label, level, refusal and cost per chunk of scenes are ``of``'s."""

    name: str
    of: Method
    function: str
    variant: str

    @property
    def label(self) -> str:
        return f"{self.of.label} per object"

    @property
    def scores(self) -> tuple[type, ...]:
        """Each object's span of image tokens at a decoder layer's input (layer 0's: `Embed`, by default)."""
        return (Embed,)

    def result(self, vlm: VLM, samples: Sequence, **options) -> xr.Dataset:
        """``function``'s result on ``samples`` (scenes) with ``method=variant``, refused by its checks
        (``of``'s refusal among them) before any forward."""
        run = object_attribution if self.function == "object_attribution" else object_edge_attribution
        return run(vlm, samples, self.variant, **options)


#: The object rankers: each scores a scene's objects (their spans of image tokens) by the method it names.
OBJECT_RANKERS: tuple[ObjectRanker, ...] = (
    ObjectRanker("object_atp", method("atp"), "object_attribution", "atp"),
    ObjectRanker("object_eap_ig", method("eap_ig"), "object_attribution", "eap-ig"),
    ObjectRanker("object_eap_edges", method("eap_edges"), "object_edge_attribution", "eap"),
    ObjectRanker("object_eap_ig_edges", method("eap_ig_edges"), "object_edge_attribution", "eap-ig"),
)
