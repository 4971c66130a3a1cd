"""Tiny InternVL3 (Qwen2.5 text) and InternVL3.5 (Qwen3 text): tiles and a thumbnail."""

from __future__ import annotations

from countlens.toy.tiny_models.common import HEAD_DIM, SMALL_VISION, chat, seeded, text_settings
from countlens.toy.tiny_models.qwen import QWEN2_5_SPECIALS

INTERNVL_TILE = 32
INTERNVL_PATCH = 4  # 8×8 patches per tile, pixel-shuffled by 0.5 → 4×4 tokens per tile


#: InternVL3-hf (Qwen2.5 language model): `<img>` 151,665, `</img>` 151,666, `<IMG_CONTEXT>` 151,667 (the
#: image token of OpenGVLab/InternVL3-*-hf configs), then the grounding tokens; text vocabulary 151,674.
#: `<video>` is not in that vocabulary (the processor needs a video token): here it is id 151,674.
INTERNVL3_SPECIALS: tuple[str, ...] = (
    *QWEN2_5_SPECIALS,
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<video>",
)
INTERNVL3_VOCAB = 151_674


def _internvl(text_model: str = "qwen2", tile: int = INTERNVL_TILE):
    """InternVL3 (Qwen2.5 language model; ``text_model="qwen3"``: InternVL3.5's Qwen3) with the real
    Qwen vocabulary and InternVL3's added tokens at their real ids (`<IMG_CONTEXT>` 151,667)."""
    import transformers as tf
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from countlens.model.processors import image_only
    from countlens.toy.tiny_models.vocab import qwen_tokenizer

    template = chat("<|im_start|>{{ message['role'] }}\n", "<IMG_CONTEXT>\n", "<|im_end|>\n", "<|im_start|>assistant\n")
    tok = qwen_tokenizer(
        INTERNVL3_SPECIALS,
        start_image_token="<img>",
        end_image_token="</img>",
        context_image_token="<IMG_CONTEXT>",
        video_token="<video>",
    )
    tok.chat_template = template
    extra = dict(head_dim=HEAD_DIM) if text_model == "qwen3" else {}
    config = tf.InternVLConfig(
        vision_config=dict(image_size=[tile] * 2, patch_size=[INTERNVL_PATCH] * 2, **SMALL_VISION),
        text_config=text_settings(text_model, tok, vocab=INTERNVL3_VOCAB, **extra),
        image_token_id=tok.context_image_token_id,
        image_seq_length=(tile // INTERNVL_PATCH // 2) ** 2,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=12
    )
    processor = image_only(tf.InternVLProcessor)(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        image_seq_length=(tile // INTERNVL_PATCH // 2) ** 2,
    )
    return seeded(tf.InternVLForConditionalGeneration, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "internvl": _internvl,
    "internvl3_5": lambda **kw: _internvl("qwen3", **kw),
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "internvl": (2 * INTERNVL_TILE, 2 * INTERNVL_TILE),
    "internvl3_5": (2 * INTERNVL_TILE, 2 * INTERNVL_TILE),
}
