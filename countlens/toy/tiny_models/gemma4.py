"""Tiny Gemma 4: per-layer head sizes, the image at its token budget."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    HEAD_DIM,
    V_HEADS,
    V_HIDDEN,
    V_INTERMEDIATE,
    V_LAYERS,
    chat,
    seeded,
    special_ids,
    text_settings,
)

GEMMA4_PATCH = 8
GEMMA4_POOL = 2  # 2 × 2 patches average-pooled into a token (real: patch 16, pool 3)
GEMMA4_TOKENS = 70  # max_soft_tokens, the smallest budget allowed: a square image becomes 8 × 8 tokens (128 px)
GEMMA4_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
]


def _gemma4():
    """Gemma 4: a sliding-window layer with heads of 16 and a global layer with heads of 32 (real: 256
    and 512), q-, k- and v-norms, per-layer input embeddings (as E2B / E4B); a vision tower over the
    image resized to at most 70 pooled tokens (2 × 2 pooling), no chat template of its own beyond the
    turn layout; Gemma's digit-splitting rule on a small BPE with Gemma 4's image and audio tokens."""
    import torch
    import transformers as tf
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from countlens.model.processors import image_only
    from countlens.toy.tiny_models.vocab import digit_bpe

    template = chat(
        "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n",
        "<|image|>",
        "<turn|>\n",
        "<|turn>model\n",
        prefix="{{ bos_token }}",
    )
    named = {
        "image_token": "<|image|>",
        "boi_token": "<|image>",
        "eoi_token": "<image|>",
        "audio_token": "<|audio|>",
        "boa_token": "<|audio>",
        "eoa_token": "<audio|>",
    }
    tok = digit_bpe(GEMMA4_SPECIALS, pad="<pad>", eos="<eos>", bos="<bos>", named=named, chat_template=template)
    image_processor = Gemma4ImageProcessorPil(
        patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOL, max_soft_tokens=GEMMA4_TOKENS
    )
    # The processor adds <|video|> to the tokenizer (after its vocabulary).
    processor = image_only(tf.Gemma4Processor)(
        image_processor=image_processor, tokenizer=tok, chat_template=template, image_seq_length=GEMMA4_TOKENS
    )
    vocab = len(tok)
    text = text_settings(
        "gemma4_text",
        tok,
        vocab=vocab,
        head_dim=HEAD_DIM,
        global_head_dim=2 * HEAD_DIM,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=vocab,
    )
    text.pop("model_type")
    ids = dict(zip(GEMMA4_SPECIALS, special_ids(tok, *GEMMA4_SPECIALS)))
    config = tf.Gemma4Config(
        text_config=text,
        vision_config=dict(
            hidden_size=V_HIDDEN,
            intermediate_size=V_INTERMEDIATE,
            num_hidden_layers=V_LAYERS,
            num_attention_heads=V_HEADS,
            num_key_value_heads=V_HEADS,
            head_dim=V_HIDDEN // V_HEADS,
            patch_size=GEMMA4_PATCH,
            pooling_kernel_size=GEMMA4_POOL,
            position_embedding_size=256,
        ),
        audio_config=None,
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"],
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        tie_word_embeddings=True,
    )
    model = seeded(tf.Gemma4ForConditionalGeneration, config)
    # HF initialises the learned position table to ones (it always comes from a checkpoint): every
    # patch would get the same position. The tower's attention output is zeroed, as Phi-4's: with random
    # weights a bright patch reaches every token through attention about as much as its own (measured).
    with torch.no_grad():
        model.model.vision_tower.patch_embedder.position_embedding_table.normal_(0.0, 0.02)
        for block in model.model.vision_tower.encoder.layers:
            for param in block.self_attn.o_proj.parameters():
                param.zero_()
    return model, processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "gemma4": _gemma4,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "gemma4": (64, 64),
}
