"""Tiny Mistral 3: a Pixtral tower over the image at its own size, a 2 × 2 merger, Mistral text."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    HEAD_DIM,
    V_HEADS,
    V_HIDDEN,
    V_INTERMEDIATE,
    V_LAYERS,
    chat,
    seeded,
    text_settings,
)
from countlens.toy.tiny_models.qwen import QWEN_MERGE, QWEN_PATCH

#: Tekken's first specials in id order ([IMG] 10, [IMG_BREAK] 12, [IMG_END] 13: Mistral3Config's image token 10).
MISTRAL3_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
]
MISTRAL3_LONGEST = 64  # px: the longest edge an image keeps (real 1540), patch 8, merge 2 → at most 4 × 4 tokens


def _mistral3(tile: int = MISTRAL3_LONGEST):
    """Mistral 3: a Pixtral tower over the image at its own size (longest edge at most 64 px, sides
    rounded up to whole tokens), a 2 × 2 patch merger, Mistral text; [IMG] per token with
    [IMG_BREAK] after each row ([IMG_END] after the last); a small digit-splitting BPE (Tekken splits
    digits) with Tekken's first specials at their ids."""
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from countlens.model.processors import processor_class
    from countlens.toy.tiny_models.vocab import digit_bpe

    template = chat(
        "{% if message['role'] == 'user' %}[INST]{% endif %}",
        "[IMG]",
        "{% if message['role'] == 'user' %}[/INST]{% else %}</s>{% endif %}",
        "",
        prefix="<s>",
    )
    tok = digit_bpe(
        MISTRAL3_SPECIALS, pad="<pad>", eos="</s>", bos="<s>", named={"image_token": "[IMG]"}, chat_template=template
    )
    if tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"]) != [10, 12, 13]:
        raise AssertionError("Mistral 3's image tokens are not at Tekken's ids")
    config = tf.Mistral3Config(
        vision_config=dict(
            model_type="pixtral",
            hidden_size=V_HIDDEN,
            intermediate_size=V_INTERMEDIATE,
            num_hidden_layers=V_LAYERS,
            num_attention_heads=V_HEADS,
            head_dim=V_HIDDEN // V_HEADS,
            image_size=tile,
            patch_size=QWEN_PATCH,
        ),
        text_config=text_settings("mistral", tok, head_dim=HEAD_DIM, sliding_window=None),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=QWEN_MERGE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": tile}, patch_size={"height": QWEN_PATCH, "width": QWEN_PATCH}
    )
    processor = processor_class("PixtralProcessor")(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=QWEN_PATCH,
        spatial_merge_size=QWEN_MERGE,
        chat_template=template,
    )
    return seeded(tf.Mistral3ForConditionalGeneration, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "mistral3": _mistral3,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "mistral3": (MISTRAL3_LONGEST, MISTRAL3_LONGEST),
}
