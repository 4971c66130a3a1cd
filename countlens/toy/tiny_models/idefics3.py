"""Tiny Idefics3 and SmolVLM: tiles and the whole image, pixel-shuffled SigLIP tokens."""

from __future__ import annotations

from countlens.toy.tiny_models.common import SMALL_VISION, chat, seeded, text_settings

IDEFICS_TILE = 32
IDEFICS_PATCH = 4  # 8×8 patches per tile, pixel-shuffled by 2 → 4×4 tokens per tile


def _idefics3(
    family: str = "idefics3", tile: int = IDEFICS_TILE, patch: int = IDEFICS_PATCH, scale: int = 2, tiles: int = 2
):
    """Idefics3 (Llama-3 text: the real Llama-3 vocabulary; the processor adds <fake_token_around_image>,
    <image>, <end_of_utterance> at 128,256 … 128,258, as in Idefics3-8B, whose config's image token is
    128,257) or SmolVLM (SmolLM2 text: a small digit-splitting BPE with its tokens as specials). The
    image: resized to a longest edge of two tiles, cut into 32 px tiles of 8 × 8 patches pixel-shuffled
    by 2 (4 × 4 tokens each), then the whole image as one more tile. ``patch`` and ``scale`` (the pixel
    shuffle) change the tower: ``tile=384, patch=14, scale=3`` is SmolVLM-Instruct's, 27 whole patches
    (9 tokens) and 6 px the patch convolution drops; ``tiles`` is the longest edge in tiles (1: every
    image one tile, no thumbnail)."""
    import transformers as tf

    from countlens.model.processors import image_only

    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil as ImageProcessor,
        )

        from countlens.toy.tiny_models.vocab import LLAMA32_SPECIALS, llama3_tokenizer

        # The real template: the tokenizer writes <|begin_of_text|> itself (add_bos_token).
        template = chat("{{ message['role'] | capitalize }}:", "<image>", "<end_of_utterance>\n", "Assistant:")
        tok = llama3_tokenizer(LLAMA32_SPECIALS)
        tok.chat_template = template
        proc_cls, model_cls, config_cls = tf.Idefics3Processor, tf.Idefics3ForConditionalGeneration, tf.Idefics3Config
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as ImageProcessor

        from countlens.toy.tiny_models.vocab import digit_bpe

        template = chat(
            "<|im_start|>{{ message['role'] | capitalize }}:",
            "<image>",
            "<end_of_utterance>\n",
            "Assistant:",
        )
        named = {
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        }
        rows_cols = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *named.values(), *rows_cols]
        tok = digit_bpe(specials, pad="<|im_end|>", eos="<end_of_utterance>", named=named, chat_template=template)
        proc_cls, model_cls, config_cls = (
            image_only(tf.SmolVLMProcessor),
            tf.SmolVLMForConditionalGeneration,
            tf.SmolVLMConfig,
        )
    image_processor = ImageProcessor(size={"longest_edge": tiles * tile}, max_image_size={"longest_edge": tile})
    processor = proc_cls(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        image_seq_len=(tile // patch // scale) ** 2,
    )
    config = config_cls(
        vision_config=dict(image_size=tile, patch_size=patch, **SMALL_VISION),
        text_config=text_settings("llama", tok),
        scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    return seeded(model_cls, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "idefics3": _idefics3,
    "smolvlm": lambda **kw: _idefics3("smolvlm", **kw),
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "idefics3": (2 * IDEFICS_TILE, 2 * IDEFICS_TILE),
    "smolvlm": (2 * IDEFICS_TILE, 2 * IDEFICS_TILE),
}
