"""Gradients of activations only: the parameters set aside while a backward pass runs.

Attribution methods (AtP, AtP*, EAP-IG on nodes and edges) need ∂metric/∂activation, never a
parameter's gradient; with every parameter's ``requires_grad`` off for the pass, autograd allocates no
``.grad`` buffer the size of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def activation_gradients_only(model: torch.nn.Module) -> Iterator[None]:
    """Inside: no parameter of ``model`` requires a gradient; on exit each one that did, does again."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
