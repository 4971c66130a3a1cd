"""Sites of the vision tower: the output of one vision block, on the ViT's patch grid (before merging)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from countlens.circuits.sites.location import HOOKS, Location, check_indices, whole
from countlens.errors import InputError
from countlens.labels import vision_label
from countlens.model.adapt import module_of

if TYPE_CHECKING:
    from countlens.model.arch import Arch
    from countlens.model.vlm import VLM


@dataclass(frozen=True)
class VisionBlock:
    """The output of vision block ``index`` (`ArchSpec.vision_blocks`), read only: taps and probes."""

    index: int
    backends: ClassVar[tuple[str, ...]] = (HOOKS,)  # read only

    def __post_init__(self):
        check_indices(self, index=0)

    @property
    def label(self) -> str:
        return vision_label(self.index)

    def width(self, arch: Arch) -> None:
        """None: the vision tower's width is its own config's, not the language model's."""
        return None

    def location(self, vlm: VLM) -> Location:
        blocks = module_of(vlm.hf, vlm.arch.spec.vision_blocks)
        if not 0 <= self.index < len(blocks):
            raise InputError(f"vision block {self.index} out of range 0..{len(blocks) - 1}")
        return Location(vlm.arch.vision_block(self.index), "output", whole)
