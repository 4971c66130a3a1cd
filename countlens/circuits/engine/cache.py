"""The engine's one cache: recorded values (and gradients) keyed by site, readable by label.

`countlens.circuits.engine.record.record` returns a `Cache`: ``cache[HeadZ(0, 1)]`` is that head's value
over the batch, Float[Tensor, "batch seq d_head"]; ``cache["L0H1"]`` is the same entry by its label (any
site's ``label``); ``cache.grad[site]`` is the gradient of a recorded metric there, where one was asked
for. Views a method needs:

- ``heads(layer)``: the recorded heads of a layer stacked, Float[Tensor, "heads batch seq d_head"], in head
  order (each recorded head of that layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.sites import HeadZ
from countlens.errors import InputError

if TYPE_CHECKING:
    from countlens.circuits.sites import Site


class Cache(dict):
    """Values keyed by site (see the module docstring); ``grad``: gradients keyed alike (empty when no
    metric was asked for); ``logits``: the recorded forward's logits at the read position."""

    def __init__(self, values: dict | None = None, grad: dict | None = None, logits: Tensor | None = None):
        super().__init__(values or {})
        self.grad: dict = grad if isinstance(grad, Cache) else _Grads(grad or {})
        self.logits = logits  # the read position's logits of the recorded forward, (batch, vocab)

    def site(self, key: Site | str) -> Site:
        """The recorded site ``key`` names: the site itself, or its label."""
        if not isinstance(key, str):
            return key
        for site in self:
            if getattr(site, "label", None) == key:
                return site
        raise KeyError(f"no recorded site is labelled {key!r}; recorded: {', '.join(self.labels) or 'none'}")

    def __getitem__(self, key):
        return super().__getitem__(self.site(key))

    def __contains__(self, key) -> bool:
        try:
            site = self.site(key)
        except KeyError:
            return False
        return super().__contains__(site)

    def get(self, key, default=None):
        return self[key] if key in self else default

    @property
    def labels(self) -> list[str]:
        return [getattr(site, "label", repr(site)) for site in self]

    def heads(self, layer: int) -> Tensor:
        """Layer ``layer``'s recorded heads stacked, (heads, batch, seq, d_head), in head order."""
        mine = sorted((s for s in self if isinstance(s, HeadZ) and s.layer == layer), key=lambda s: s.head)
        if not mine:
            raise InputError(
                f"no head of layer {layer} was recorded; record HeadZ({layer}, h) for the heads you want stacked"
            )
        return torch.stack([super(Cache, self).__getitem__(s) for s in mine])


class _Grads(Cache):
    """A `Cache`'s gradients: keyed by site, readable by label, with no gradients of their own."""

    def __init__(self, values: dict):
        dict.__init__(self, values)
        self.grad = {}
        self.logits = None
