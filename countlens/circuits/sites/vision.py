"""Sites of the vision tower: the output of one vision block, on the ViT's patch grid (before merging)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from countlens.circuits.sites.location import Location, check_indices, whole
from countlens.errors import InputError
from countlens.model.adapt import module_of

if TYPE_CHECKING:
    from countlens.model.vlm import VLM


@dataclass(frozen=True)
class VisionBlock:
    """The output of vision block ``index`` (`ArchSpec.vision_blocks`), read only: taps and probes."""

    index: int

    def __post_init__(self):
        check_indices(self, index=0)

    def location(self, vlm: VLM) -> Location:
        blocks = module_of(vlm.hf, vlm.arch.spec.vision_blocks)
        if not 0 <= self.index < len(blocks):
            raise InputError(f"vision block {self.index} out of range 0..{len(blocks) - 1}")
        return Location(f"{vlm.arch.spec.vision_blocks}.{self.index}", "output", whole)
