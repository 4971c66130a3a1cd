"""What countlens needs of HF processors: image-only builds, and the tile grid a processor cuts.

`image_only`: video processors need torchvision, which has no working CPU build beside the pinned
torch on these machines; an image-only subclass (same tokens, same image processing, no video or
audio-feature attribute) is all that counting experiments need. The subclass keeps the base class's
`__call__` and chat handling.

`tile_grid`: the grid of tiles a tiling processor cuts an image into, by that processor's own rule
(its family's `tile_grid`, `countlens.model.families`), so that `countlens.model.layouts` can place every image
token; `useful_grid` what a layout needs beside it.

`processor_class`: a processor class by name, or a family's working stand-in where transformers
hides one behind a torchvision requirement.
"""

from __future__ import annotations

import inspect
from functools import cache

from countlens.errors import InputError
from countlens.model import families as models

#: Sub-processors an image-only build leaves out: video, and audio features (Gemma 4's). Phi-4's
#: ``audio_processor`` stays: its processor needs it to build (countlens passes the checkpoint's).
DROPPED = ("video_processor", "feature_extractor")


@cache
def image_only(base: type) -> type:
    """``base`` without its video processor (and audio feature extractor); ``base`` unchanged when it
    has neither."""
    params = inspect.signature(base.__init__).parameters
    dropped = tuple(n for n in DROPPED if n in params)
    if not dropped:
        return base

    from transformers import ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        # By keyword: Gemma 4's processor takes its feature extractor first.
        base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, **dict.fromkeys(dropped), **kwargs)

    # ProcessorMixin reads the sub-processors off the signature below, without the dropped ones. The
    # base passes its None for them on, by keyword (Gemma 4's) or positionally in its own signature's
    # order (LLaVA-OneVision's after the tokenizer, LLaVA-NeXT-Video's first): `_WithoutDropped`, next
    # after the base in the subclass's method order, names the positional ones and leaves those out.
    sig = inspect.signature(base.__init__)
    __init__.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in dropped])
    order = tuple(n for n in sig.parameters if n != "self")
    body = {"__init__": __init__, "__module__": __name__, "_base_order": order}
    if base.__name__ in models.MIXIN_CHAT_TEMPLATE:
        # Its own apply_chat_template only adds the video processor's frame settings: the mixin's.
        body["apply_chat_template"] = ProcessorMixin.apply_chat_template
    return type(f"ImageOnly{base.__name__}", (base, _without_dropped_class()), body)


def _without_dropped_init(self, *args, **kwargs):
    from transformers import ProcessorMixin

    kwargs = {**dict(zip(type(self)._base_order, args)), **kwargs}  # the base's positional sub-processors, named
    kwargs = {k: v for k, v in kwargs.items() if not (k in DROPPED and v is None)}
    ProcessorMixin.__init__(self, **kwargs)


@cache
def _without_dropped_class() -> type:
    """`_WithoutDropped`: ProcessorMixin, minus the dropped sub-processors a base passes on as None."""
    from transformers import ProcessorMixin

    return type("_WithoutDropped", (ProcessorMixin,), {"__init__": _without_dropped_init, "__module__": __name__})


def processor_class(name: str) -> type | None:
    """transformers' processor class ``name``, or None. Where transformers has only a placeholder for
    it (its module needs torchvision), a family's working stand-in, if one gives it."""
    import transformers

    cls = getattr(transformers, name, None)
    if not _is_placeholder(cls):
        return cls
    return models.processor_class(name)


def _is_placeholder(cls) -> bool:
    """A transformers dummy class standing for one whose backend (torchvision) is missing."""
    return cls is not None and type(cls).__name__ == "DummyObject"


def _settings(processor):
    """``setting(key, fallback)``: the processor's class default for ``key`` (InternVL's processor always
    asks for ``crop_to_patches``, whatever the image processor says), else the image processor's."""
    ip = processor.image_processor
    defaults = dict(getattr(processor, "images_kwargs", None) or {})

    def setting(key: str, fallback=None):
        return defaults.get(key, getattr(ip, key, fallback))

    return setting


def tile_grid(processor, height: int, width: int) -> tuple[int, int] | None:
    """(rows, cols) of the tiles (crops) ``processor`` cuts a ``height`` × ``width`` image into, by its
    image processor's own rule (its family's, `countlens.model.families.spec.Family.tile_grid`) and the
    settings a call uses; None for a processor countlens does not know to tile."""
    ip = processor.image_processor
    family = models.image_processor_family(type(ip).__name__)
    if family is None or family.tile_grid is None:
        return None
    return family.tile_grid(ip, _settings(processor), height, width)


def useful_grid(processor, height: int, width: int) -> tuple[int, int] | None:
    """What a tiled layout needs beside the tile grid, by the processor's family (`countlens.model.families.spec.
    Family.useful_grid`): the high-resolution token rows and columns that show the image (``hd_global``),
    or the image's size in pixels once resized into its tile canvas (``padded_tiles``); None for other
    processors."""
    ip = processor.image_processor
    family = models.image_processor_family(type(ip).__name__)
    if family is None or family.useful_grid is None:
        return None
    return family.useful_grid(ip, _settings(processor), height, width)


def render_chat(processor, messages: list, name: str) -> str:
    """The processor's chat template applied to ``messages`` (with the generation prompt); a template
    that does not render is an `InputError` naming the file to fix, not a traceback."""
    from jinja2 import TemplateError

    try:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        raise InputError(
            f"{name}'s chat template does not render ({type(err).__name__}: {err}); fix or replace the "
            "checkpoint's chat_template.jinja (or tokenizer_config.json's chat_template)"
        ) from None
