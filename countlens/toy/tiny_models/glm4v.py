"""Tiny GLM-4.1V: Qwen2-VL's vision layout with GLM-4 text, on a small BPE with GLM-4's digit rule."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    HIDDEN,
    V_HEADS,
    V_HIDDEN,
    V_INTERMEDIATE,
    V_LAYERS,
    chat,
    seeded,
    special_ids,
    text_settings,
)
from countlens.toy.tiny_models.qwen import QWEN_MERGE, QWEN_PATCH

IMAGE_SIDE = 64  # px: the square image the processor pins by default

GLM_SPECIALS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]


def _glm4v(image_side: int | None = None):
    """GLM-4.1V: Qwen2-VL's vision layout (patch 8, 2 × 2 merge, 3-D rotary) with GLM-4 text (fused
    gate-up MLP, sandwich norms); GLM-4's chat layout and specials in its order (real ids 151,329 …:
    `<|image|>` 151,343), on a small BPE with GLM-4's digit rule (groups of up to three digits: counts
    are whole tokens). Its pixel budget counts two frames: 2 · side² pins a square image."""
    import transformers as tf
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from countlens.model.processors import image_only
    from countlens.toy.tiny_models.vocab import digit_bpe

    template = chat(
        "<|{{ message['role'] }}|>\n",
        "<|begin_of_image|><|image|><|end_of_image|>",
        "",
        "<|assistant|>\n",
        prefix="[gMASK]<sop>",
    )
    tok = digit_bpe(
        GLM_SPECIALS,
        pad="<|endoftext|>",
        eos="<|endoftext|>",
        named={"image_token": "<|image|>", "video_token": "<|video|>"},
        chat_template=template,
        extra_chars="\n",
        digit_groups=True,
    )
    ids = dict(zip(GLM_SPECIALS, special_ids(tok, *GLM_SPECIALS)))
    side = image_side or IMAGE_SIDE
    text = text_settings(
        "glm4v_text",
        tok,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 2],  # sums to head_dim · 0.5 / 2 = 4 (real: [8, 12, 12] of 128)
        },
    )
    text.pop("model_type")
    config = tf.Glm4vConfig(
        text_config=text,
        vision_config=dict(
            depth=V_LAYERS,
            hidden_size=V_HIDDEN,
            num_heads=V_HEADS,
            intermediate_size=V_INTERMEDIATE,
            out_hidden_size=HIDDEN,
            patch_size=QWEN_PATCH,
            spatial_merge_size=QWEN_MERGE,
            temporal_patch_size=2,
            image_size=32,
        ),
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    pixels = 2 * side * side
    image_processor = Glm4vImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )
    processor = image_only(tf.Glm4vProcessor)(image_processor=image_processor, tokenizer=tok, chat_template=template)
    return seeded(tf.Glm4vForConditionalGeneration, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "glm4v": _glm4v,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "glm4v": (IMAGE_SIDE, IMAGE_SIDE),
}
