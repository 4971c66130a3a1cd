"""Checks of the arguments that name a model and its parts: the model, its layers, a prepared batch.

The checks of plain values (counts, seeds, shares, fractions, sequences) are `countlens.validate`'s;
samples and pairs are `countlens.model.vlm.check_samples` / `check_pairs`. Each check names the argument,
what was given and the fix, and runs before any forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch

from countlens.errors import DeviceError, InputError
from countlens.model.vlm import VLM, Batch


def require_torch_device(device, what: str) -> torch.device:
    """A torch device this machine has: a name torch parses ('cpu', 'cuda', 'cuda:1'), and a CUDA one
    only where CUDA is available and the index is a visible GPU (`DeviceError` otherwise), so a wrong
    device is refused before any work rather than after it."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise InputError(
            f"{what}: device {device!r} is not a torch device ({err}); give e.g. 'cpu' or 'cuda'"
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceError(f"{what}: device {device!r}: {why}; give 'cpu' (or leave the device unset)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise DeviceError(
                f"{what}: device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible; "
                "give an index below that"
            )
    return parsed


def require_vlm(vlm, what: str) -> VLM:
    """A loaded model (`countlens.load`), not its name or a bare Hugging Face model."""
    if not isinstance(vlm, VLM):
        raise InputError(
            f"{what} takes a loaded model, got {type(vlm).__name__} {vlm!r:.60}: load one with "
            "countlens.load('toy') (or a checkpoint path)"
        )
    return vlm


def require_layers(vlm: VLM, layers, what: str, embeddings: bool = False) -> list[int] | None:
    """None, or a non-empty sequence of the model's decoder layers (with ``embeddings``, −1 too: the
    input of layer 0); each an integer in range."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes, dict)) or not isinstance(layers, Sequence) and not hasattr(layers, "tolist"):
        raise InputError(f"{what}: layers must be a list of layer indices, e.g. [0, 3]; got {layers!r:.60}")
    layers = list(layers.tolist() if hasattr(layers, "tolist") else layers)
    if not layers:
        raise InputError(f"{what}: layers is empty; give at least one layer, or None for every layer")
    for layer in layers:
        if not isinstance(layer, Integral) or isinstance(layer, bool):
            raise InputError(f"{what}: layer {layer!r} is no layer index; give integers, e.g. [0, 3]")
        if not (embeddings and layer == -1):
            vlm.arch.layer(int(layer))  # a LayerError naming the valid range
    return [int(layer) for layer in layers]


def require_batch(batch, what: str) -> Batch:
    """A prepared batch (`VLM.prepare` / `VLM.prepare_samples`)."""
    if not isinstance(batch, Batch):
        raise InputError(
            f"{what} takes a prepared batch, got {type(batch).__name__}: prepare one with vlm.prepare_samples(samples)"
        )
    return batch
