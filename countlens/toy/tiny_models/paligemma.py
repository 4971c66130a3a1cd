"""Tiny PaliGemma: a SigLIP tower's patch grid row-major, and no chat template."""

from __future__ import annotations

from countlens.toy.tiny_models.common import HEAD_DIM, HIDDEN, SMALL_VISION, seeded, text_settings

PALIGEMMA_IMAGE = 32
PALIGEMMA_PATCH = 8  # 4×4 patches, no pooling → 16 image tokens (real: 224 / 14 → 256)


def _paligemma(tile: int = PALIGEMMA_IMAGE):
    """PaliGemma 2: SigLIP (no head), one linear projector, Gemma-2 text with sliding and global layers;
    no chat template (the processor writes image tokens, <bos>, the prompt and a newline); the
    prefix is bidirectional (token_type_ids 0), an answer causal (1). A digit-splitting BPE with the
    processor's 1,024 <loc> and 128 <seg> tokens added after its own (real: Gemma's 256,000, then
    those, <image> at 257,152)."""
    import transformers as tf
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from countlens.toy.tiny_models.vocab import digit_bpe

    tok = digit_bpe(
        ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"],
        pad="<pad>",
        eos="<eos>",
        bos="<bos>",
        named={"image_token": "<image>"},
        chat_template="",
        extra_chars="\n",
    )
    tok.chat_template = None
    tokens = (tile // PALIGEMMA_PATCH) ** 2
    image_processor = SiglipImageProcessorPil(size={"height": tile, "width": tile})
    image_processor.image_seq_length = tokens  # as the real preprocessor_config.json carries it
    processor = tf.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)  # adds <loc…>, <seg…>
    text = text_settings(
        "gemma2",
        tok,
        head_dim=HEAD_DIM,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=512,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        layer_types=["sliding_attention", "full_attention"],
    )
    text["tie_word_embeddings"] = True
    config = tf.PaliGemmaConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            image_size=tile,
            patch_size=PALIGEMMA_PATCH,
            vision_use_head=False,
            **SMALL_VISION,
        ),
        text_config=text,
        image_token_index=tok.image_token_id,
        projection_dim=HIDDEN,
        hidden_size=HIDDEN,
        tie_word_embeddings=True,
    )
    return seeded(tf.PaliGemmaForConditionalGeneration, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "paligemma": _paligemma,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "paligemma": (PALIGEMMA_IMAGE, PALIGEMMA_IMAGE),
}
