"""Does the graph explain the model? Its predicted feature effects against the real model's.

For each chosen feature node of an attribution graph (layer l, position p, feature f, activation a),
two edits, each predicted by the graph and measured in the **real** model
(`countlens.features.interventions`: the feature edited inside the real forward at position p, this
forward's error term held, attention, norms and every other MLP live):

- **removal** — ``a → 0``. Predicted: `removal_effects` (direct and indirect, in the graph's linear
  world: ``−a · (r₁ + r₂ + …)[f]``). Real: `remove_feature`.
- **steering** — ``a → factor · a``. Predicted: the same linear effect scaled,
  ``(1 − factor) · removal`` (a change of ``(factor − 1) · a`` where removal is one of ``−a``).
  Real: `steer_feature`.

Each effect is the change of the target logit's demeaned value (the logit minus the mean logit, what
a graph's logit node holds) at the last position. The summary is the Spearman ρ of predicted and real
effects over the features, and the share of features where both have the same sign (a real change of
exactly 0 matches nothing). Both are countlens's summary of what "agree" means.

The difference between the two is what the graph leaves out: the local replacement model freezes
attention patterns and norm scales, holds every error term and every MLP at the clean run (so TopK
never re-selects), and is linear; the real model is none of these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from scipy.stats import spearmanr

from countlens.circuits.engine.record import record
from countlens.circuits.engine.run import intervene
from countlens.circuits.sites import MlpIn
from countlens.circuits.sites.positions import Mask
from countlens.errors import InputError
from countlens.features.graph import AttributionGraph, token_positions
from countlens.features.interventions import remove_feature, steer_feature
from countlens.features.prune import node_influence, removal_effects
from countlens.features.replacement import check_fits
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.validate import require_count, require_finite, require_integer

if TYPE_CHECKING:
    from countlens.features.transcoder import TranscoderSet
    from countlens.model.vlm import VLM


def agreement(predicted: np.ndarray, real: np.ndarray) -> tuple[float, float]:
    """(Spearman ρ, share of same signs) of two effect vectors; ρ is NaN under three entries or for a
    constant vector."""
    same = float((np.sign(predicted) * np.sign(real) > 0).mean()) if len(real) else float("nan")
    if len(real) < 3 or np.ptp(predicted) == 0 or np.ptp(real) == 0:
        return float("nan"), same
    return float(spearmanr(predicted, real).statistic), same


def _same_run(
    vlm: VLM, transcoders, graph: AttributionGraph, nodes: torch.Tensor, cache, row: int, target: int
) -> float:
    """The target's demeaned logit in the recorded clean run ``cache``; refused where the graph's clean
    run is not this one: its target logit or the chosen features' activations differ from this
    forward's (another scene, model or transcoder set), beyond the model's dtype's rounding."""
    rounding = max(1e-3, 8 * torch.finfo(vlm.hf.dtype).eps)
    logits = cache.logits[0].float()
    value, expected = float(logits[target] - logits.mean()), float(graph.values[row])
    if abs(value - expected) > rounding * max(1.0, abs(expected)):
        raise InputError(
            f"feature_effects: this sample's {vlm.token_strings([target])[0]!r} logit is {value:.4f}, the graph's "
            f"{expected:.4f}: the graph was built on another sample or model; give the sample the graph was built on"
        )
    for j in nodes.tolist():
        layer, pos, f = (int(v) for v in graph.features[j])
        tc = transcoders.layer(layer)
        with torch.no_grad():
            got = float(tc.encode(cache[MlpIn(layer)][0, pos].to(tc.W_enc.device, tc.dtype))[f])
        want = float(graph.activations[j])
        if abs(got - want) > rounding * max(1.0, abs(want)):
            raise InputError(
                f"feature_effects: feature {f} of layer {layer} at position {pos} has activation {got:.4f} here and "
                f"{want:.4f} in the graph: the graph was built with other transcoders; give the set it was built with"
            )
    return value


def _chosen(graph: AttributionGraph, features) -> torch.Tensor:
    """Feature node indices: the ``features`` of largest node influence (an int), or those given."""
    if isinstance(features, (int, np.integer)) and not isinstance(features, bool):
        require_count(int(features), "features (how many of the most influential features)")
        infl = node_influence(graph)[: graph.n_features]
        return infl.topk(min(int(features), graph.n_features)).indices
    if isinstance(features, (str, bytes)) or not hasattr(features, "__iter__"):
        raise InputError(f"features is a count or a list of feature node indices, got {features!r:.40}")
    index = [require_integer(j, "a feature node index", low=0) for j in features]
    if not index:
        raise InputError("features is an empty list; give feature node indices (0 … graph.n_features − 1) or a count")
    outside = [j for j in index if j >= graph.n_features]
    if outside:
        raise InputError(f"feature nodes {outside[:5]} are past the graph's {graph.n_features} feature nodes")
    return torch.tensor(index)


