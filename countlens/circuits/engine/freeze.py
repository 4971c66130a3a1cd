"""Freezing norms and attention: the one way a linearised method holds them constant.

A method that reads a model as linear in its residual stream holds two things constant: each norm's
scale (RMSNorm's 1 / rms(x): the norm is then linear in x) and each softmax layer's attention pattern
(q and k constant: attention is then linear in v). `frozen(vlm, norms=..., attention=...)` does both,
through the engine's hooks (`countlens.circuits.engine.hooks`), at the modules the family spec names:
every layer's norms (`Arch.norms`) and the final norm, every layer's q and k projections (a fused qkv
projection's q and k columns). Each argument is one of:

- ``None``: not frozen;
- ``"detach"``: held at this forward's own values. The forward computes what it would; gradients see
  the held quantities as constants: a norm's output is y = x · (y / x) with the ratio detached (0 where
  x = 0), q and k are detached. RelP's rules (`countlens.circuits.methods.relp`) use it.
- a `Clamp` recorded during a clean run (`Clamp.hooks` in that forward, then `Clamp.close`): held at
  that run's values in any later forward, on any input: an RMSNorm's output is w ⊙ (x · s_clean), q and
  k the clean run's (repeated over the rows). The attribution graph's local replacement model
  (`countlens.features.graph`) uses it. `Clamp.only(paths)` holds those norms alone.

Freezing attention is defined for softmax self-attention layers; a model with cross- or
linear-attention layers is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from countlens.circuits.engine.hooks import Hook, hooked, module_of
from countlens.circuits.sites import first_arg
from countlens.errors import InputError

if TYPE_CHECKING:
    from countlens.model.vlm import VLM

MODES: tuple[str, ...] = ("detach",)


def norm_paths(vlm: VLM) -> list[str]:
    """Every norm on the residual stream's path: each layer's (`Arch.norms`), then the final norm."""
    arch = vlm.arch
    return [path for layer in range(arch.n_layers) for path in arch.norms(layer)] + [arch.final_norm]


def qk_paths(vlm: VLM) -> list[str]:
    """Each layer's q and k projections (one path per layer for a fused qkv projection)."""
    arch = vlm.arch
    odd = [layer for layer in range(arch.n_layers) if arch.kind(layer) not in ("full", "sliding")]
    if odd:
        raise InputError(
            f"{vlm.name}'s layers {odd} are {arch.kind(odd[0])}-attention layers: freezing attention is defined for "
            "softmax self-attention only; use a model whose layers all are"
        )
    if arch.spec.fused_qkv:
        return [arch.q_proj(layer) for layer in range(arch.n_layers)]
    return [path for layer in range(arch.n_layers) for path in (arch.q_proj(layer), arch.k_proj(layer))]


def frozen_ratio(y: Tensor, x: Tensor) -> Tensor:
    """x·(y/x) with the ratio detached: y's value, and ∂/∂x the ratio (0 where x = 0)."""
    ratio = torch.where(x == 0, torch.zeros_like(y), y / torch.where(x == 0, torch.ones_like(x), x))
    return x * ratio.detach()


