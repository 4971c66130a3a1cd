"""Per-layer transcoders: a sparse, wide stand-in for each MLP of a model.

A transcoder (Dunefsky et al. 2024; Ameisen et al. 2025, "Circuit Tracing") is trained to do what one
MLP does — map the MLP's input ``x`` (the residual stream after ``post_attention_layernorm``,
``d_model`` wide) to the MLP's output ``y`` (what the MLP adds to the residual stream) — but through
``d_transcoder`` features of which only a few are active on any token::

    pre     = x @ W_enc.T + b_enc                      # (…, d_transcoder)
    a       = act(pre)                                 # sparse feature activations
    y_hat   = a @ W_dec + b_dec  (+ x @ W_skip.T)      # (…, d_model)

Shapes are circuit-tracer's: ``W_enc (d_transcoder, d_model)``, ``b_enc (d_transcoder,)``,
``W_dec (d_transcoder, d_model)`` (row ``i`` is feature ``i``'s write to the residual stream),
``b_dec (d_model,)``, optional ``W_skip (d_model, d_model)`` (a linear skip path, Paulo et al. 2025).

The activation ``act`` is one of

- ``topk`` — keep the ``k`` largest pre-activations of each token, zero the rest, and pass the kept
  ones through ReLU (Gao et al. 2024's TopK): at most ``k`` features are active, exactly ``k`` when
  the ``k``-th largest pre-activation is positive. *countlens's choice*: circuit-tracer's published
  TopK keeps the kept values as they are; the ReLU here keeps every activation ≥ 0, so a feature
  writes its decoder row with one sign only.
- ``jumprelu`` — ``x * (x > threshold)`` with one ``threshold`` per feature (Rajamanoharan et al.
  2024; GemmaScope's transcoders): stored as ``activation_function.threshold``.
- ``relu`` — ``max(x, 0)``.

One transcoder per layer makes a `TranscoderSet`; all share ``d_transcoder``. Its
``feature_input_hook`` (``mlp.hook_in``) and ``feature_output_hook`` (``mlp.hook_out``) name where
the features read and write in circuit-tracer's (TransformerLens) terms; in a Hugging Face model they
are the input and the output of the decoder layer's ``mlp`` module
(the family spec's MLP, `countlens.model.arch.Arch.mlp`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from countlens.errors import InputError
from countlens.validate import (
    require_bool,
    require_choice,
    require_count,
    require_integer,
    require_sequence,
    require_text,
)

#: The activations a transcoder may use (circuit-tracer's names).
ACTIVATIONS: tuple[str, ...] = ("topk", "jumprelu", "relu")
#: Where a set's features read and write, in circuit-tracer's hook names.
FEATURE_INPUT_HOOK = "mlp.hook_in"
FEATURE_OUTPUT_HOOK = "mlp.hook_out"


def require_float_dtype(dtype, name: str) -> torch.dtype:
    """A floating torch dtype (torch.float32, torch.bfloat16 …): what a transcoder's weights are held in."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"{name} must be a floating torch dtype such as torch.float32, got {dtype!r:.60}")
    return dtype


class TopK(nn.Module):
    """The ``k`` largest pre-activations of each row, through ReLU; every other entry 0."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, pre: torch.Tensor) -> torch.Tensor:
        values, index = pre.topk(min(self.k, pre.shape[-1]), dim=-1)
        return torch.zeros_like(pre).scatter(-1, index, values.relu())

    def extra_repr(self) -> str:
        return f"k={self.k}"


class JumpReLU(nn.Module):
    """``x * (x > threshold)``, one threshold per feature (a buffer: countlens does not train it)."""

    def __init__(self, threshold: torch.Tensor):
        super().__init__()
        self.register_buffer("threshold", threshold)

    def forward(self, pre: torch.Tensor) -> torch.Tensor:
        return pre * (pre > self.threshold)


class ReLU(nn.Module):
    def forward(self, pre: torch.Tensor) -> torch.Tensor:
        return pre.relu()


class Transcoder(nn.Module):
    """One layer's transcoder (see the module's docstring); parameters start at zero, filled by
    training (`countlens.features.train`) or loading (`countlens.features.files`)."""

    def __init__(
        self,
        d_model: int,
        d_transcoder: int,
        activation: str = "topk",
        k: int | None = None,
        threshold: torch.Tensor | None = None,
        skip: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        require_count(d_model, "d_model")
        require_count(d_transcoder, "d_transcoder")
        require_choice(activation, "activation", ACTIVATIONS)
        skip = require_bool(skip, "skip")
        require_float_dtype(dtype, "dtype")
        if activation != "topk" and k is not None:
            raise InputError(f"k is for topk transcoders; a {activation} transcoder takes none")
        self.d_model, self.d_transcoder, self.activation = d_model, d_transcoder, activation
        self.W_enc = nn.Parameter(torch.zeros(d_transcoder, d_model, dtype=dtype))
        self.b_enc = nn.Parameter(torch.zeros(d_transcoder, dtype=dtype))
        self.W_dec = nn.Parameter(torch.zeros(d_transcoder, d_model, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(d_model, dtype=dtype))
        self.W_skip = nn.Parameter(torch.zeros(d_model, d_model, dtype=dtype)) if skip else None
        if activation == "topk":
            if k is None:
                raise InputError("a topk transcoder needs k (the features kept per token), e.g. k=16")
            require_count(k, "k")
            if k > d_transcoder:
                raise InputError(f"k={k} is more than the transcoder's {d_transcoder} features; give k ≤ width")
            self.activation_function: nn.Module = TopK(int(k))
        elif activation == "jumprelu":
            if threshold is None:
                threshold = torch.zeros(d_transcoder, dtype=dtype)
            if tuple(threshold.shape) != (d_transcoder,):
                raise InputError(
                    f"a JumpReLU threshold must have shape ({d_transcoder},), one per feature; "
                    f"got {tuple(threshold.shape)}"
                )
            self.activation_function = JumpReLU(threshold.to(dtype))
        else:
            self.activation_function = ReLU()

    @property
    def k(self) -> int | None:
        """The features a topk transcoder keeps per token (None for the others)."""
        return self.activation_function.k if self.activation == "topk" else None

    @property
    def dtype(self) -> torch.dtype:
        return self.b_enc.dtype

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_enc.T + b_enc``: the features' inputs before the activation."""
        return torch.nn.functional.linear(x, self.W_enc, self.b_enc)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The feature activations ``act(x @ W_enc.T + b_enc)``, shape ``(…, d_transcoder)``."""
        return self.activation_function(self.pre_activations(x))

    def decode(self, a: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ W_dec + b_dec``, plus ``x @ W_skip.T`` for a transcoder with a skip path (which needs ``x``)."""
        out = a @ self.W_dec + self.b_dec
        if self.W_skip is not None:
            if x is None:
                raise InputError("this transcoder has a skip path (W_skip): give decode the MLP input x too")
            out = out + x @ self.W_skip.T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction of the MLP's output from its input ``x``: ``decode(encode(x), x)``."""
        return self.decode(self.encode(x), x)

    def extra_repr(self) -> str:
        skip = ", skip" if self.W_skip is not None else ""
        return f"d_model={self.d_model}, d_transcoder={self.d_transcoder}, {self.activation}{skip}"