def feature_effects(
    vlm: VLM,
    transcoders: TranscoderSet,
    graph: AttributionGraph,
    sample,
    features=20,
    factor: float = 2.0,
    logit: int | None = None,
) -> xr.Dataset:
    """The graph's predicted effects of removing and of steering ``features`` (the count of most
    influential feature nodes, or a list of feature node indices) against the real model's (see the
    module's docstring), on ``sample`` — the graph's own sample. ``logit``: a vocab id of one of the
    graph's logit nodes (default the most probable). An `xr.Dataset` over ``node`` with ``layer``,
    ``position``, ``feature``, ``activation``, ``removal_graph``, ``removal_real``, ``steer_graph``,
    ``steer_real``; attrs ``removal_spearman``, ``removal_same_sign``, ``steer_spearman``,
    ``steer_same_sign``, ``target``, ``factor`` and the provenance."""
    require_vlm(vlm, "feature_effects")
    check_fits(vlm, transcoders, "feature_effects")
    if not isinstance(graph, AttributionGraph):
        raise InputError(f"feature_effects takes an AttributionGraph (attribution_graph(...)), got {graph!r:.60}")
    check_samples([sample], "feature_effects")
    factor = require_finite(factor, "feature_effects' factor (the steering's; 2 doubles each feature)")
    row = graph.logit_node(logit)  # refuses a token without a logit node, or a graph without any
    target = int(graph.logit_tokens[row - graph.start("logit")])
    batch = vlm.prepare_samples([sample])
    ids = batch.inputs["input_ids"][0].cpu()
    if ids.shape != graph.tokens.shape or not torch.equal(ids, graph.tokens.cpu()):
        raise InputError(
            "feature_effects: the graph was built on another prompt than this sample's (its tokens differ); "
            "give the sample the graph was built on"
        )
    if not torch.equal(graph.objects.cpu(), token_positions(batch, sample, len(ids))[1]):
        raise InputError(
            "feature_effects: the graph was built on another scene (its image tokens' objects differ from this "
            "sample's); give the sample the graph was built on"
        )
    if graph.scan and transcoders.scan and graph.scan != transcoders.scan:
        raise InputError(
            f"feature_effects: the graph was built with transcoders {graph.scan!r}, not these ({transcoders.scan!r})"
        )
    nodes = _chosen(graph, features)
    predicted = removal_effects(graph, target)[nodes].numpy().astype(np.float64)

    @torch.no_grad()
    def demeaned(edit) -> float:  # the forward `record` runs, edited
        with intervene(vlm, [edit]):
            logits = vlm.hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        return float(logits[target] - logits.mean())

    cache = record(vlm, batch, [MlpIn(layer) for layer in sorted({int(v) for v in graph.features[nodes, 0]})])
    clean = _same_run(vlm, transcoders, graph, nodes, cache, row, target)
    removed, steered = [], []
    for j in nodes.tolist():
        layer, pos, f = (int(v) for v in graph.features[j])
        where = torch.zeros(1, len(ids), dtype=torch.bool)
        where[0, pos] = True
        at = Mask(where, samples=[sample])
        removed.append(demeaned(remove_feature(transcoders, layer, f, positions=at)) - clean)
        steered.append(demeaned(steer_feature(transcoders, layer, f, factor, positions=at)) - clean)
    removal_real, steer_real = np.array(removed), np.array(steered)
    steer_graph = (1.0 - factor) * predicted
    chosen = graph.features[nodes].numpy()
    ds = xr.Dataset(
        {
            "layer": ("node", chosen[:, 0]),
            "position": ("node", chosen[:, 1]),
            "feature": ("node", chosen[:, 2]),
            "activation": ("node", graph.activations[nodes].float().numpy()),
            "removal_graph": ("node", predicted),
            "removal_real": ("node", removal_real),
            "steer_graph": ("node", steer_graph),
            "steer_real": ("node", steer_real),
        },
        coords={"node": nodes.numpy()},
    )
    rho, same = agreement(predicted, removal_real)
    steer_rho, steer_same = agreement(steer_graph, steer_real)
    ds.attrs.update(
        provenance(
            vlm.name,
            vlm.arch.name,
            samples=[sample],
            transcoders=transcoders.scan or "unnamed",
            method="graph-predicted vs real-model feature effects (countlens.features.effects)",
        )
    )
    ds.attrs.update(
        target=target,
        target_string=vlm.token_strings([target])[0],
        clean_value=clean,
        factor=factor,
        removal_spearman=rho,
        removal_same_sign=same,
        steer_spearman=steer_rho,
        steer_same_sign=steer_same,
    )
    return ds
