"""Tiny Gemma 3: a SigLIP tower average-pooled to 4 × 4 tokens, Gemma 3 text."""

from __future__ import annotations

from countlens.toy.tiny_models.common import HEAD_DIM, SMALL_VISION, chat, seeded, text_settings

GEMMA_IMAGE = 64
GEMMA_PATCH = 8
GEMMA_TOKENS = 16  # 8×8 patches avg-pooled 2×2 → 4×4


def _gemma3():
    import torch
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    specials = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ]
    template = chat(
        "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n",
        "<start_of_image>",
        "<end_of_turn>\n",
        "<start_of_turn>model\n",
        prefix="{{ bos_token }}",
    )
    from countlens.toy.tiny_models.vocab import digit_bpe

    tok = digit_bpe(
        specials,
        pad="<pad>",
        eos="<eos>",
        bos="<bos>",
        chat_template=template,
        named={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
    )
    text = text_settings(
        "gemma3_text",
        tok,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
    )
    text.pop("model_type")
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=dict(
            model_type="siglip_vision_model",
            image_size=GEMMA_IMAGE,
            patch_size=GEMMA_PATCH,
            vision_use_head=False,
            **SMALL_VISION,
        ),
        mm_tokens_per_image=GEMMA_TOKENS,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        tie_word_embeddings=True,
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE})
    processor = tf.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, chat_template=template, image_seq_length=GEMMA_TOKENS
    )
    model = seeded(tf.Gemma3ForConditionalGeneration, config)
    # HF initialises the projector's matrix to zeros (it is always loaded from a checkpoint); a zero
    # projector would make every image token the same, so give it the usual normal init.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, config.initializer_range)
    return model, processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "gemma3": _gemma3,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "gemma3": (GEMMA_IMAGE, GEMMA_IMAGE),
}
