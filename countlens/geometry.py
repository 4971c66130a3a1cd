"""The patch-grid geometry a processor will use: a plain value object, free of torch.

`countlens.datasets` places objects relative to this grid (cell centres, grid lines,
intersections) and `VLM.geometry` reports it for a loaded model, so a data set can be built from
either a model or plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from countlens.errors import CountlensError, require_count


@dataclass(frozen=True)
class Geometry:
    """Image size in pixels, the ViT patch size, and how many patches (per side) merge into a token.

    ``patch_grid`` is the ViT's patch grid; ``token_grid`` the grid of image tokens the language
    model sees (patch grid divided by ``merge_size``: Qwen's 2×2 merger, Gemma3's 4×4 pooling).
    """

    image_height: int
    image_width: int
    patch_size: int
    merge_size: int = 1

    def __post_init__(self) -> None:
        for name in ("image_height", "image_width", "patch_size", "merge_size"):
            require_count(getattr(self, name), name)
        unit = self.patch_size * self.merge_size
        if self.image_height % unit or self.image_width % unit:
            raise CountlensError(
                f"image {self.image_height}x{self.image_width} is not a multiple of patch_size*merge_size"
                f" = {unit}; choose an image size the processor keeps unchanged"
            )

    @classmethod
    def square(cls, image_size: int, patch_size: int, merge_size: int = 1) -> Geometry:
        return cls(image_size, image_size, patch_size, merge_size)

    @property
    def patch_grid(self) -> tuple[int, int]:
        return self.image_height // self.patch_size, self.image_width // self.patch_size

    @property
    def token_grid(self) -> tuple[int, int]:
        rows, cols = self.patch_grid
        return rows // self.merge_size, cols // self.merge_size

    @property
    def token_size(self) -> int:
        """Side in pixels of the image region one image token covers."""
        return self.patch_size * self.merge_size
