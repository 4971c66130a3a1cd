"""Sites of the residual stream and the heads' outputs: `Residual`, `HeadZ`, `Expert`, `ImageStates`,
each with its own write inside a traced forward (the engine's fast path: `countlens.circuits.engine.edits`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from countlens.circuits.sites.expert_rules import expert_rule
from countlens.circuits.sites.groups import checked_heads
from countlens.circuits.sites.location import (
    HOOKS,
    TRACE,
    Location,
    check_indices,
    columns,
    whole,
)
from countlens.errors import InputError
from countlens.labels import LOGITS, expert_label, head_label, input_label, resid_label, states_label
from countlens.model.adapt import module_of

if TYPE_CHECKING:
    from jaxtyping import Float

    from countlens.model.arch import Arch
    from countlens.model.vlm import VLM


@dataclass(frozen=True)
class Residual:
    """The residual stream after decoder layer ``layer``; −1: the input of layer 0."""

    layer: int
    stage: ClassVar[int] = 3  # a layer's output: the last thing of the layer the forward reaches
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=-1)

    def check(self, vlm: VLM) -> None:
        """Refuse a layer the model lacks (a `LayerError` naming its layers)."""
        if self.layer != -1:
            vlm.arch.layer(self.layer)

    @property
    def label(self) -> str:
        return resid_label(self.layer)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_model"]:
        return cache["resid"][self.layer][b, s].to(device)

    def location(self, vlm: VLM) -> Location:
        self.check(vlm)
        if self.layer == -1:
            return Location(vlm.arch.layer(0), "input", whole)
        return Location(vlm.arch.layer(self.layer), "output", whole)


@dataclass(frozen=True)
class HeadZ:
    """Head ``head``'s z at decoder layer ``layer``: its columns of o_proj's input."""

    layer: int
    head: int
    stage: ClassVar[int] = 1
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=0, head=0)

    def check(self, vlm: VLM) -> None:
        """Refuse a layer or head the model lacks, naming its range."""
        checked_heads(vlm.arch, [(self.layer, self.head)])

    @property
    def label(self) -> str:
        return head_label((self.layer, self.head))

    def width(self, arch: Arch) -> int:
        return arch.head_dim(self.layer)

    def columns(self, arch: Arch) -> slice:
        """The head's columns of the layer's z (n_heads·d_head wide)."""
        d_head = arch.head_dim(self.layer)
        return slice(self.head * d_head, (self.head + 1) * d_head)

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_head"]:
        return cache["z"][self.layer][b, s, self.columns(vlm.arch)].to(device)

    def location(self, vlm: VLM) -> Location:
        self.check(vlm)
        return Location(vlm.arch.o_proj(self.layer), "input", columns(self.columns(vlm.arch)))


@dataclass(frozen=True)
class Expert:
    """Expert ``expert``'s contribution at MoE layer ``layer`` (a cache recorded with experts=True)."""

    layer: int
    expert: int
    stage: ClassVar[int] = 2
    backends: ClassVar[tuple[str, ...]] = (TRACE,)  # inside the experts module: the sweeps' writer

    def __post_init__(self):
        check_indices(self, layer=0, expert=0)

    def check(self, vlm: VLM) -> None:
        """Refuse a layer without experts (a `LayerError` naming the MoE layers) or an expert out of range."""
        vlm.arch.experts(self.layer)
        if not self.expert < vlm.arch.n_experts:
            raise InputError(
                f"expert {self.expert} out of range: {vlm.arch.name} has experts 0..{vlm.arch.n_experts - 1}"
            )

    @property
    def label(self) -> str:
        return expert_label((self.layer, self.expert))

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        """Inside layer ``layer``'s experts module (its share of that module's output)."""
        self.check(vlm)
        return Location(vlm.arch.experts(self.layer), "inside", whole)

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_model"]:
        module = module_of(vlm.hf, vlm.arch.experts(self.layer))
        return expert_rule(vlm.arch).cached(module, cache["experts"][self.layer], self.expert, b, s, device)


@dataclass(frozen=True)
class ImageStates:
    """A cross-attention model's image states: at layer −1 the projector's output, which every
    cross-attention layer reads; at a cross-attention layer the states that layer alone reads."""

    layer: int
    stage: ClassVar[int] = 0  # the projector's output, or a cross-attention layer's input
    backends: ClassVar[tuple[str, ...]] = (TRACE,)  # a layer's own states: inside its cross-attention

    def __post_init__(self):
        check_indices(self, layer=-1)

    def check(self, vlm: VLM) -> None:
        """Refuse a model without image states, or a layer that reads none."""
        if vlm.arch.spec.cross_attention is None:
            raise InputError(f"{vlm.arch.name} has no image states: its image enters as image tokens (Residual -1)")
        reads = (-1, *vlm.arch.cross_layers)
        if self.layer not in reads:
            raise InputError(
                f"layer {self.layer} of {vlm.arch.name} reads no image states; ImageStates takes one of {list(reads)} "
                "(−1: the projector's output, else a cross-attention layer)"
            )

    @property
    def label(self) -> str:
        return states_label(self.layer)

    def location(self, vlm: VLM) -> Location:
        """Where the states every cross-attention layer reads are (layer −1: the projector's output)."""
        cross = vlm.arch.spec.cross_attention
        if cross is None or self.layer != -1:
            raise InputError(
                "only ImageStates(-1) of a cross-attention model is read as a module's output; a layer's own "
                "states are patched through effect()"
            )
        return Location(cross.states, "output", whole)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def read(self, vlm: VLM, cache: dict, b: Tensor, s: Tensor, device: torch.device) -> Float[Tensor, "k d_model"]:
        states = cache["states"]
        return states[b.to(states.device), s.to(states.device)].to(device)


#: The input parts: the image tokens' embeddings and every other token's.
INPUTS: tuple[str, ...] = ("image", "text")


@dataclass(frozen=True)
class Embed:
    """The input embeddings of the image tokens (``part`` "image") or of every other token ("text"): the
    input of layer 0 at those positions (`Residual` −1, split by positions; its `location` is that input,
    whole). A cross-attention model has no image tokens: the edge methods that read this node refuse it,
    and its image is `ImageStates` −1."""

    part: str
    layer: ClassVar[int] = -1
    backends: ClassVar[tuple[str, ...]] = (TRACE,)  # an edge node: layer 0's input split by positions

    def __post_init__(self):
        if self.part not in INPUTS:
            raise InputError(f"Embed part {self.part!r}: use one of {INPUTS}")

    def location(self, vlm: VLM) -> Location:
        """Layer 0's input (its ``part``'s positions of it)."""
        return Location(vlm.arch.layer(0), "input", whole)

    @property
    def label(self) -> str:
        return input_label(self.part)

    def width(self, arch: Arch) -> int:
        return arch.d_model


@dataclass(frozen=True)
class Logits:
    """The logits: what the final norm and the unembedding read (an edge receiver; ``layer`` is the
    number of decoder layers, after the last)."""

    layer: int
    block: ClassVar[int] = 0
    part_name: ClassVar[str] = "logits"
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=0)

    @property
    def label(self) -> str:
        return LOGITS

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        """The final norm's input: the stream the unembedding reads."""
        return Location(vlm.arch.final_norm, "input", whole)
