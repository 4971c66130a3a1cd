"""Sites of the MLP: its input `MlpIn` (after its norm) and its output `MlpOut`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from countlens.circuits.sites.location import HOOKS, TRACE, Location, check_indices, whole
from countlens.labels import mlp_in_label, mlp_label

if TYPE_CHECKING:
    from countlens.model.arch import Arch
    from countlens.model.vlm import VLM


@dataclass(frozen=True)
class MlpIn:
    """The input of layer ``layer``'s MLP (after its pre-MLP norm)."""

    layer: int
    stage: ClassVar[float] = 1.5
    block: ClassVar[int] = 1  # as an edge receiver: the layer's MLP, after its attention
    part_name: ClassVar[str] = "mlp"
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=0)

    @property
    def label(self) -> str:
        return mlp_in_label(self.layer)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        return Location(vlm.arch.mlp(self.layer), "input", whole)


@dataclass(frozen=True)
class MlpOut:
    """The output of layer ``layer``'s MLP (a mixture-of-experts layer's whole block)."""

    layer: int
    stage: ClassVar[float] = 2.5
    backends: ClassVar[tuple[str, ...]] = (TRACE, HOOKS)

    def __post_init__(self):
        check_indices(self, layer=0)

    @property
    def label(self) -> str:
        return mlp_label(self.layer)

    def width(self, arch: Arch) -> int:
        return arch.d_model

    def location(self, vlm: VLM) -> Location:
        return Location(vlm.arch.mlp(self.layer), "output", whole)
