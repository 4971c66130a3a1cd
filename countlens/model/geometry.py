"""The patch-grid geometry a processor will use: a plain value object, free of torch.

`countlens.datasets` places objects relative to this grid (cell centres, grid lines,
intersections) and `VLM.geometry` reports it for a loaded model, so a data set can be built from
either a model or plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from countlens.errors import CountlensError
from countlens.validate import require_count, require_image_side


@dataclass(frozen=True)
class Geometry:
    """Image size in pixels, the ViT patch size, and how many patches (per side) merge into a token.

    ``patch_grid`` is the ViT's patch grid; ``token_grid`` the grid of image tokens the language
    model sees (patch grid divided by ``merge_size``: Qwen's 2×2 merger, Gemma3's 4×4 pooling).

    ``partial=True`` is a data set's grid, not a processor's: the image need not be a multiple of
    the patch, so the last cell of each axis may be partial (the MAS paper's 384 px / 27 px: 14
    whole cells and 6 px). Grid line k stays at x = k·patch; ``patch_grid`` counts whole cells only.
    """

    image_height: int
    image_width: int
    patch_size: int
    merge_size: int = 1
    partial: bool = False

    def __post_init__(self) -> None:
        for name in ("image_height", "image_width", "patch_size", "merge_size"):
            require_count(getattr(self, name), name)
        for name in ("image_height", "image_width"):
            require_image_side(getattr(self, name), name)
        if self.partial:
            if self.merge_size != 1:
                raise CountlensError(
                    "a grid with partial cells (partial=True) is a data set's grid; it takes "
                    f"merge_size 1, got {self.merge_size}"
                )
            if self.image_height < self.patch_size or self.image_width < self.patch_size:
                raise CountlensError(
                    f"image {self.image_height}x{self.image_width} is smaller than one {self.patch_size}px patch"
                )
            return
        unit = self.patch_size * self.merge_size
        if self.image_height % unit or self.image_width % unit:
            raise CountlensError(
                f"image {self.image_height}x{self.image_width} is not a multiple of patch_size*merge_size"
                f" = {unit}; choose an image size the processor keeps unchanged"
            )

    @classmethod
    def square(cls, image_size: int, patch_size: int, merge_size: int = 1, partial: bool = False) -> Geometry:
        return cls(image_size, image_size, patch_size, merge_size, partial)

    @classmethod
    def data_grid(cls, image_size: int, patch_size: int) -> Geometry:
        """A square data-set grid from plain numbers; partial cells only where the sizes need them."""
        return cls.square(image_size, patch_size, partial=image_size % patch_size != 0)

    @property
    def patch_grid(self) -> tuple[int, int]:
        """Whole cells per axis (rows, cols)."""
        return self.image_height // self.patch_size, self.image_width // self.patch_size

    @property
    def token_grid(self) -> tuple[int, int]:
        rows, cols = self.patch_grid
        return rows // self.merge_size, cols // self.merge_size

    @property
    def token_size(self) -> int:
        """Side in pixels of the image region one image token covers."""
        return self.patch_size * self.merge_size
