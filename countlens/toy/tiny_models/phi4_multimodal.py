"""Tiny Phi-4-multimodal: the stitched crops with row newlines, then the global image."""

from __future__ import annotations

from countlens.toy.tiny_models.common import SMALL_VISION, chat, seeded, special_ids, text_settings

PHI4_CROP = 32
PHI4_VOCAB = 200_064  # Phi-4-multimodal-instruct's embedding rows (o200k's 199,998 ranks, specials, unused rows)
PHI4_PATCH = 4  # 8×8 patches per crop, 2×2 average-pooled → 4×4 tokens per crop


#: Phi-4-multimodal-instruct's added tokens and their ids (its tokenizer_config ``added_tokens_decoder``).
#: 200,000-200,009 and 200,012-200,017 are not tokens there and stay empty here.
PHI4MM_SPECIALS: dict[str, int] = {
    "<|endoftext|>": 199_999,
    "<|endoftext10|>": 200_010,  # image placeholder (Phi4MultimodalConfig.image_token_id)
    "<|endoftext11|>": 200_011,  # audio placeholder (audio_token_id)
    "<|endofprompt|>": 200_018,
    "<|assistant|>": 200_019,
    "<|end|>": 200_020,
    "<|user|>": 200_021,
    "<|system|>": 200_022,
}
#: Phi-4-multimodal's chat tokens are ``rstrip`` added tokens (they take the whitespace after them).
PHI4MM_RSTRIP = frozenset({"<|assistant|>", "<|end|>", "<|user|>", "<|system|>"})
#: The attribute names HF's Phi-4-multimodal conversion gives them (``extra_special_tokens``), for ``**named``.
PHI4MM_NAMED: dict[str, str] = {"image_token": "<|endoftext10|>", "audio_token": "<|endoftext11|>"}


def _phi4_multimodal(tile: int = PHI4_CROP):
    """Phi-4-multimodal: one flat config, fused qkv, countlens's PIL image processor, a tiny audio tower
    (always built, never run here), the real o200k vocabulary with Phi-4's specials at their ids, and
    the prompt layout `<|user|><|endoftext10|>…<|end|><|assistant|>`."""
    import torch
    import transformers as tf

    from countlens.model.families import pil_image_processor
    from countlens.toy.tiny_models.vocab import o200k_tokenizer

    # The remote-code checkpoint's template writes '<|' + role + '|>' + content + '<|end|>', the user
    # writing <|image_1|>, which became <|endoftext10|>; transformers' processor expands the
    # tokenizer's image token where it stands, so the template writes that token itself.
    template = chat("<|{{ message['role'] }}|>", "<|endoftext10|>", "<|end|>", "<|assistant|>")
    tok = o200k_tokenizer(PHI4MM_SPECIALS, rstrip=PHI4MM_RSTRIP, **PHI4MM_NAMED)
    tok.chat_template = template
    end_of_text, end = special_ids(tok, "<|endoftext|>", "<|end|>")
    text = text_settings("phi4_multimodal", tok, vocab=PHI4_VOCAB)
    text.pop("model_type")
    text.update(
        original_max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        eos_token_id=[end_of_text, end],
    )
    config = tf.Phi4MultimodalConfig(
        **text,
        vision_config=dict(
            image_size=tile,
            crop_size=tile,
            patch_size=PHI4_PATCH,
            image_token_id=tok.image_token_id,
            feature_layer=-2,
            **SMALL_VISION,
        ),
        audio_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_blocks=1,
            num_attention_heads=2,
            ext_pw_out_channel=16,
            depthwise_separable_out_channel=16,
            nemo_conv_channels=16,
            audio_token_id=tok.audio_token_id,
        ),
    )
    image_processor = pil_image_processor("Phi4MultimodalImageProcessorPil")(
        size={"height": tile, "width": tile}, patch_size=PHI4_PATCH, dynamic_hd=36
    )
    processor = tf.Phi4MultimodalProcessor(
        image_processor=image_processor,
        audio_processor=tf.Phi4MultimodalFeatureExtractor(),
        tokenizer=tok,
        chat_template=template,
    )
    model = seeded(tf.Phi4MultimodalForCausalLM, config)
    # HF initialises the learned newline and separator to zeros (they always come from a checkpoint).
    # The tower's attention output is zeroed: with random weights one bright patch reaches every token of
    # its crop through attention, more than its own (measured), so no token would be local to its cell.
    embed = model.model.embed_tokens_extend.image_embed
    with torch.no_grad():
        embed.global_img_feature_extensor.normal_(0.0, 1.0)
        embed.sub_img_feature_extensor.normal_(0.0, 1.0)
        for block in embed.img_processor.encoder.layers:
            block.self_attn.out_proj.weight.zero_()
            block.self_attn.out_proj.bias.zero_()
    return model, processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "phi4_multimodal": _phi4_multimodal,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "phi4_multimodal": (2 * PHI4_CROP, 2 * PHI4_CROP),
}
