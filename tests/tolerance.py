"""Tolerances for float32 results computed two ways, portable across CPUs' kernels.

Two computations of one quantity in float32 — another batch shape, padding, kernel (AVX-512, AVX2,
the portable default; MKL or oneDNN), thread count or order of a sum — agree only up to rounding,
and rounding is relative to the *magnitudes summed*, not to the result: a logit difference of 0.01
between logits of size 3 carries the rounding of numbers of size 3. So every comparison here is
bounded by ``F32_REL × scale``, where ``scale`` is the size of the underlying values (the logits, the
activations), and a ratio such as the patching effect by that bound over its denominator. Where
countlens promises bit-identity (same process, same kernels: β = 1, a resumed store), tests compare
exactly instead. ``COUNTLENS_TOL_LOG=FILE`` appends each comparison's worst |a − b| / bound, so the
margin can be measured under other kernels (``make test-kernels``).
"""

from __future__ import annotations

import os

import numpy as np
import torch

#: Rounding budget relative to the scale: 1e-5 ≈ 84 float32 ulps (2⁻²³ ≈ 1.2e-7), enough for a few
#: hundred rounded ops compounded over a tiny model's depth. Measured (docs/getting-started.md, "Tests"):
#: every comparison within 0.09 of its bound on this CPU's AVX-512 kernels and under the three other
#: choices of make test-kernels (HeadLens's solve, 0.25, gets its own allowance); a wrong patch or
#: edit is off by about the scale itself, 10⁵ bounds away.
F32_REL = 1e-5


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(getattr(x, "values", x), dtype=np.float64)


def scale_of(*values) -> float:
    """The largest magnitude among ``values`` (tensors, arrays, xarray), at least 1: logits and
    log-probabilities are O(1) or more, and a probability or share inherits their rounding."""
    return max(1.0, *(float(np.abs(_np(v)).max()) for v in values))


def bound(scale: float) -> float:
    """The absolute tolerance for two float32 computations of values of size ``scale``."""
    return F32_REL * scale


def _log(worst: float, what: str) -> None:
    path = os.environ.get("COUNTLENS_TOL_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{worst:.6g}\t{what}\t{test}\n")


def assert_close(actual, desired, *, scale: float | None = None, what: str = "values") -> None:
    """|actual − desired| ≤ F32_REL × scale everywhere; ``scale`` defaults to `scale_of` the values (give
    the logits' size when comparing what was derived from them, e.g. logit differences)."""
    a, d = _np(actual).astype(np.float64), _np(desired).astype(np.float64)
    if a.shape != d.shape:
        a, d = np.broadcast_arrays(a, d)
    s = scale_of(a, d) if scale is None else scale
    err = np.abs(a - d)
    worst = float(err.max() / bound(s)) if err.size else 0.0
    _log(worst, what)
    if not worst <= 1.0:
        i = np.unravel_index(int(np.nanargmax(err)), err.shape) if err.size else ()
        raise AssertionError(
            f"{what}: |actual - desired| reaches {float(err[i]):.3g} at {i} "
            f"({worst:.3g} × the bound {bound(s):.3g} = {F32_REL:g} × scale {s:.3g})"
        )


def assert_effect(
    effect, want, *, clean, corrupt, scale: float, what: str = "effect", want_rounded: bool = False
) -> None:
    """A patching effect, (Σ LD_patched − Σ LD_clean) / (Σ LD_corrupt − Σ LD_clean) over a sweep's
    pairs (``clean``, ``corrupt``: their LDs): each of the 2n summed LDs rounds by up to the logits'
    bound, so the effect's bound is 2n × that over the denominator, which a random-init model's
    pairs can make small; twice that when ``want`` is another computed effect (``want_rounded``)."""
    clean, corrupt = _np(clean).astype(np.float64), _np(corrupt).astype(np.float64)
    assert_normalised(
        effect,
        want,
        denominator=float(corrupt.sum() - clean.sum()),
        n=clean.size,
        scale=scale,
        what=what,
        want_rounded=want_rounded,
    )


def assert_normalised(
    effect, want, *, denominator: float, n: int, scale: float, what: str = "effect", want_rounded: bool = False
) -> None:
    """`assert_effect`'s rule for an effect normalised by a known ``denominator``
    (Σ LD_corrupt − Σ LD_clean over ``n`` pairs), e.g. an attribution estimate."""
    denominator = abs(denominator)
    err = np.abs(_np(effect).astype(np.float64) - _np(want))
    limit = (4 if want_rounded else 2) * n * bound(scale) / denominator
    worst = float(err.max() / limit)
    _log(worst, what)
    if not worst <= 1.0:
        raise AssertionError(
            f"{what}: off by {float(err.max()):.3g}, {worst:.3g} × its bound {limit:.3g} "
            f"(2n × {F32_REL:g} × logit scale {scale:.3g} / |Σ LD_corrupt − Σ LD_clean| = "
            f"{denominator:.3g})"
        )


def logit_scale(vlm, pb) -> float:
    """The largest |logit| of plain forwards of prepared pairs ``pb`` (`prepare_pairs`), clean and
    corrupt: the size whose rounding their logit differences inherit."""
    with torch.no_grad():
        return scale_of(vlm.forward(pb.clean).logits, vlm.forward(pb.corrupt).logits)
