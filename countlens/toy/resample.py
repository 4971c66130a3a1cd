"""Resampling heads inside a Hugging Face Qwen2-VL forward, through the engine's torch hooks: the
interventions planted-circuit training and its checks are made of (`countlens.toy.planted` defines the
circuits).

A head's z is its slice of the attention output projection's input; resampling it replaces that slice,
at chosen positions, with a *source* run's — another sample of the same batch, recorded first
(`recorded`, then `swap_source`). A layer made blind to the image takes its keys and values at the
image positions from the source too. These hooks act on the model being trained, outside nnsight, so
that the losses' gradients flow through them; the modules are the family spec's (`resolve`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from countlens.circuits.engine import Hook, hooked
from countlens.errors import InputError
from countlens.model.arch import resolve
from countlens.toy.planted import PlantedNode

#: Donors of a resampled head (`countlens.toy.strictness`): the pair's partner (the same objects,
#: another count), another scene of a different count, another scene of the same count.
DONORS: tuple[str, ...] = ("partner", "different", "same")


@contextmanager
def recorded(model) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record every layer's z (o_proj's input), pre-RoPE keys and values, and MLP output during the
    forwards inside."""
    arch = resolve(model.config)
    n = arch.n_layers
    rec: dict[str, list] = {"z": [None] * n, "k": [None] * n, "v": [None] * n, "mlp": [None] * n}

    def keep(name, layer):
        def hook(t):
            rec[name][layer] = t.detach()

        return hook

    hooks = []
    for layer in range(n):
        hooks += [
            Hook(arch.mlp(layer), "output", keep("mlp", layer)),
            Hook(arch.o_proj(layer), "input", keep("z", layer)),
            Hook(arch.k_proj(layer), "output", keep("k", layer)),
            Hook(arch.v_proj(layer), "output", keep("v", layer)),
        ]
    with hooked(model, hooks):
        yield rec


def position_masks(input_ids: torch.Tensor, image_id: int, vision_end_id: int) -> dict[str, torch.Tensor]:
    """(B, T) boolean masks of `POSITIONS` and of the image tokens."""
    last = torch.zeros_like(input_ids, dtype=torch.bool)
    last[:, -1] = True
    return {
        "all": torch.ones_like(input_ids, dtype=torch.bool),
        "last": last,
        "vision_end": input_ids == vision_end_id,
        "image": input_ids == image_id,
    }


def keep_masks(
    heads: Iterable[PlantedNode], masks: dict[str, torch.Tensor], n_layers: int, n_heads: int
) -> torch.Tensor:
    """(layers, B, T, heads) True where a head node of ``heads`` is kept (at its ``at`` positions)."""
    b, t = masks["all"].shape
    keep = torch.zeros(n_layers, b, t, n_heads, dtype=torch.bool)
    for n in heads:
        if not n.is_mlp:
            keep[n.layer, :, :, n.head] |= masks[n.at]
    return keep


def mlp_keep_masks(nodes: Iterable[PlantedNode], masks: dict[str, torch.Tensor], n_layers: int) -> torch.Tensor:
    """(layers, B, T) True where an MLP node of ``nodes`` is kept (at its ``at`` positions)."""
    b, t = masks["all"].shape
    keep = torch.zeros(n_layers, b, t, dtype=torch.bool)
    for n in nodes:
        if n.is_mlp:
            keep[n.layer] |= masks[n.at]
    return keep


@contextmanager
def resampled(
    model,
    source: dict[str, list[torch.Tensor]],
    take_source: torch.Tensor,
    blind: dict[int, torch.Tensor] | None = None,
    take_mlp: torch.Tensor | None = None,
) -> Iterator[None]:
    """Forwards inside take each head's z from ``source`` where ``take_source`` (layers, B, T, heads) is
    True, each MLP's output where ``take_mlp`` (layers, B, T) is; layers in ``blind`` take their keys
    and values from ``source`` at the (B, T) mask given."""
    arch, hooks = resolve(model.config), []

    def take(name, layer, where):
        return lambda out: torch.where(where[..., None], source[name][layer], out)

    for layer in range(take_source.shape[0]):
        if take_mlp is not None and take_mlp[layer].any():
            hooks.append(Hook(arch.mlp(layer), "output", take("mlp", layer, take_mlp[layer])))
        mask = take_source[layer]
        if mask.any():

            def z_hook(z, layer=layer, mask=mask):
                b, t, d = z.shape
                h = mask.shape[-1]
                mixed = torch.where(mask[..., None], source["z"][layer].view(b, t, h, -1), z.view(b, t, h, -1))
                return mixed.reshape(b, t, d)

            hooks.append(Hook(arch.o_proj(layer), "input", z_hook))
        if blind and layer in blind:
            hooks += [Hook(arch.k_proj(layer), "output", take("k", layer, blind[layer]))]
            hooks += [Hook(arch.v_proj(layer), "output", take("v", layer, blind[layer]))]
    with hooked(model, hooks):
        yield


def swap_source(rec: dict[str, list[torch.Tensor]], order: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """The recording with its batch reordered: sample i's source is sample ``order[i]``."""
    return {k: [x[order] for x in v] for k, v in rec.items()}


@contextmanager
def image_features_once(model) -> Iterator[None]:
    """Inside, the vision tower runs once per pixel tensor, however many forwards read it: the
    resampling forwards of one batch share their images, and the tower (frozen while a circuit is
    planted) is most of a forward's cost."""
    inner = model.model
    original = inner.get_image_features
    memo: dict = {}

    def once(pixel_values, image_grid_thw=None, **kw):
        key = (pixel_values.data_ptr(), tuple(pixel_values.shape))
        if key not in memo:
            memo.clear()
            with torch.no_grad():  # frozen: no gradient flows into the tower
                memo[key] = original(pixel_values, image_grid_thw, **kw)
        return memo[key]

    inner.get_image_features = once
    try:
        yield
    finally:
        del inner.get_image_features  # the class's method again


def donor_order(
    answers: torch.Tensor, partner: torch.Tensor, kind: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, found): sample i's donor is ``order[i]``, drawn uniformly among the batch's samples of
    ``kind`` (`DONORS`); ``found[i]`` is False where the batch holds none (``order[i]`` is then i)."""
    if kind == "partner":
        return partner.clone(), torch.ones(len(answers), dtype=torch.bool)
    if kind not in DONORS:
        raise InputError(f"donor kind {kind!r}: choose one of {DONORS}")
    b = len(answers)
    idx = torch.arange(b)
    same = answers[:, None] == answers[None, :]
    allowed = (same if kind == "same" else ~same) & (idx[:, None] != idx[None, :])
    allowed[idx, partner] = False  # another scene, never the partner's objects
    weights = allowed.float() + 1e-12 * (~allowed).float()  # multinomial needs a positive row
    order = torch.multinomial(weights, 1, generator=gen).squeeze(1)
    found = allowed.any(1)
    return torch.where(found, order, idx), found
