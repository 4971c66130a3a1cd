"""Tiny Llama 4: the padded canvas's tiles, then the whole image; chunked attention."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    HEAD_DIM,
    HIDDEN,
    INTERMEDIATE,
    V_HEADS,
    V_HIDDEN,
    V_LAYERS,
    chat,
    seeded,
    special_ids,
    text_settings,
)

LLAMA4_TILE = 32
LLAMA4_PATCH = 4  # 8×8 patches per tile, pixel-shuffled by 0.5 → 4×4 tokens per tile (real: 336 / 14, 144)
LLAMA4_SPECIALS = [
    "<|finetune_right_pad_id|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
    "<|image|>",
    "<|patch|>",
]


def _llama4(tile: int = LLAMA4_TILE):
    """Llama 4: chunked attention with RoPE at layer 0, global attention without RoPE at layer 1 (real:
    three chunked, then one global), a mixture of 4 experts (one per token) with a shared expert at
    layer 1 (real Scout: 16 experts at every layer); images padded onto a canvas of at most 4 tiles, a
    stretched global tile beside several; countlens's PIL image processor (transformers' needs
    torchvision); Llama 4's chat layout on a small BPE with its digit rule (o200k's: groups of three)."""
    import torch
    import transformers as tf

    from countlens.model.families import pil_image_processor
    from countlens.toy.tiny_models.vocab import digit_bpe

    template = chat(
        "<|header_start|>{{ message['role'] }}<|header_end|>\n\n",
        "<|image|>",
        "<|eot|>",
        "<|header_start|>assistant<|header_end|>\n\n",
        prefix="{{ bos_token }}",
    )
    tok = digit_bpe(
        LLAMA4_SPECIALS,
        pad="<|finetune_right_pad_id|>",
        eos="<|eot|>",
        bos="<|begin_of_text|>",
        named={"image_token": "<|image|>"},
        chat_template=template,
        extra_chars="\n",
        digit_groups=True,
    )
    text = text_settings(
        "llama4_text",
        tok,
        head_dim=HEAD_DIM,
        intermediate_size_mlp=INTERMEDIATE,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,  # layer 1 is a mixture of experts
        no_rope_layers=[1, 0],  # 1: RoPE (and chunked attention); 0: no RoPE, global attention
        attention_chunk_size=16,
    )
    text.pop("model_type")
    ids = dict(zip(LLAMA4_SPECIALS, special_ids(tok, *LLAMA4_SPECIALS)))
    config = tf.Llama4Config(
        vision_config=dict(
            hidden_size=V_HIDDEN,
            num_hidden_layers=V_LAYERS,
            num_attention_heads=V_HEADS,
            intermediate_size=4 * V_HIDDEN,  # the pixel-shuffle MLP reads hidden / ratio²
            image_size=tile,
            patch_size=LLAMA4_PATCH,
            pixel_shuffle_ratio=0.5,
            projector_input_dim=HIDDEN,
            projector_output_dim=HIDDEN,
            vision_output_dim=HIDDEN,
        ),
        text_config=text,
        image_token_index=ids["<|patch|>"],
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        tie_word_embeddings=False,
    )
    image_class = pil_image_processor("Llama4ImageProcessorPil")
    image_processor = image_class(size={"height": tile, "width": tile}, max_patches=4)
    processor = tf.Llama4Processor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=LLAMA4_PATCH,
        pixel_shuffle_ratio=0.5,
        chat_template=template,
    )
    model = seeded(tf.Llama4ForConditionalGeneration, config)
    # The tower's attention output is zeroed, as Phi-4's: a random tower mixes every patch into every token.
    with torch.no_grad():
        for block in model.vision_model.model.layers:
            block.self_attn.o_proj.weight.zero_()
            if block.self_attn.o_proj.bias is not None:
                block.self_attn.o_proj.bias.zero_()
    return model, processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "llama4": _llama4,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "llama4": (2 * LLAMA4_TILE, 2 * LLAMA4_TILE),
}
