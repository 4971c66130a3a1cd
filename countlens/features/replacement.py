"""The replacement model: the model with every MLP swapped for its transcoder.

In circuit tracing (Ameisen et al. 2025) the *replacement model* is the original model in which each
layer's MLP output ``y = MLP(x)`` is replaced by its transcoder's reconstruction
``ŷ = decode(encode(x))`` (``+ x @ W_skip.T`` for a skip transcoder). The gap ``y − ŷ`` is the
*error term*; a *local* replacement model adds it back (and so reproduces the model exactly on one
prompt), the replacement model here drops it, so its outputs show how much of the model's behaviour
the features alone carry. Attention, norms and embeddings stay the model's own; an MLP's input
``x`` is whatever the (already replaced) layers below produce, so errors compound with depth.

`replacement` installs the swap for the duration of a ``with`` block, in the interventions' vocabulary:
``Replace(MlpOut(l), transcoder, reads=MlpIn(l))`` per covered layer under `countlens.circuits.intervene`
(at every real token; a padding position keeps the MLP's own output, which no real token reads); any
forward inside it — `VLM.forward`, scoring, generation — runs the replacement model.
`replacement_accuracy` scores counting samples with countlens's own scoring
(`countlens.analysis.evaluate.score`) on the original and on the replacement model, side by side.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from countlens.analysis.evaluate import score
from countlens.circuits.engine.interventions import Replace
from countlens.circuits.engine.run import intervene
from countlens.circuits.sites import MlpIn, MlpOut
from countlens.errors import InputError
from countlens.features.transcoder import Transcoder, TranscoderSet
from countlens.model.arguments import require_vlm
from countlens.model.vlm import check_samples
from countlens.results import provenance
from countlens.validate import require_count

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


def check_fits(vlm: VLM, transcoders: TranscoderSet, what: str) -> None:
    """An `InputError` unless ``transcoders`` is a set whose layers and d_model are ``vlm``'s."""
    if not isinstance(transcoders, TranscoderSet):
        raise InputError(
            f"{what} takes a TranscoderSet (train_transcoders or load_transcoders), got {type(transcoders).__name__}"
        )
    name = vlm.name or vlm.arch.name
    if transcoders.d_model != vlm.arch.d_model:
        raise InputError(
            f"{what}: the transcoders read d_model {transcoders.d_model}, but {name}'s hidden size is "
            f"{vlm.arch.d_model}: a set trained for another model"
        )
    outside = [layer for layer in transcoders.layers if layer >= vlm.arch.n_layers]
    if outside:
        raise InputError(f"{what}: the set covers layers {outside}, but {name} has layers 0 … {vlm.arch.n_layers - 1}")


def reconstruction(tc: Transcoder):
    """x ↦ ``tc``'s reconstruction of the MLP's output from its input x (in the transcoder's dtype)."""

    def transcoder(x: torch.Tensor) -> torch.Tensor:
        return tc(x.to(tc.dtype))

    return transcoder


@contextmanager
def replacement(vlm: VLM, transcoders: TranscoderSet) -> Iterator[VLM]:
    """``with replacement(vlm, transcoders): …`` — inside, each covered layer's MLP output is its
    transcoder's reconstruction (error terms dropped); the hooks go when the block ends, whatever
    happens in it. Yields ``vlm``."""
    require_vlm(vlm, "replacement")
    check_fits(vlm, transcoders, "replacement")
    swaps = [Replace(MlpOut(layer), reconstruction(tc), reads=MlpIn(layer)) for layer, tc in transcoders.items()]
    with intervene(vlm, swaps), torch.no_grad():
        yield vlm


def check_graphable(vlm: VLM, transcoders: TranscoderSet, sample, what: str) -> None:
    """Refuse, before any forward, what the local replacement model cannot be built for: a set without a
    transcoder for every layer, a remote model, fused / cross / expert / linear attention, a list of samples."""
    require_vlm(vlm, what)
    check_fits(vlm, transcoders, what)
    if transcoders.layers != tuple(range(vlm.arch.n_layers)):
        raise InputError(
            f"{what} needs a transcoder for every layer (0 … {vlm.arch.n_layers - 1}); the set covers "
            f"{list(transcoders.layers)}: train with layers=None"
        )
    if vlm.remote:
        raise InputError(f"{what} runs the frozen model locally; load the model locally, not on NDIF")
    spec = vlm.arch.spec
    if spec.fused_qkv or spec.cross_attention is not None or spec.moe is not None or spec.linear_attention:
        raise InputError(
            f"{what} freezes attention through separate q_proj/k_proj on self-attention models; "
            f"{vlm.arch.name} has fused, cross, expert or linear layers"
        )
    if isinstance(sample, (list, tuple)):
        raise InputError(f"{what} takes one sample (task_samples(...)[0]), not a list")
    check_samples([sample], what)


def replacement_accuracy(
    vlm: VLM, transcoders: TranscoderSet, samples: Sequence, batch_size: int = 32, progress: bool = False
) -> xr.Dataset:
    """The accuracy of the original and of the replacement model on ``samples`` (countlens's scoring,
    `countlens.analysis.evaluate.score`): an `xr.Dataset` with ``accuracy`` over ``model``
    (original, replacement), ``correct`` and ``pred`` over (``model``, ``sample``), and ``agreement``
    (the share of samples whose predicted answer is the same in both)."""
    require_vlm(vlm, "replacement_accuracy")
    check_fits(vlm, transcoders, "replacement_accuracy")
    check_samples(samples, "replacement_accuracy")
    require_count(batch_size, "batch_size")
    original = score(vlm, samples, batch_size=batch_size, progress=progress)
    with replacement(vlm, transcoders):
        replaced = score(vlm, samples, batch_size=batch_size, progress=progress)
    models = ["original", "replacement"]
    correct = np.stack([original["correct"].values, replaced["correct"].values]).astype(bool)
    pred = np.stack([original["pred"].values.astype(str), replaced["pred"].values.astype(str)]).astype(object)
    ds = xr.Dataset(
        {
            "correct": (("model", "sample"), correct),
            "pred": (("model", "sample"), pred),
            "accuracy": ("model", correct.mean(1)),
            "gold": ("sample", original["gold"].values),
            "count": ("sample", original["count"].values),
        },
        coords={"model": models, "sample": np.arange(len(samples))},
    )
    ds["agreement"] = float((pred[0] == pred[1]).mean())
    ds.attrs.update(
        provenance(
            vlm.name,
            vlm.arch.name,
            dataset={"samples": len(samples)},
            samples=samples,
            transcoders=transcoders.scan or "unnamed",
            layers=list(transcoders.layers),
            scoring=str(original.attrs.get("method", "")),
        )
    )
    return ds
