"""Tiny random-init Hugging Face VLMs with working offline processors, for the architecture test matrix.

One module per model family (named as `countlens.model.families` names them), each with its builders and
image sizes as plain data (``BUILDERS``, ``IMAGE_SIZE``); `common` holds what they share; this
module is the registry. `build_tiny(name)` returns ``(model, processor)``: a model built from a
config (no hub), seeded with ``torch.manual_seed(0)``, in eval mode, with ``config.architectures``
set; and a processor made of the architecture's real processor class, its PIL image processor
(torchvision is not installed) and
a tokenizer that carries the architecture's special tokens and a chat template in the layout of the
real model. Tokenizers (`real_vocab`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision and InternVL carry the
**real Qwen vocabulary** (special tokens at their real ids, config vocabulary 151,936 / 152,000 as
in the real checkpoints), so "12" is "1", "2"; LLaVA-1.5 and Gemma 3 a small trained BPE that splits
digits as their real tokenizers do; LLaVA-NeXT and Idefics3 a word-level vocabulary in
which every number up to 100 is one token. Sizes: text hidden 64, 2 layers, 4 heads / 2 kv heads
(where GQA exists), vision tower 2 layers of width 32, images of 32-64 px that give a 4×4 grid of
image tokens per image (or per tile). Processors that also want a video processor are made
image-only (`countlens.model.processors`). `tiny_inputs(name, processor)` makes a batch of 2 through the
chat template and the processor.

Image sizes (`TINY_IMAGE_SIZE[name]`, (height, width) of the PIL image to feed):
- qwen2_vl / qwen2_5_vl / qwen3_vl: 64×64, patch 8, merge 2 → 16 image tokens (4×4).
- llava: 32×32 (CLIP, patch 8, CLS dropped) → 16 image tokens (4×4).
- llava_next: 64×64 → anyres 2×2 crops of 32 px: 16 base + 8×(8+1 newline) = 88 tokens.
- llava_onevision: 64×64 → anyres 2×2 crops of 32 px (SigLIP, patch 8): 16 base + 8×(8+1) = 88 tokens.
- gemma3: 64×64 (SigLIP patch 8 → 8×8, avg-pooled 2×2) → 16 image tokens (4×4).
- idefics3: 64×64 → 2×2 tiles of 32 px + a global image, 16 tokens each (80 in all).
- internvl / internvl3_5 (Qwen2.5 / Qwen3 text): 64×64 → 2×2 tiles of 32 px (patch 4, pixel-shuffled
  by 0.5) + a thumbnail, 16 tokens each (80 in all); a 32×32 image is one tile, 16 tokens.
"""

from __future__ import annotations

import os

from tiny_models import (
    gemma3,
    gemma4,
    glm4v,
    idefics3,
    internvl,
    llama4,
    llava,
    mistral3,
    mllama,
    ovis2,
    paligemma,
    phi4_multimodal,
    qwen,
)
from tiny_models.qwen import QWEN_VOCAB  # noqa: F401 — re-exported: the tiny Qwen models' vocabulary size

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The families in the order the test matrix lists them.
FAMILIES = (
    qwen,
    glm4v,
    llava,
    gemma3,
    gemma4,
    paligemma,
    mistral3,
    idefics3,
    internvl,
    ovis2,
    phi4_multimodal,
    mllama,
    llama4,
)
BUILDERS = {name: build for family in FAMILIES for name, build in family.BUILDERS.items()}
TINY_IMAGE_SIZE: dict[str, tuple[int, int]] = {
    name: size for family in FAMILIES for name, size in family.IMAGE_SIZE.items()
}
TINY_NAMES: tuple[str, ...] = tuple(BUILDERS)


def build_tiny(name: str, **kw):
    """``(model, processor)`` for the tiny ``name`` (one of `TINY_NAMES`); the Qwen ones and GLM-4.1V
    take ``image_side=`` (pixels of the square image the processor pins, default `TINY_IMAGE_SIZE`; the
    Qwen ones but Qwen3.5 also ``layers=``, the language model's depth, default 2), the
    tiled ones (InternVL, Ovis2, Phi-4, Idefics3, SmolVLM) ``tile=`` (the tile / crop side in pixels,
    default 32), PaliGemma ``tile=`` (its image side) and Mistral 3 ``tile=`` (its longest edge)."""
    if name not in BUILDERS:
        raise KeyError(f"no tiny model {name!r}; have {', '.join(TINY_NAMES)}")
    return BUILDERS[name](**kw)


def tiny_inputs(name: str, processor, images=None, question: str = "how many circles are there?"):
    """Processor outputs for a batch of 2 (black images unless ``images`` are given)."""
    from PIL import Image

    if images is None:
        h, w = TINY_IMAGE_SIZE[name]
        images = [Image.new("RGB", (w, h)), Image.new("RGB", (w, h), (255, 255, 255))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Images nested per sample: Gemma3's processor reads a flat list as all the images of one sample.
    return processor(text=[text] * len(images), images=[[im] for im in images], padding=True, return_tensors="pt")
