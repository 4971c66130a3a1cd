"""The patch-grid geometry a processor will use: a plain value object, free of torch.

`countlens.datasets` places objects relative to this grid (cell centres, grid lines,
intersections) and `VLM.geometry` reports it for a loaded model, so a data set can be built from
either a model or plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from countlens.errors import CountlensError
from countlens.validate import require_bool, require_count, require_image_side


@dataclass(frozen=True)
class Geometry:
    """Image size in pixels, the ViT patch size, and how many patches (per side) merge into a token.

    ``patch_grid`` is the ViT's patch grid; ``token_grid`` the grid of image tokens the language
    model sees (patch grid divided by ``merge_size``: Qwen's 2×2 merger, Gemma3's 4×4 pooling).

    ``partial=True`` is a data set's grid, not a processor's: the image need not be a multiple of
    the patch, so the last cell of each axis may be partial (the MAS paper's 384 px / 27 px: 14
    whole cells and 6 px). Grid line k stays at x = k·patch; ``patch_grid`` counts whole cells only.

    ``dropped=True`` is a processor's grid whose vision tower drops the remainder: a patch
    convolution of stride ``patch_size`` without padding reads only the whole patches of each axis,
    so the last ``image % patch_size`` px of the bottom rows and right columns reach no patch
    (SigLIP-so400m's 384 px of 14 px patches: 27 whole patches and a 6 px strip; Idefics3 / SmolVLM
    tiles, LLaVA-OneVision's base image and crops). Patch k spans k·patch … (k+1)·patch px, as on a
    whole grid; the whole patches of each axis must be a multiple of ``merge_size`` (SmolVLM-Instruct:
    27 = 9 tokens of 3). ``seen`` is the part the tokens cover; the strip belongs to no token, so an
    object (or the part of one) lying only in it covers no cell (`countlens.model.cells`), and the data
    generators given such a grid place objects inside ``seen``.
    """

    image_height: int
    image_width: int
    patch_size: int
    merge_size: int = 1
    partial: bool = False
    dropped: bool = False

    def __post_init__(self) -> None:
        for name in ("image_height", "image_width", "patch_size", "merge_size"):
            require_count(getattr(self, name), name)
        for name in ("image_height", "image_width"):
            require_image_side(getattr(self, name), name)
        require_bool(self.dropped, "dropped")
        if self.partial and self.dropped:
            raise CountlensError(
                "partial=True (a data set's grid with partial cells) and dropped=True (a processor's grid whose "
                "tower drops the remainder) are two rules; give one"
            )
        if self.dropped:
            self._check_dropped()
            return
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
                f" = {unit}; choose an image size the processor keeps unchanged (or, for a processor whose vision "
                "tower drops the remainder of each axis, dropped=True)"
            )

    def _check_dropped(self) -> None:
        p, m = self.patch_size, self.merge_size
        for name, side in (("high", self.image_height), ("wide", self.image_width)):
            whole = side // p
            if whole < m or whole % m:
                raise CountlensError(
                    f"image {self.image_height}x{self.image_width} with dropped=True: {side} px {name} is {whole} "
                    f"whole {p} px patches and {side % p} px dropped, and {whole} patches are not whole tokens of "
                    f"merge_size {m}; choose a size whose whole patches are a multiple of {m} "
                    f"(e.g. {max(m, whole - whole % m) * p} px)"
                )

    @classmethod
    def square(
        cls, image_size: int, patch_size: int, merge_size: int = 1, partial: bool = False, dropped: bool = False
    ) -> Geometry:
        return cls(image_size, image_size, patch_size, merge_size, partial, dropped)

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

    @property
    def seen(self) -> tuple[int, int]:
        """(height, width) in pixels of the part of the image the cells cover, from the top-left corner:
        the whole image, but with ``dropped`` its whole patches only (378 × 378 of SigLIP's 384 px)."""
        if not self.dropped:
            return self.image_height, self.image_width
        rows, cols = self.patch_grid
        return rows * self.patch_size, cols * self.patch_size
