"""Tiny LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video and LLaVA-OneVision: a CLIP / SigLIP tower, a projector
and a language model."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    HEAD_DIM,
    SMALL_VISION,
    V_HIDDEN,
    chat,
    seeded,
    text_settings,
    word_tokenizer,
)

LLAVA_PATCH = 8
LLAVA_TILE = 32  # px: the vision tower's input size (4×4 patches)
ONEVISION_VOCAB = 152_000  # llava-onevision-qwen2 checkpoints

#: What a LLaVA processor over a CLIP tower is told: the patch size, and that the CLS token is dropped.
CLIP_PROCESSOR = dict(patch_size=LLAVA_PATCH, vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _clip_vision() -> dict:
    """The CLIP tower of LLaVA-1.5 and LLaVA-NeXT: 4 × 4 patches of a 32 px tile, and a CLS token."""
    return dict(
        model_type="clip_vision_model",
        image_size=LLAVA_TILE,
        patch_size=LLAVA_PATCH,
        projection_dim=V_HIDDEN,
        **SMALL_VISION,
    )


def _llava():
    """LLaVA-1.5 style: CLIP ViT (CLS + patches, CLS dropped), 2-layer MLP projector, Llama text."""
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from countlens.toy.tiny_models.vocab import digit_bpe

    specials = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
    template = chat("{{ message['role'].upper() }}: ", "<image>\n", " ", "ASSISTANT:")
    tok = digit_bpe(
        specials, pad="<pad>", eos="</s>", bos="<s>", named={"image_token": "<image>"}, chat_template=template
    )
    config = tf.LlavaConfig(
        vision_config=_clip_vision(),
        text_config=text_settings("llama", tok),
        image_token_index=tok.image_token_id,
        image_seq_length=(LLAVA_TILE // LLAVA_PATCH) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": LLAVA_TILE}, crop_size={"height": LLAVA_TILE, "width": LLAVA_TILE}
    )
    processor = tf.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        **CLIP_PROCESSOR,
    )
    return seeded(tf.LlavaForConditionalGeneration, config), processor


def _llava_next(video: bool = False):
    """LLaVA-NeXT (v1.6-mistral style): CLIP with anyres tiling, Mistral text. ``video``: LLaVA-NeXT-Video,
    the same image path (its video pooler and video processor unused: countlens reads images)."""
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from countlens.model.processors import image_only

    specials = ["<unk>", "<s>", "</s>", "<image>", "<pad>", "[INST]", "[/INST]", *(["<video>"] if video else [])]
    template = chat(
        "{% if message['role'] == 'user' %}[INST] {% endif %}",
        "<image>\n",
        "{% if message['role'] == 'user' %} [/INST]{% else %}</s>{% endif %}",
        "",
        prefix="<s>",
    )
    named = {"image_token": "<image>", **({"video_token": "<video>"} if video else {})}
    tok = word_tokenizer(specials, pad="<pad>", eos="</s>", bos="<s>", named=named, chat_template=template)
    # The real pinpoints scaled by 32/336.
    pinpoints = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
    config = (tf.LlavaNextVideoConfig if video else tf.LlavaNextConfig)(
        vision_config=_clip_vision(),
        text_config=text_settings("mistral", tok, head_dim=HEAD_DIM, sliding_window=None),
        image_token_index=tok.image_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(LLAVA_TILE // LLAVA_PATCH) ** 2,
        **({"video_token_index": tok.video_token_id} if video else {}),
    )
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": LLAVA_TILE},
        crop_size={"height": LLAVA_TILE, "width": LLAVA_TILE},
        image_grid_pinpoints=pinpoints,
    )
    processor = (image_only(tf.LlavaNextVideoProcessor) if video else tf.LlavaNextProcessor)(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        **CLIP_PROCESSOR,
    )
    model_cls = tf.LlavaNextVideoForConditionalGeneration if video else tf.LlavaNextForConditionalGeneration
    return seeded(model_cls, config), processor


def _llava_onevision(tile: int = LLAVA_TILE, patch: int = LLAVA_PATCH):
    """LLaVA-OneVision: SigLIP (no CLS) with anyres_max_9 tiling, Qwen2 text. ``tile`` (the base image's
    and each crop's side) and ``patch``: ``tile=384, patch=14`` is the real one's, 27 whole patches and
    6 px the patch convolution drops."""
    import transformers as tf
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from countlens.model.processors import image_only
    from countlens.toy.tiny_models.vocab import ONEVISION_SPECIALS, qwen_tokenizer

    template = chat("<|im_start|>{{ message['role'] }}\n", "<image>\n", "<|im_end|>\n", "<|im_start|>assistant\n")
    tok = qwen_tokenizer(ONEVISION_SPECIALS, image_token="<image>", video_token="<video>")
    tok.chat_template = template
    # The real pinpoints (384 × {1..6} squared grid) scaled by tile/384.
    pinpoints = [[tile * i, tile * j] for i in range(1, 7) for j in range(1, 7)]
    config = tf.LlavaOnevisionConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            image_size=tile,
            patch_size=patch,
            vision_use_head=False,
            **SMALL_VISION,
        ),
        text_config=text_settings("qwen2", tok, vocab=ONEVISION_VOCAB),
        image_token_index=tok.image_token_id,
        video_token_index=tok.video_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
    )
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints
    )
    processor = image_only(tf.LlavaOnevisionProcessor)(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        num_image_tokens=(tile // patch) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )
    return seeded(tf.LlavaOnevisionForConditionalGeneration, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "llava": _llava,
    "llava_next": _llava_next,
    "llava_next_video": lambda **kw: _llava_next(video=True, **kw),
    "llava_onevision": _llava_onevision,
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "llava": (LLAVA_TILE, LLAVA_TILE),
    "llava_next": (2 * LLAVA_TILE, 2 * LLAVA_TILE),
    "llava_next_video": (2 * LLAVA_TILE, 2 * LLAVA_TILE),
    "llava_onevision": (2 * LLAVA_TILE, 2 * LLAVA_TILE),
}
