"""Feature interventions in the real model: a transcoder feature removed, clamped or steered.

An attribution graph predicts what a feature does in the *local replacement model* (frozen attention
and norms, every MLP a constant). To ask what the feature does in the **model**, edit it inside the
real forward: layer l's MLP output ``y`` is rewritten from the MLP's input ``x`` through the
transcoder, with this forward's **error term held**::

    a  = encode(x)                       # the transcoder's code in this forward
    a' = a with feature f edited         # remove: 0; clamp: value; steer: factor · a_f
    y' = decode(a') + (y − decode(a))    # = y + (a'_f − a_f) · W_dec[f]

so the MLP writes what it wrote, except the feature's share, and everything else — attention, norms,
every other MLP, the features above — runs live and responds. (The error term is this forward's own,
``y − ŷ`` at the MLP's current input; the features TopK chose are not re-selected.) Each edit is
an engine intervention, ``Replace(MlpOut(l), fn, reads=(MlpIn(l), MlpOut(l)))``
(`countlens.circuits.engine.interventions`), so it runs under `countlens.circuits.intervene` with any
other intervention and any measurement: scoring, generation, a trace::

    with intervene(vlm, [remove_feature(tcs, 0, 365, positions="last")]):
        score(vlm, samples)

- `remove_feature` — ``a'_f = 0`` (zero ablation of the feature);
- `clamp_feature` — ``a'_f = value`` (also turns on a feature that was off);
- `steer_feature` — ``a'_f = factor · a_f`` (2 doubles it, 0 removes it, −1 flips it).

Positions are the engine's (a token group, `Cells`, `Objects`, a `Mask`); `countlens.features.effects`
builds a one-position `Mask` for a graph's node.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from countlens.circuits.engine.interventions import Replace
from countlens.circuits.sites import MlpIn, MlpOut
from countlens.circuits.sites.positions import as_positions
from countlens.errors import InputError
from countlens.features.transcoder import TranscoderSet
from countlens.validate import require_finite, require_integer


def _checked(transcoders: TranscoderSet, layer, feature, what: str) -> None:
    if not isinstance(transcoders, TranscoderSet):
        raise InputError(
            f"{what} takes a TranscoderSet (train_transcoders or load_transcoders), got {type(transcoders).__name__}"
        )
    require_integer(layer, f"{what}'s layer", low=0)
    if layer not in transcoders.layers:
        raise InputError(f"{what}: the transcoders have no layer {layer}; they cover layers {list(transcoders.layers)}")
    require_integer(feature, f"{what}'s feature", low=0)
    width = transcoders.layer(layer).d_transcoder
    if feature >= width:
        raise InputError(
            f"{what}: layer {layer}'s transcoder has features 0 … {width - 1}; there is no feature {feature}"
        )


def _edit(transcoders: TranscoderSet, layer: int, feature: int, positions, edited: Callable, name: str) -> Replace:
    """The `Replace` that writes ``y + (edited(a_f) − a_f) · W_dec[f]`` at layer ``layer``'s MLP output."""
    tc = transcoders.layer(layer)
    positions = as_positions(positions)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a_f = tc.encode(x.to(tc.W_enc.device, tc.dtype))[:, feature]
        change = ((edited(a_f) - a_f)[:, None] * tc.W_dec[feature]).to(y.device)
        return (y.to(tc.dtype) + change).to(y.dtype)

    fn.__name__ = f"{name}(layer {layer}, feature {feature})"
    return Replace(MlpOut(layer), fn, reads=(MlpIn(layer), MlpOut(layer)), positions=positions)


def remove_feature(transcoders: TranscoderSet, layer: int, feature: int, positions="all") -> Replace:
    """Feature ``feature`` of layer ``layer``'s transcoder zeroed at ``positions``, the error term held
    (see the module's docstring): an intervention for `countlens.circuits.intervene`."""
    _checked(transcoders, layer, feature, "remove_feature")
    return _edit(transcoders, layer, feature, positions, torch.zeros_like, "remove_feature")


def clamp_feature(transcoders: TranscoderSet, layer: int, feature: int, value: float, positions="all") -> Replace:
    """Feature ``feature`` of layer ``layer``'s transcoder set to ``value`` at ``positions`` (on or
    off before), the error term held. Any finite value: a negative one, which no TopK / ReLU feature
    reaches, writes against the feature's direction (an experiment beyond the transcoder's range)."""
    _checked(transcoders, layer, feature, "clamp_feature")
    value = require_finite(value, "clamp_feature's value (a feature activation)")
    return _edit(transcoders, layer, feature, positions, lambda a: torch.full_like(a, value), "clamp_feature")


def steer_feature(transcoders: TranscoderSet, layer: int, feature: int, factor: float, positions="all") -> Replace:
    """Feature ``feature`` of layer ``layer``'s transcoder multiplied by ``factor`` at ``positions``
    (2 doubles it, 0 removes it), the error term held."""
    _checked(transcoders, layer, feature, "steer_feature")
    factor = require_finite(factor, "steer_feature's factor (2 doubles the feature, 0 removes it)")
    return _edit(transcoders, layer, feature, positions, lambda a: factor * a, "steer_feature")