def rms_scale(module: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """An RMSNorm's scale s = 1 / sqrt(mean x² + ε) on ``x`` (its input), checked against its output ``y``
    = w ⊙ (x · s); an `InputError` for a norm of another form."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None or getattr(module, "weight", None) is None:
        raise InputError(f"{type(module).__name__} is no RMSNorm with a weight: countlens cannot freeze it")
    exact = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    # Compared in float32, within the output's rounding: a bfloat16 norm (HF's: normalised in float32,
    # rounded, times w) is off its float32 value by about two of bfloat16's ulps.
    tol = max(1e-4, 2 * torch.finfo(y.dtype).eps)
    if not torch.allclose(module.weight.float() * (x.float() * exact), y.float(), rtol=tol, atol=1e-5):
        raise InputError(
            f"{type(module).__name__} is not weight · x / rms(x): countlens freezes RMSNorm models (as the organism, "
            "Qwen2-VL) only"
        )
    return exact.to(x.dtype)


@dataclass
class Clamp:
    """The values a clean run had where `frozen` holds them: per norm path its RMSNorm scale, per q / k
    path its output. Fill it with ``hooks`` in the clean forward, then call ``close``."""

    scales: dict[str, Tensor] = field(default_factory=dict)
    qk: dict[str, Tensor] = field(default_factory=dict)
    _seen: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    def hooks(self, vlm: VLM) -> list[Hook]:
        """Hooks that record the clean run's q / k outputs and each norm's input and output."""

        def keep_qk(path):
            return lambda y: self.qk.update({path: y.detach()})

        def keep_norm(path):
            return lambda m, args, kwargs, out: self._seen.update({path: (first_arg(args, kwargs), out)})

        return [Hook(p, "output", keep_qk(p)) for p in qk_paths(vlm)] + [
            Hook(p, "after", keep_norm(p)) for p in norm_paths(vlm)
        ]

    def only(self, norms: list[str]) -> Clamp:
        """A Clamp holding these ``norms``' scales alone (no q / k): `frozen` with it holds those norms
        and leaves the others live."""
        unknown = [p for p in norms if p not in self.scales]
        if unknown:
            raise InputError(f"Clamp.only: {unknown} are no recorded norms; give paths of {list(self.scales)}")
        return Clamp(scales={p: self.scales[p] for p in norms})

    def close(self, vlm: VLM) -> Clamp:
        """Each norm's scale from what the clean run recorded (refusing a norm that is no RMSNorm)."""
        for path in norm_paths(vlm):
            x, y = self._seen.pop(path)
            self.scales[path] = rms_scale(module_of(vlm.hf, path), x, y)
        return self


def _norm_hooks(vlm: VLM, norms) -> list[Hook]:
    if norms is None:
        return []
    if isinstance(norms, Clamp):

        def clamp(scale):
            return lambda m, args, kwargs, out: m.weight * (first_arg(args, kwargs) * scale)

        if not norms.scales:
            raise InputError("this Clamp holds no norm scales: record a clean run with Clamp.hooks, then call close")
        return [Hook(p, "after", clamp(scale)) for p, scale in norms.scales.items()]
    return [
        Hook(p, "after", lambda m, args, kwargs, out: frozen_ratio(out, first_arg(args, kwargs).to(out.dtype)))
        for p in norm_paths(vlm)
    ]


def _attention_hooks(vlm: VLM, attention) -> list[Hook]:
    if attention is None:
        return []
    paths, arch = qk_paths(vlm), vlm.arch
    if not arch.spec.fused_qkv:
        if isinstance(attention, Clamp):

            def clamp(value):
                return lambda y: value.expand(y.shape[0], *value.shape[1:])

            return [Hook(p, "output", clamp(attention.qk[p])) for p in paths]
        return [Hook(p, "output", lambda y: y.detach()) for p in paths]

    def fused(layer):  # q, then k, then v columns: q and k held (detached, or the clean run's), v live
        q = arch.heads(layer) * arch.head_dim(layer)
        clean = attention.qk[arch.q_proj(layer)] if isinstance(attention, Clamp) else None

        def hook(y):
            k = (y.shape[-1] - q) // 2
            held = (
                y[..., : q + k].detach()
                if clean is None
                else clean[..., : q + k].expand(y.shape[0], *y.shape[1:-1], -1)
            )
            return torch.cat([held.to(y.dtype), y[..., q + k :]], -1)

        return hook

    return [Hook(arch.q_proj(layer), "output", fused(layer)) for layer in range(arch.n_layers)]


def _checked(what: str, value) -> None:
    if value is not None and not isinstance(value, Clamp) and value not in MODES:
        raise InputError(f"frozen's {what} is None, 'detach' or a Clamp of a recorded run; got {value!r:.80}")


@contextmanager
def frozen(vlm: VLM, norms: str | Clamp | None = None, attention: str | Clamp | None = None) -> Iterator[None]:
    """Inside: every forward of ``vlm`` runs with its norms and attention held (see the module docstring)."""
    _checked("norms", norms)
    _checked("attention", attention)
    with hooked(vlm.hf, _attention_hooks(vlm, attention) + _norm_hooks(vlm, norms)):
        yield
