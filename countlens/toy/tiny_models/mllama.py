"""Tiny Llama-3.2-Vision: cross-attention layers read the image states; no image tokens."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    V_HEADS,
    V_HIDDEN,
    V_INTERMEDIATE,
    chat,
    seeded,
    special_ids,
    text_settings,
)

MLLAMA_TILE = 32
MLLAMA_PATCH = 8  # 4×4 patches and a class token per tile: 17 image states per tile slot, 4 slots
MLLAMA_LAYERS = 4
MLLAMA_CROSS = [1, 3]  # the real 11B: 40 layers, cross-attention at 3, 8, …, 38
LLAMA3_VOCAB = 128_256  # text rows; <|image|> is id 128,256, with an embedding but no lm_head row


def _mllama(tile: int = MLLAMA_TILE):
    """Llama-3.2-Vision: a tiled ViT (local and gated global blocks, class token kept), a linear
    projector and a Llama text model whose layers 1 and 3 cross-attend to the image states; the real
    Llama-3 vocabulary with Llama-3.2-Vision's specials at their ids."""
    import torch
    import transformers as tf
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    from countlens.toy.tiny_models.vocab import llama3_tokenizer

    template = chat(
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n",
        "<|image|>",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        prefix="{{ bos_token }}",
    )
    tok = llama3_tokenizer(image_token="<|image|>")
    tok.chat_template = template
    (image,) = special_ids(tok, "<|image|>")
    text = text_settings("mllama_text_model", tok, vocab=LLAMA3_VOCAB)
    text.pop("model_type")
    text.update(
        num_hidden_layers=MLLAMA_LAYERS,
        cross_attention_layers=MLLAMA_CROSS,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    config = tf.MllamaConfig(
        text_config=text,
        vision_config=dict(
            hidden_size=V_HIDDEN,
            intermediate_size=V_INTERMEDIATE,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=V_HEADS,
            image_size=tile,
            patch_size=MLLAMA_PATCH,
            max_num_tiles=4,
            intermediate_layers_indices=[0, 1],
            vision_output_dim=V_HIDDEN * 3,  # the last block's and two intermediate ones (real: 1280 × 6)
        ),
        image_token_index=image,
    )
    model = seeded(tf.MllamaForConditionalGeneration, config)
    # HF zero-initialises every tanh gate (they always come from a checkpoint): with zero cross-attention
    # gates the model would ignore the image. Fixed non-zero values, independent of the RNG.
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "cross_attn_attn_gate"):
                layer.cross_attn_attn_gate.fill_(1.0)
                layer.cross_attn_mlp_gate.fill_(1.0)
        vision = model.model.vision_model
        for gated in (
            vision.gated_positional_embedding,
            vision.pre_tile_positional_embedding,
            vision.post_tile_positional_embedding,
        ):
            gated.gate.fill_(0.5)
    image_processor = MllamaImageProcessorPil(
        size={"height": tile, "width": tile},
        max_image_tiles=4,
        image_mean=list(OPENAI_CLIP_MEAN),
        image_std=list(OPENAI_CLIP_STD),
    )
    processor = tf.MllamaProcessor(image_processor=image_processor, tokenizer=tok, chat_template=template)
    return model, processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "mllama": _mllama,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "mllama": (2 * MLLAMA_TILE, 2 * MLLAMA_TILE),
}
