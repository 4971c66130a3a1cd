"""How each image processor sizes an image: the image its vision tower sees, for any input size.

Fixed-size processors resize (or centre-crop) every image, or every tile, to one size (`fixed_size`).
Dynamic-resolution ones keep the image's aspect and choose a size by a rule of their own, each a
multiple of the patch × merge unit. A rule is a family's (`countlens.model.families.spec.SizingRule`, in its
module under `countlens.model.families`): found by the image processor's class name, or, for a rule that
claims processors by their settings, by the keys of its ``size``. The rules today: a **pixel
budget** (the area between ``size["shortest_edge"]`` and ``size["longest_edge"]`` pixels, or twice
that where two temporal frames count), the **longest edge** (shrunk until the longest side fits,
each side rounded up to the unit) and a **token budget** (the most pooled tokens the aspect
allows, each side rounded down).

`processed_size` applies the processor's rule with its own settings; `default_size` is the square
image countlens assumes when none is given; `pin_square` makes a dynamic processor keep square
images of one side. The token grid of the result is `countlens.model.geometry.Geometry` (side ÷ patch ÷
merge); the arch matrix checks it against each processor's own token count for several image sizes.
"""

from __future__ import annotations

from countlens.errors import UnsupportedArchitectureError
from countlens.model import families as models
from countlens.model.families.spec import SizingRule

#: Image side assumed for dynamic-resolution processors when no size is given.
DEFAULT_DYNAMIC_SIDE = 448


def _name(ip) -> str:
    return type(ip).__name__


def _size(ip) -> dict:
    return {k: v for k, v in dict(getattr(ip, "size", None) or {}).items() if v is not None}


def fixed_size(ip) -> tuple[int, int] | None:
    """(height, width) every image (every tile, for tiling processors) is resized to, or None for
    dynamic resolution."""
    size = _size(ip)
    if _rule(ip) is not None:
        return None
    family = models.image_processor_family(_name(ip))
    tile = family.tile_size(ip, size) if family is not None and family.tile_size is not None else None
    if tile is not None:  # a tiling processor whose size dict sizes the image, not the tiles
        return tile
    crop = dict(getattr(ip, "crop_size", None) or {})
    if getattr(ip, "do_center_crop", False) and "height" in crop:
        return crop["height"], crop["width"]
    if "height" in size:
        return size["height"], size["width"]
    if "shortest_edge" in size:
        return size["shortest_edge"], size["shortest_edge"]
    return None


def _rule(ip) -> SizingRule | None:
    """The dynamic rule an image processor follows, or None (a fixed size)."""
    return models.sizing_rule(_name(ip), _size(ip))


def is_dynamic(ip) -> bool:
    return _rule(ip) is not None


def processed_size(ip, height: int, width: int, unit: int) -> tuple[int, int]:
    """(height, width) of the image the vision tower sees for an input of ``height`` × ``width`` pixels;
    ``unit`` = patch × merge (pixels per image token)."""
    rule = _rule(ip)
    if rule is None:
        fixed = fixed_size(ip)
        if fixed is None:
            raise ValueError(f"{_name(ip)}: no fixed size and no dynamic rule countlens knows")
        return fixed
    return rule.resize(ip, _size(ip), height, width, unit)


def default_size(ip, unit: int) -> tuple[int, int]:
    """The square image countlens assumes for a processor when none is given: its fixed size, or the
    side its rule gives (a pinned budget's, a longest edge), else `DEFAULT_DYNAMIC_SIDE`, processed
    by the processor's rule."""
    rule = _rule(ip)
    if rule is None:
        return fixed_size(ip)
    side = rule.default_side(_size(ip)) or DEFAULT_DYNAMIC_SIDE
    return processed_size(ip, side, side, unit)


def pin_square(ip, side: int) -> bool:
    """Set a dynamic processor to keep square images of ``side`` px as they are; False where it
    cannot (a fixed-size processor, or a rule without a setting for it)."""
    rule = _rule(ip)
    if rule is None or rule.pinned is None:
        return False
    ip.size = rule.pinned(side)
    return True


def refuse_partial_tokens(
    image_processor, h: int, w: int, patch: int, merge: int, name: str, tiled: bool, drops: bool = False
) -> bool:
    """Refuse a fixed-size processor whose one size is not whole image tokens: no image size a user could
    choose changes it. Not where the family's vision tower drops the remainder (``drops``:
    `countlens.model.families.spec.ArchSpec.drops_remainder`; SigLIP's 384 px of 14 px patches: 27
    patches and 6 px its convolution drops): returns whether the size has such a remainder (a
    `countlens.model.geometry.Geometry`'s ``dropped``)."""
    if drops and (h % patch or w % patch):
        return True
    each = "image (tile or crop)" if tiled else "image"
    if (h % (patch * merge) or w % (patch * merge)) and not is_dynamic(image_processor):
        raise UnsupportedArchitectureError(
            f"{name}: {type(image_processor).__name__} resizes every {each} to {h}×{w} px, which is "
            f"{h // patch}×{w // patch} whole {patch} px patches and {h % patch}×{w % patch} px more; countlens "
            f"maps image tokens on images of whole {patch * merge} px tokens (patch {patch} × merge {merge}), or "
            "of whole tokens and a remainder where the family's vision tower is known to drop it, and this "
            "family's is not, so this checkpoint's image size is not supported; if its tower's patch "
            "convolution drops the remainder, declare it in the family's spec (ArchSpec.drops_remainder, "
            "docs/architectures.md)"
        )
    return False
