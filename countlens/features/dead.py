"""Keeping a transcoder's features alive while it trains: AuxK (Gao et al. 2024, "Scaling and evaluating
sparse autoencoders").

A feature that has not fired (been among a token's ``k`` active ones) for `DEAD_AFTER` steps counts as
*dead*. On every step the `AUX_K` largest pre-activations among the dead features, through ReLU, must
reconstruct what the live features left: the batch's error ``e = y − ŷ`` (detached, so only the dead
features learn from it) through their decoder rows, ``ê = a_aux @ W_dec``. The term is weighted
`AUX_WEIGHT` and added to the main loss. Its normalisation is ``aux_norm``:

- ``"error"`` (the default): ``Σ‖ê − e‖² / Σ‖e‖²`` over the batch, the share of the error's energy
  the dead features leave, adapted from Gao et al.'s code (openai/sparse_autoencoder's ``train.py``:
  the AuxK reconstruction's ``normalized_mse`` against the residual), which divides by the error's
  variance over the batch, ``Σ‖e − ē‖²``. The term is a share of the error, so it keeps its size
  however small the error gets. *countlens's choice*: the error's energy; dividing by its variance
  instead leaves 2 and 7 fewer features dead on layers 0 and 4 of the organism at an FVU 0.0001 higher
  (``bench/transcoder_variants.py``).
- ``"variance"``: ``Σ‖ê − e‖² / (batch_tokens · Σ var(y))``, normalised like the main loss by the
  outputs' variance. The term shrinks with the main error as training goes (from FVU 1 to about
  0.02), while Adam divides each update by a running average of past squared gradients, so the dead
  features' rows barely move. On the organism it leaves 23–47 % of each layer's features dead, against
  9–37 % with ``"error"``, at a higher FVU (`bench/transcoders.py`).
"""

from __future__ import annotations

import torch

from countlens.validate import require_choice

#: A feature that has not fired for this many steps is dead.
DEAD_AFTER = 50
#: The dead features' pre-activations kept per token, and the weight of their loss.
AUX_K, AUX_WEIGHT = 64, 1 / 32
#: How the AuxK loss is normalised (the module's docstring); the first is the default.
AUX_NORMS: tuple[str, ...] = ("error", "variance")
AUX_NORM = AUX_NORMS[0]


def require_aux_norm(value) -> str:
    """One of `AUX_NORMS`; an `InputError` naming them otherwise."""
    return require_choice(value, "aux_norm", AUX_NORMS)


def auxk_loss(
    pre: torch.Tensor,
    W_dec: torch.Tensor,
    error: torch.Tensor,
    dead: torch.Tensor,
    scale: float,
    aux_norm: str = AUX_NORM,
) -> torch.Tensor | None:
    """The AuxK term, unweighted (None when no feature is dead): the `AUX_K` largest ``pre``
    ``(tokens, width)`` among the ``dead`` ``(width,)`` features, through ReLU, reconstruct ``error``
    ``(tokens, d_model)`` (detached here) through ``W_dec``; normalised by ``aux_norm``: the error's
    energy, or ``len(pre) · scale`` (``scale`` the outputs' total variance)."""
    n_dead = int(dead.sum())
    if not n_dead:
        return None
    values, index = pre.masked_fill(~dead, float("-inf")).topk(min(n_dead, AUX_K), dim=-1)
    a_aux = torch.zeros_like(pre).scatter(-1, index, values.relu())
    error = error.detach()
    sse = ((a_aux @ W_dec - error) ** 2).sum()
    if aux_norm == "error":
        return sse / (error**2).sum().clamp_min(torch.finfo(error.dtype).tiny)
    return sse / (len(pre) * scale)
