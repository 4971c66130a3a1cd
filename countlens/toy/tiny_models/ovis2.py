"""Tiny Ovis2: a thumbnail, then the tiles, through a visual vocabulary."""

from __future__ import annotations

from countlens.toy.tiny_models.common import HIDDEN, SMALL_VISION, chat, seeded, special_ids, text_settings
from countlens.toy.tiny_models.qwen import QWEN2_5_SPECIALS, QWEN_VOCAB

OVIS2_TILE = 32
OVIS2_PATCH = 4  # 8×8 patches per tile; hidden_stride 2 concatenates 2×2 → 4×4 tokens per tile
OVIS2_VISUAL_VOCAB = 48  # real: a visual vocabulary of 16k-65k rows (unconfirmed); 5 are indicators


#: Ovis2-*-hf (Qwen2.5 language models): the tokens transformers' conversion adds, in its order:
#: `<IMG_ATOM>` 151,665 (the image token), then START, GRID, COL, ROW, END (the visual indicators).
OVIS2_SPECIALS: tuple[str, ...] = (
    *QWEN2_5_SPECIALS,
    "<IMG_ATOM>",
    "<IMG_START>",
    "<IMG_GRID>",
    "<IMG_COL>",
    "<IMG_ROW>",
    "<IMG_END>",
)


def _ovis2(tile: int = OVIS2_TILE):
    """Ovis2 (Qwen2.5 language model) with the real Qwen vocabulary and the Ovis2-hf tokens at their ids."""
    import transformers as tf
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil

    from countlens.toy.tiny_models.vocab import qwen_tokenizer

    # The converted checkpoints' chat template: a fixed system turn, "<image>\n" per image (plain text
    # that the processor expands into <IMG_START> atoms… <IMG_END>).
    template = chat(
        "<|im_start|>{{ message['role'] }}\n",
        "<image>\n",
        "<|im_end|>\n",
        "<|im_start|>assistant\n",
        prefix="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    )
    tok = qwen_tokenizer(OVIS2_SPECIALS, image_token="<IMG_ATOM>")
    tok.chat_template = template
    image, *indicators = special_ids(tok, *OVIS2_SPECIALS[-6:])
    text = text_settings("qwen2", tok, vocab=QWEN_VOCAB)
    tokens_side = tile // OVIS2_PATCH // 2
    config = tf.Ovis2Config(
        text_config=text,
        vision_config=dict(
            image_size=tile,
            patch_size=OVIS2_PATCH,
            hidden_stride=2,
            vocab_size=OVIS2_VISUAL_VOCAB,
            num_visual_indicator_tokens=5,
            **SMALL_VISION,
        ),
        image_token_id=image,
        visual_indicator_token_ids=indicators,
        # The top config's sizes make lm_head and the visual embedding table: the LM's, as converted.
        vocab_size=QWEN_VOCAB,
        hidden_size=HIDDEN,
        tie_word_embeddings=False,
    )
    image_processor = Ovis2ImageProcessorPil(
        size={"height": tile, "width": tile},
        crop_to_patches=True,
        min_patches=1,
        max_patches=12,
        use_covering_area_grid=True,
    )
    processor = tf.Ovis2Processor(
        image_processor=image_processor, tokenizer=tok, chat_template=template, image_seq_length=tokens_side**2
    )
    return seeded(tf.Ovis2ForConditionalGeneration, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "ovis2": _ovis2,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "ovis2": (2 * OVIS2_TILE, 2 * OVIS2_TILE),
}
