"""The attribution methods by name: what each scores, where it runs, what it costs.

Every method that ranks a model's components for a behaviour is one `Method` entry of `METHODS`,
in the order tables show them. An entry says what it scores (site kinds: a head's z, an MLP's output,
the inputs; or edges), how it computes its result (``compute``) and ranks the heads over (layer,
head) from it (``heads``; an edge method by its heads' outgoing edges summed), which families it runs
on (``refusal``: None, or why not), and its cost per chunk of pairs as plain and gradient forwards
(`Cost`, which `countlens plan` turns into time and memory). discover's faithfulness stage,
`bench/attribution.py` and `bench/planted_recovery.py` iterate `METHODS`: a new method is one module
and one entry here.

``from_run`` reads the method's ranking from a discover run's results where a stage already computed
it (exact patching in ``heads``, AtP in ``atp`` …); ``in_discover`` says whether discover's
faithfulness stage ranks with it (computing it there when no stage did, as AtP* is). RelP is
registered but not in discover, so the demo report stays as it is; bench/ measures it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xarray as xr

from countlens.circuits.sites import HeadZ, MlpOut, Residual
from countlens.errors import InputError

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

#: EAP-IG's interpolation steps (MIB's authors' default family of settings), on nodes and on edges.
IG_STEPS = 5


@dataclass(frozen=True)
class Cost:
    """Forwards per chunk of pairs: ``plain`` without gradients, ``grad`` with the graph kept for a
    backward (each backward counted as two forwards' FLOPs by the plan), as functions of the layer count."""

    plain: Callable[[int], int]
    grad: Callable[[int], int]


@dataclass(frozen=True)
class Method:
    """One attribution method (see the module docstring)."""

    name: str
    key: str  # where a run keeps its scores: results[key], or the faithfulness result's f"{key}_effect"
    level: str  # "node" or "edge"
    scores: tuple[type, ...]
    compute: Callable[[VLM, Sequence, int], xr.DataArray | xr.Dataset]  # the method's own result
    cost: Cost
    refusal: Callable[[VLM], str | None] = lambda vlm: None
    from_run: Callable[[dict], xr.DataArray | None] = lambda results: None
    in_discover: bool = False
    stage: str | None = None  # the discover stage that computes it; None: the faithfulness stage itself
    signed: bool = True  # False: scores are magnitudes (AtP*)
    heads: Callable[[VLM, xr.DataArray | xr.Dataset], xr.DataArray] = lambda vlm, result: result

    def supports(self, vlm: VLM) -> bool:
        return self.refusal(vlm) is None

    def ranking(self, vlm: VLM, pairs: Sequence, batch_size: int = 16) -> xr.DataArray:
        """The heads' scores over (layer, head), normalised like the exact sweeps; refused by name where
        the family does not support the method."""
        return self.heads(vlm, self.result(vlm, pairs, batch_size))

    def result(self, vlm: VLM, pairs: Sequence, batch_size: int = 16) -> xr.DataArray | xr.Dataset:
        """The method's own result (an edge method's: every edge's score), refused by name where the
        family does not support it."""
        why = self.refusal(vlm)
        if why is not None:
            raise InputError(f"{self.name} does not run on {vlm.name}: {why}")
        return self.compute(vlm, pairs, batch_size)


def _exact(vlm, pairs, batch_size):
    from countlens.circuits.patching import patch_heads

    return patch_heads(vlm, pairs, batch_size=batch_size).effect


def _atp(vlm, pairs, batch_size):
    from countlens.circuits.patching import attribution_patch

    return attribution_patch(vlm, pairs, batch_size=batch_size).effect


def _atp_star(vlm, pairs, batch_size):
    from countlens.circuits.atp_star import atp_star

    return atp_star(vlm, pairs, batch_size=batch_size).effect


def _atp_star_refusal(vlm) -> str | None:
    from countlens.circuits.atp_star import SUPPORTED

    if vlm.arch.name not in SUPPORTED:
        return f"AtP*'s attention recomputation supports {', '.join(SUPPORTED)}, not {vlm.arch.name}"
    return "a remote model: AtP* runs the model locally" if vlm.remote else None


def _eap_ig(vlm, pairs, batch_size):
    from countlens.circuits.integrated import node_attribution

    return node_attribution(vlm, pairs, steps=IG_STEPS, batch_size=batch_size).effect


def _ablation_drop(vlm, pairs, batch_size):
    from countlens.circuits.ablation import ablation_scan

    scan = ablation_scan(vlm, {"count": [p.clean for p in pairs]}, batch_size=batch_size)
    return scan.logp_drop.sel(task="count", drop=True)


def _edges(method: str, steps: int):
    def compute(vlm, pairs, batch_size):
        from countlens.circuits.edge_attribution import edge_attribution

        return edge_attribution(vlm, pairs, method, steps=steps, batch_size=batch_size)

    return compute


def _edge_refusal(vlm) -> str | None:
    from countlens.circuits.edges import edge_graph

    try:
        edge_graph(vlm)
    except InputError as err:
        return str(err)
    return None


def _relp(vlm, pairs, batch_size):
    from countlens.circuits.relp import relevance_patch

    return relevance_patch(vlm, pairs, batch_size=batch_size).effect


def _relp_refusal(vlm) -> str | None:
    from countlens.circuits.relp import refusal

    return refusal(vlm)


def heads_of_edges(vlm: VLM, result: xr.Dataset) -> xr.DataArray:
    """A head's edge score: the sum of its outgoing edges' (``node_effect``), over (layer, head)."""
    from countlens.labels import head_label

    by_label = dict(zip(result["node"].values.tolist(), result.node_effect.values.tolist(), strict=True))
    arch = vlm.arch
    grid = np.full((arch.n_layers, arch.n_heads), np.nan)
    for layer in range(arch.n_layers):
        for head in range(arch.heads(layer)):
            grid[layer, head] = by_label[head_label((layer, head))]
    return xr.DataArray(
        grid, dims=("layer", "head"), coords={"layer": np.arange(arch.n_layers), "head": np.arange(arch.n_heads)}
    )


def _faithfulness_result(key: str):
    def read(results: dict):
        ds = results.get("faithfulness")
        return ds[f"{key}_effect"] if ds is not None and f"{key}_effect" in ds else None

    return read


#: Every method, in the order tables show them.
METHODS: tuple[Method, ...] = (
    Method(
        "exact patching",
        "heads",
        "node",
        (HeadZ,),
        _exact,
        Cost(lambda n_layers: 2, lambda n_layers: 0),  # plus the stacked edited copies: `patch_heads`'s plan
        stage="heads",
        from_run=lambda results: results["heads"].effect if "heads" in results else None,
        in_discover=True,
    ),
    Method(
        "AtP",
        "atp",
        "node",
        (HeadZ, Residual),
        _atp,
        Cost(lambda n_layers: 1, lambda n_layers: 1),
        stage="atp",
        from_run=lambda results: results["atp"].effect if "atp" in results else None,
        in_discover=True,
    ),
    Method(
        "EAP-IG",
        "eap_ig",
        "node",
        (HeadZ, MlpOut, Residual),
        _eap_ig,
        Cost(lambda n_layers: 2, lambda n_layers: IG_STEPS),
        stage="eap_ig",
        from_run=lambda results: results["eap_ig"].effect if "eap_ig" in results else None,
        in_discover=True,
    ),
    Method(
        "mean-ablation drop",
        "ablation",
        "node",
        (HeadZ,),
        _ablation_drop,
        Cost(lambda n_layers: 2, lambda n_layers: 0),  # plus one edited copy per head: `ablation_scan`'s plan
        stage="ablation",
        from_run=lambda results: (
            results["ablation"].logp_drop.sel(task="count", drop=True) if "ablation" in results else None
        ),
        in_discover=True,
    ),
    Method(
        "AtP*",
        "atp_star",
        "node",
        (HeadZ,),
        _atp_star,
        # The corrupt run, and the clean run kept for L + 1 backward passes (GradDrop).
        Cost(lambda n_layers: 1, lambda n_layers: n_layers + 1),
        refusal=_atp_star_refusal,
        from_run=_faithfulness_result("atp_star"),
        in_discover=True,
        signed=False,
    ),
    Method(
        "EAP (edges)",
        "eap_edges",
        "edge",
        (HeadZ, MlpOut, Residual),
        _edges("eap", 1),
        Cost(lambda n_layers: 2, lambda n_layers: 1),
        refusal=_edge_refusal,
        heads=lambda vlm, result: heads_of_edges(vlm, result),
    ),
    Method(
        "EAP-IG (edges)",
        "eap_ig_edges",
        "edge",
        (HeadZ, MlpOut, Residual),
        _edges("eap-ig", IG_STEPS),
        Cost(lambda n_layers: 2, lambda n_layers: IG_STEPS),
        refusal=_edge_refusal,
        heads=lambda vlm, result: heads_of_edges(vlm, result),
    ),
    Method(
        "RelP",
        "relp",
        "node",
        (HeadZ, Residual),
        _relp,
        Cost(lambda n_layers: 1, lambda n_layers: 1),
        refusal=_relp_refusal,
    ),
)


def method(name: str) -> Method:
    """The registered method called ``name`` (as `METHODS` spells it), else an error listing them."""
    for m in METHODS:
        if m.name == name:
            return m
    raise InputError(f"no attribution method {name!r}; the registered ones are {[m.name for m in METHODS]}")


def discover_methods(vlm: VLM | None = None) -> list[Method]:
    """The methods discover's faithfulness stage ranks with (those ``vlm`` supports, when given)."""
    return [m for m in METHODS if m.in_discover and (vlm is None or m.supports(vlm))]
