"""Image-only processors for VLMs whose HF processor also wants a video sub-processor.

Video processors need torchvision, which has no working CPU build beside the pinned torch on these
machines; an image-only subclass (same tokens, same image processing, no video attribute) is all
that counting experiments need. The subclass keeps the base class's `__call__` and chat handling.
"""

from __future__ import annotations

import inspect
from functools import cache


@cache
def image_only(base: type) -> type:
    """``base`` without its ``video_processor`` argument; ``base`` unchanged when it has none."""
    params = inspect.signature(base.__init__).parameters
    if "video_processor" not in params:
        return base

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        # ProcessorMixin reads the sub-processor names off this signature, so the None passed
        # for video_processor is dropped there rather than type-checked.
        base.__init__(self, image_processor, tokenizer, None, **kwargs)

    # The base's signature minus video_processor: ProcessorMixin saves and reloads the settings it
    # names (e.g. LLaVA-OneVision's num_image_tokens).
    sig = inspect.signature(base.__init__)
    __init__.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "video_processor"])
    return type(f"ImageOnly{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})