class TranscoderSet(nn.Module):
    """One `Transcoder` per layer, all of one width: ``layers`` are the model layers they stand for
    (0 … n − 1 for a whole model, which saving needs; fewer for a partial set, e.g. a test run)."""

    feature_input_hook = FEATURE_INPUT_HOOK
    feature_output_hook = FEATURE_OUTPUT_HOOK

    def __init__(
        self,
        transcoders: Sequence[Transcoder],
        layers: Sequence[int] | None = None,
        model_name: str = "",
        scan: str = "",
    ):
        super().__init__()
        if isinstance(transcoders, (str, bytes, torch.Tensor)) or not isinstance(transcoders, Iterable):
            transcoders = []
        transcoders = list(transcoders)
        if not transcoders or not all(isinstance(t, Transcoder) for t in transcoders):
            raise InputError("a TranscoderSet takes a non-empty list of Transcoder, one per layer")
        if layers is not None:
            layers = [
                require_integer(x, "each of layers", low=0)
                for x in require_sequence(layers, "layers", example="[0, 1]")
            ]
        layers = list(range(len(transcoders))) if layers is None else layers
        require_text(model_name, "model_name", empty=True)
        require_text(scan, "scan", empty=True)
        if len(layers) != len(transcoders) or sorted(set(layers)) != layers or layers[0] < 0:
            raise InputError(
                f"layers {layers} must be distinct, increasing and ≥ 0, one per transcoder ({len(transcoders)} given)"
            )
        widths = {t.d_transcoder for t in transcoders}
        if len(widths) > 1:
            raise InputError(f"the transcoders differ in width ({sorted(widths)}); a set shares one d_transcoder")
        d_models = {t.d_model for t in transcoders}
        if len(d_models) > 1:
            raise InputError(f"the transcoders differ in d_model ({sorted(d_models)}); they must read one model")
        self.transcoders = nn.ModuleList(transcoders)
        self.layers: tuple[int, ...] = tuple(layers)
        self.model_name, self.scan = model_name, scan

    @property
    def d_transcoder(self) -> int:
        return self.transcoders[0].d_transcoder

    @property
    def d_model(self) -> int:
        return self.transcoders[0].d_model

    @property
    def n_layers(self) -> int:
        return len(self.transcoders)

    def __len__(self) -> int:
        return len(self.transcoders)

    def __iter__(self) -> Iterator[Transcoder]:
        return iter(self.transcoders)

    def items(self) -> Iterator[tuple[int, Transcoder]]:
        """(model layer, its transcoder) pairs."""
        return zip(self.layers, self.transcoders)

    def layer(self, layer: int) -> Transcoder:
        """The transcoder of model layer ``layer``."""
        if layer not in self.layers:
            raise InputError(f"this set has no transcoder for layer {layer}; it covers layers {list(self.layers)}")
        return self.transcoders[self.layers.index(layer)]

    def __getitem__(self, layer: int) -> Transcoder:
        return self.layer(layer)

    def extra_repr(self) -> str:
        return f"layers={list(self.layers)}, model_name={self.model_name!r}, scan={self.scan!r}"
