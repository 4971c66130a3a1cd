"""Keeping a transcoder's features alive while it trains: AuxK (Gao et al. 2024, "Scaling and evaluating
sparse autoencoders").

A feature that has not fired (been among a token's ``k`` active ones) for `DEAD_AFTER` steps counts as
*dead*. On every step the `AUX_K` largest pre-activations among the dead features, through ReLU, must
reconstruct what the live features left: the batch's error ``e = y − ŷ`` (detached, so only the dead
features learn from it) through their decoder rows, ``ê = a_aux @ W_dec``. The term is weighted
`AUX_WEIGHT` and added to the main loss. Its normalisation is ``aux_norm``:

- ``"error"`` (the default): ``Σ‖ê − e‖² / Σ‖e‖²`` over the batch, as in Gao et al.'s code
  (``normalized_mean_squared_error`` of the AuxK reconstruction against the residual). The term is a
  share of the error, so its gradients keep their size however small the error gets. *countlens's
  choice*: one ratio of the batch's sums, where their code averages the ratio per token.
- ``"variance"``: ``Σ‖ê − e‖² / (batch_tokens · Σ var(y))``, normalised like the main loss (countlens's
  rule before issue 77). Once the main FVU is about 0.02, the term is about 50 times smaller than
  ``"error"``'s, and Adam's updates of the dead features' rows shrink with it: on the organism it left
  23–47 % of each layer's features dead, against 7–37 % with ``"error"`` (`bench/transcoders.py`).
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
