"""Tiny random-init Hugging Face VLMs with working offline processors, for the architecture test matrix.

`build_tiny(name)` returns ``(model, processor)``: a model built from a config (no hub), seeded with
``torch.manual_seed(0)``, in eval mode, with ``config.architectures`` set; and a processor made of
the architecture's real processor class, its PIL image processor (torchvision is not installed) and
a tokenizer that carries the architecture's special tokens and a chat template in the layout of the
real model. Tokenizers (`real_vocab`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision and InternVL carry the
**real Qwen vocabulary** (special tokens at their real ids, config vocabulary 151,936 / 152,000 as
in the real checkpoints), so "12" is "1", "2"; LLaVA-1.5 and Gemma 3 a small trained BPE that splits
digits as their real tokenizers do; LLaVA-NeXT and Idefics3 a word-level vocabulary in
which every number up to 100 is one token. Sizes: text hidden 64, 2 layers, 4 heads / 2 kv heads
(where GQA exists), vision tower 2 layers of width 32, images of 32-64 px that give a 4×4 grid of
image tokens per image (or per tile). Processors that also want a video processor are made
image-only (`countlens.processors`). `tiny_inputs(name, processor)` makes a batch of 2 through the
chat template and the processor.

Image sizes (`TINY_IMAGE_SIZE[name]`, (height, width) of the PIL image to feed):
- qwen2_vl / qwen2_5_vl / qwen3_vl: 64×64, patch 8, merge 2 → 16 image tokens (4×4).
- llava: 32×32 (CLIP, patch 8, CLS dropped) → 16 image tokens (4×4).
- llava_next: 64×64 → anyres 2×2 crops of 32 px: 16 base + 8×(8+1 newline) = 88 tokens.
- llava_onevision: 64×64 → anyres 2×2 crops of 32 px (SigLIP, patch 8): 16 base + 8×(8+1) = 88 tokens.
- gemma3: 64×64 (SigLIP patch 8 → 8×8, avg-pooled 2×2) → 16 image tokens (4×4).
- idefics3: 64×64 → 2×2 tiles of 32 px + a global image, 16 tokens each (80 in all).
- internvl / internvl3_5 (Qwen2.5 / Qwen3 text): 64×64 → 2×2 tiles of 32 px (patch 4, pixel-shuffled
  by 0.5) + a thumbnail, 16 tokens each (80 in all); a 32×32 image is one tile, 16 tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
V_HIDDEN = 32
V_INTERMEDIATE = 64
V_LAYERS = 2
V_HEADS = 2

# Words used by the chat templates below beyond countlens.toy.recipe.VOCAB.
_TEMPLATE_WORDS = ["model"]


def _vocab(specials: list[str]) -> list[str]:
    from countlens.toy.recipe import VOCAB

    return list(dict.fromkeys([*specials, "[UNK]", *VOCAB, *_TEMPLATE_WORDS]))


def _tokenizer(
    specials: list[str], *, pad: str, eos: str, bos: str | None = None, named: dict | None = None, chat_template: str
):
    """A word-level tokenizer whose vocabulary starts with ``specials`` (all added as special tokens).

    ``named`` maps model-specific attribute names (``image_token``, ``boi_token``…) to tokens; the
    tokenizer then has ``tok.image_token`` and ``tok.image_token_id`` etc., as real VLM tokenizers do.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab(specials)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    kwargs = dict(unk_token="[UNK]", pad_token=pad, eos_token=eos)
    if bos is not None:
        kwargs["bos_token"] = bos
    named_tokens = set((named or {}).values())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=[t for t in specials if t not in (pad, eos, bos) and t not in named_tokens],
        model_specific_special_tokens=dict(named or {}),
        padding_side="left",
        **kwargs,
    )
    # Model-specific named tokens are set as attributes but not necessarily registered as added tokens.
    fast.add_tokens([t for t in named_tokens if t not in fast.get_added_vocab()], special_tokens=True)
    if len(fast) != len(vocab):
        raise AssertionError(f"tokenizer grew beyond its vocabulary: {len(fast)} != {len(vocab)}")
    fast.chat_template = chat_template
    return fast


def _chat(turn_user: str, image: str, after_text: str, gen: str, prefix: str = "") -> str:
    """A chat template: ``prefix``, then per message ``turn_user`` (role substituted), image/text parts,
    ``after_text``; and ``gen`` for the generation prompt."""
    return (
        prefix
        + "{% for message in messages %}"
        + turn_user
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + after_text + "{% endfor %}"
        "{% if add_generation_prompt %}" + gen + "{% endif %}"
    )


def _seeded(model_cls, config):
    import torch

    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    return model_cls(config).eval()


def _ids(tok, *tokens: str) -> list[int]:
    out = tok.convert_tokens_to_ids(list(tokens))
    if any(i is None or (i == tok.unk_token_id and t != tok.unk_token) for t, i in zip(tokens, out)):
        raise AssertionError(f"unknown special token among {tokens}")
    return out


# ----------------------------------------------------------------------------------------------- Qwen

_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_QWEN3_TEMPLATE = _chat(
    "<|im_start|>{{ message['role'] }}\n",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|im_end|>\n",
    "<|im_start|>assistant\n",
)
# Qwen2-VL and Qwen2.5-VL open with a default system turn when the messages bring none.
_QWEN2_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}" + _QWEN3_TEMPLATE
)
QWEN_PATCH = 8
QWEN_MERGE = 2
QWEN_VOCAB = 151_936  # Qwen2-VL-2B, Qwen2.5-VL-3B, Qwen3-VL: the BPE ranks, the specials, then unused rows


def _qwen(name: str, image_side: int | None = None):
    import transformers as tf
    from real_vocab import qwen_tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from countlens.processors import image_only

    template = _QWEN2_TEMPLATE if name in ("qwen2_vl", "qwen2_5_vl") else _QWEN3_TEMPLATE
    if name == "qwen3_5":  # its own vocabulary; the real template opens the answer with an empty think block
        from real_vocab import QWEN3_5_VOCAB, qwen3_5_tokenizer

        template = template.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        tok = qwen3_5_tokenizer(image_token="<|image_pad|>", video_token="<|video_pad|>")
    else:
        tok = qwen_tokenizer()
    tok.chat_template = template
    pad, im_start, im_end, v_start, v_end, image, video = _ids(tok, *_QWEN_SPECIALS)
    side = image_side or TINY_IMAGE_SIZE[name][0]
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": side * side},
    )
    text = dict(
        vocab_size=QWEN3_5_VOCAB if name == "qwen3_5" else QWEN_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=im_start,
        eos_token_id=im_end,
        pad_token_id=pad,
    )
    vision = dict(
        depth=V_LAYERS,
        num_heads=V_HEADS,
        in_channels=3,
        patch_size=QWEN_PATCH,
        spatial_merge_size=QWEN_MERGE,
        temporal_patch_size=2,
    )
    top = dict(
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=v_start,
        vision_end_token_id=v_end,
        tie_word_embeddings=False,
    )
    # mrope_section sums to head_dim / 2 = 8 (real models: (16, 24, 24) / (24, 20, 20) of 64).
    if name == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision.update(embed_dim=V_HIDDEN, hidden_size=HIDDEN, mlp_ratio=2)
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **top)
        model_cls, proc_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor
    elif name == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        # window_size in pixels: 32 px = 2×2 merged tokens per window, so window attention really
        # reorders patches inside the vision tower; block 1 uses full attention (as 7, 15, … do).
        vision.update(
            hidden_size=V_HIDDEN,
            intermediate_size=V_INTERMEDIATE,
            out_hidden_size=HIDDEN,
            window_size=2 * QWEN_PATCH * QWEN_MERGE,
            fullatt_block_indexes=[1],
        )
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)
        model_cls, proc_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor
    elif name in ("qwen3_vl", "qwen3_vl_moe"):
        text.update(
            head_dim=HEAD_DIM,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        )
        # Learned position embeddings on a 8×8 grid (interpolated to the image's patch grid);
        # deepstack feeds block 0's merged features into the first text layer.
        vision.update(
            hidden_size=V_HIDDEN,
            intermediate_size=V_INTERMEDIATE,
            out_hidden_size=HIDDEN,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        )
        if name == "qwen3_vl":
            config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **top)
            model_cls = tf.Qwen3VLForConditionalGeneration
        else:  # layer 0 dense, layer 1 a mixture of 4 experts, 2 per token (real 30B-A3B: 128, 8; 235B-A22B: 128, 8)
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
            config = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)
            model_cls = tf.Qwen3VLMoeForConditionalGeneration
        proc_cls = tf.Qwen3VLProcessor
    elif name == "qwen3_5":
        # A hybrid language model: Gated DeltaNet linear attention at layers 0 and 2, softmax at 1 and 3
        # (real: 3 linear then 1 full); 8 value heads of 8 (2 key heads) beside 4 attention heads of 16, so
        # the head axis is 8 wide and the softmax layers' heads 4-7 are no sites (real 27B: 48 value heads of
        # 128 beside 24 attention heads of 256); partial rotary 0.5 of head_dim 16 → mrope over 8 dims.
        text.update(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            head_dim=HEAD_DIM,
            linear_num_key_heads=2,
            linear_num_value_heads=2 * HEADS,
            linear_key_head_dim=HEAD_DIM,
            linear_value_head_dim=HEAD_DIM // 2,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        vision.update(
            hidden_size=V_HIDDEN, intermediate_size=V_INTERMEDIATE, out_hidden_size=HIDDEN, num_position_embeddings=64
        )
        config = tf.Qwen3_5Config(text_config=text, vision_config=vision, **top)
        model_cls, proc_cls = tf.Qwen3_5ForConditionalGeneration, tf.Qwen3VLProcessor
    else:
        raise KeyError(name)
    processor = image_only(proc_cls)(image_processor=image_processor, tokenizer=tok, chat_template=template)
    return _seeded(model_cls, config), processor


# -------------------------------------------------------------------------------------------- GLM-4.1V

GLM_SPECIALS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]


def _glm4v(image_side: int | None = None):
    """GLM-4.1V: Qwen2-VL's vision layout (patch 8, 2 × 2 merge, 3-D rotary) with GLM-4 text (fused
    gate-up MLP, sandwich norms); GLM-4's chat layout and specials in its order (real ids 151,329 …:
    `<|image|>` 151,343), on a small BPE with GLM-4's digit rule (groups of up to three digits: counts
    are whole tokens). Its pixel budget counts two frames: 2 · side² pins a square image."""
    import transformers as tf
    from real_vocab import digit_bpe
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from countlens.processors import image_only

    template = _chat(
        "<|{{ message['role'] }}|>\n",
        "<|begin_of_image|><|image|><|end_of_image|>",
        "",
        "<|assistant|>\n",
        prefix="[gMASK]<sop>",
    )
    tok = digit_bpe(
        GLM_SPECIALS,
        pad="<|endoftext|>",
        eos="<|endoftext|>",
        named={"image_token": "<|image|>", "video_token": "<|video|>"},
        chat_template=template,
        extra_chars="\n",
        digit_groups=True,
    )
    ids = dict(zip(GLM_SPECIALS, _ids(tok, *GLM_SPECIALS)))
    side = image_side or TINY_IMAGE_SIZE["glm4v"][0]
    text = _text(
        "glm4v_text",
        tok,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 2],  # sums to head_dim · 0.5 / 2 = 4 (real: [8, 12, 12] of 128)
        },
    )
    text.pop("model_type")
    config = tf.Glm4vConfig(
        text_config=text,
        vision_config=dict(
            depth=V_LAYERS,
            hidden_size=V_HIDDEN,
            num_heads=V_HEADS,
            intermediate_size=V_INTERMEDIATE,
            out_hidden_size=HIDDEN,
            patch_size=QWEN_PATCH,
            spatial_merge_size=QWEN_MERGE,
            temporal_patch_size=2,
            image_size=32,
        ),
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    pixels = 2 * side * side
    image_processor = Glm4vImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )
    processor = image_only(tf.Glm4vProcessor)(image_processor=image_processor, tokenizer=tok, chat_template=template)
    return _seeded(tf.Glm4vForConditionalGeneration, config), processor


# ---------------------------------------------------------------------------------------------- LLaVA

_SMALL_VISION = dict(
    hidden_size=V_HIDDEN, intermediate_size=V_INTERMEDIATE, num_hidden_layers=V_LAYERS, num_attention_heads=V_HEADS
)


def _text(model_type: str, tok, vocab: int | None = None, **extra) -> dict:
    return dict(
        model_type=model_type,
        vocab_size=vocab or len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )


LLAVA_PATCH = 8
LLAVA_TILE = 32
ONEVISION_VOCAB = 152_000  # llava-onevision-qwen2 checkpoints  # px: the vision tower's input size (4×4 patches)


def _llava():
    """LLaVA-1.5 style: CLIP ViT (CLS + patches, CLS dropped), 2-layer MLP projector, Llama text."""
    import transformers as tf
    from real_vocab import digit_bpe
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    specials = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
    template = _chat("{{ message['role'].upper() }}: ", "<image>\n", " ", "ASSISTANT:")
    tok = digit_bpe(
        specials, pad="<pad>", eos="</s>", bos="<s>", named={"image_token": "<image>"}, chat_template=template
    )
    config = tf.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            image_size=LLAVA_TILE,
            patch_size=LLAVA_PATCH,
            projection_dim=V_HIDDEN,
            **_SMALL_VISION,
        ),
        text_config=_text("llama", tok),
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
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )
    return _seeded(tf.LlavaForConditionalGeneration, config), processor


def _llava_next():
    """LLaVA-NeXT (v1.6-mistral style): CLIP with anyres tiling, Mistral text."""
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    specials = ["<unk>", "<s>", "</s>", "<image>", "<pad>", "[INST]", "[/INST]"]
    template = _chat(
        "{% if message['role'] == 'user' %}[INST] {% endif %}",
        "<image>\n",
        "{% if message['role'] == 'user' %} [/INST]{% else %}</s>{% endif %}",
        "",
        prefix="<s>",
    )
    tok = _tokenizer(
        specials, pad="<pad>", eos="</s>", bos="<s>", named={"image_token": "<image>"}, chat_template=template
    )
    # The real pinpoints scaled by 32/336.
    pinpoints = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
    config = tf.LlavaNextConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            image_size=LLAVA_TILE,
            patch_size=LLAVA_PATCH,
            projection_dim=V_HIDDEN,
            **_SMALL_VISION,
        ),
        text_config=_text("mistral", tok, head_dim=HEAD_DIM, sliding_window=None),
        image_token_index=tok.image_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(LLAVA_TILE // LLAVA_PATCH) ** 2,
    )
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": LLAVA_TILE},
        crop_size={"height": LLAVA_TILE, "width": LLAVA_TILE},
        image_grid_pinpoints=pinpoints,
    )
    processor = tf.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )
    return _seeded(tf.LlavaNextForConditionalGeneration, config), processor


def _llava_onevision():
    """LLaVA-OneVision: SigLIP (no CLS) with anyres_max_9 tiling, Qwen2 text."""
    import transformers as tf
    from real_vocab import ONEVISION_SPECIALS, qwen_tokenizer
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from countlens.processors import image_only

    template = _chat("<|im_start|>{{ message['role'] }}\n", "<image>\n", "<|im_end|>\n", "<|im_start|>assistant\n")
    tok = qwen_tokenizer(ONEVISION_SPECIALS, image_token="<image>", video_token="<video>")
    tok.chat_template = template
    # The real pinpoints (384 × {1..6} squared grid) scaled by 32/384.
    pinpoints = [[LLAVA_TILE * i, LLAVA_TILE * j] for i in range(1, 7) for j in range(1, 7)]
    config = tf.LlavaOnevisionConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            image_size=LLAVA_TILE,
            patch_size=LLAVA_PATCH,
            vision_use_head=False,
            **_SMALL_VISION,
        ),
        text_config=_text("qwen2", tok, vocab=ONEVISION_VOCAB),
        image_token_index=tok.image_token_id,
        video_token_index=tok.video_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
    )
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": LLAVA_TILE, "width": LLAVA_TILE}, image_grid_pinpoints=pinpoints
    )
    processor = image_only(tf.LlavaOnevisionProcessor)(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        num_image_tokens=(LLAVA_TILE // LLAVA_PATCH) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )
    return _seeded(tf.LlavaOnevisionForConditionalGeneration, config), processor


# ------------------------------------------------------------------------------------------- Mistral 3

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
    from real_vocab import digit_bpe
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from countlens.processors import processor_class

    template = _chat(
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
        text_config=_text("mistral", tok, head_dim=HEAD_DIM, sliding_window=None),
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
    return _seeded(tf.Mistral3ForConditionalGeneration, config), processor


# --------------------------------------------------------------------------------------------- Gemma 3

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
    template = _chat(
        "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n",
        "<start_of_image>",
        "<end_of_turn>\n",
        "<start_of_turn>model\n",
        prefix="{{ bos_token }}",
    )
    from real_vocab import digit_bpe

    tok = digit_bpe(
        specials,
        pad="<pad>",
        eos="<eos>",
        bos="<bos>",
        chat_template=template,
        named={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
    )
    text = _text(
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
            **_SMALL_VISION,
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
    model = _seeded(tf.Gemma3ForConditionalGeneration, config)
    # HF initialises the projector's matrix to zeros (it is always loaded from a checkpoint); a zero
    # projector would make every image token the same, so give it the usual normal init.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, config.initializer_range)
    return model, processor


# --------------------------------------------------------------------------------------------- Gemma 4

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
    from real_vocab import digit_bpe
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from countlens.processors import image_only

    template = _chat(
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
    text = _text(
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
    ids = dict(zip(GEMMA4_SPECIALS, _ids(tok, *GEMMA4_SPECIALS)))
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
    model = _seeded(tf.Gemma4ForConditionalGeneration, config)
    # HF initialises the learned position table to ones (it always comes from a checkpoint): every
    # patch would get the same position. The tower's attention output is zeroed, as Phi-4's: with random
    # weights a bright patch reaches every token through attention about as much as its own (measured).
    with torch.no_grad():
        model.model.vision_tower.patch_embedder.position_embedding_table.normal_(0.0, 0.02)
        for block in model.model.vision_tower.encoder.layers:
            for param in block.self_attn.o_proj.parameters():
                param.zero_()
    return model, processor


# ------------------------------------------------------------------------------------------- PaliGemma

PALIGEMMA_IMAGE = 32
PALIGEMMA_PATCH = 8  # 4×4 patches, no pooling → 16 image tokens (real: 224 / 14 → 256)


def _paligemma(tile: int = PALIGEMMA_IMAGE):
    """PaliGemma 2: SigLIP (no head), one linear projector, Gemma-2 text with sliding and global layers;
    no chat template (the processor writes image tokens, <bos>, the prompt and a newline); the
    prefix is bidirectional (token_type_ids 0), an answer causal (1). A digit-splitting BPE with the
    processor's 1,024 <loc> and 128 <seg> tokens added after its own (real: Gemma's 256,000, then
    those, <image> at 257,152)."""
    import transformers as tf
    from real_vocab import digit_bpe
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

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
    text = _text(
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
            **_SMALL_VISION,
        ),
        text_config=text,
        image_token_index=tok.image_token_id,
        projection_dim=HIDDEN,
        hidden_size=HIDDEN,
        tie_word_embeddings=True,
    )
    return _seeded(tf.PaliGemmaForConditionalGeneration, config), processor


# ------------------------------------------------------------------------------------------- Idefics3

IDEFICS_TILE = 32
IDEFICS_PATCH = 4  # 8×8 patches per tile, pixel-shuffled by 2 → 4×4 tokens per tile


def _idefics3(family: str = "idefics3", tile: int = IDEFICS_TILE):
    """Idefics3 (Llama-3 text: the real Llama-3 vocabulary; the processor adds <fake_token_around_image>,
    <image>, <end_of_utterance> at 128,256 … 128,258, as in Idefics3-8B, whose config's image token is
    128,257) or SmolVLM (SmolLM2 text: a small digit-splitting BPE with its tokens as specials). The
    image: resized to a longest edge of two tiles, cut into 32 px tiles of 8 × 8 patches pixel-shuffled
    by 2 (4 × 4 tokens each), then the whole image as one more tile."""
    import transformers as tf

    from countlens.processors import image_only

    if family == "idefics3":
        from real_vocab import LLAMA32_SPECIALS, llama3_tokenizer
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil as ImageProcessor,
        )

        # The real template: the tokenizer writes <|begin_of_text|> itself (add_bos_token).
        template = _chat("{{ message['role'] | capitalize }}:", "<image>", "<end_of_utterance>\n", "Assistant:")
        tok = llama3_tokenizer(LLAMA32_SPECIALS)
        tok.chat_template = template
        proc_cls, model_cls, config_cls = tf.Idefics3Processor, tf.Idefics3ForConditionalGeneration, tf.Idefics3Config
    else:
        from real_vocab import digit_bpe
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as ImageProcessor

        template = _chat(
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
    image_processor = ImageProcessor(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile})
    processor = proc_cls(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        image_seq_len=(tile // IDEFICS_PATCH // 2) ** 2,
    )
    config = config_cls(
        vision_config=dict(image_size=tile, patch_size=IDEFICS_PATCH, **_SMALL_VISION),
        text_config=_text("llama", tok),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    return _seeded(model_cls, config), processor


# -------------------------------------------------------------------------------------------- InternVL

INTERNVL_TILE = 32
INTERNVL_PATCH = 4  # 8×8 patches per tile, pixel-shuffled by 0.5 → 4×4 tokens per tile


def _internvl(text_model: str = "qwen2", tile: int = INTERNVL_TILE):
    """InternVL3 (Qwen2.5 language model; ``text_model="qwen3"``: InternVL3.5's Qwen3) with the real
    Qwen vocabulary and InternVL3's added tokens at their real ids (`<IMG_CONTEXT>` 151,667)."""
    import transformers as tf
    from real_vocab import INTERNVL3_SPECIALS, INTERNVL3_VOCAB, qwen_tokenizer
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from countlens.processors import image_only

    template = _chat(
        "<|im_start|>{{ message['role'] }}\n", "<IMG_CONTEXT>\n", "<|im_end|>\n", "<|im_start|>assistant\n"
    )
    tok = qwen_tokenizer(
        INTERNVL3_SPECIALS,
        start_image_token="<img>",
        end_image_token="</img>",
        context_image_token="<IMG_CONTEXT>",
        video_token="<video>",
    )
    tok.chat_template = template
    extra = dict(head_dim=HEAD_DIM) if text_model == "qwen3" else {}
    config = tf.InternVLConfig(
        vision_config=dict(image_size=[tile] * 2, patch_size=[INTERNVL_PATCH] * 2, **_SMALL_VISION),
        text_config=_text(text_model, tok, vocab=INTERNVL3_VOCAB, **extra),
        image_token_id=tok.context_image_token_id,
        image_seq_length=(tile // INTERNVL_PATCH // 2) ** 2,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=12
    )
    processor = image_only(tf.InternVLProcessor)(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        image_seq_length=(tile // INTERNVL_PATCH // 2) ** 2,
    )
    return _seeded(tf.InternVLForConditionalGeneration, config), processor


# ----------------------------------------------------------------------------------------------- Ovis2

OVIS2_TILE = 32
OVIS2_PATCH = 4  # 8×8 patches per tile; hidden_stride 2 concatenates 2×2 → 4×4 tokens per tile
OVIS2_VISUAL_VOCAB = 48  # real: a visual vocabulary of 16k-65k rows (unconfirmed); 5 are indicators


def _ovis2(tile: int = OVIS2_TILE):
    """Ovis2 (Qwen2.5 language model) with the real Qwen vocabulary and the Ovis2-hf tokens at their ids."""
    import transformers as tf
    from real_vocab import OVIS2_SPECIALS, qwen_tokenizer
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil

    # The converted checkpoints' chat template: a fixed system turn, "<image>\n" per image (plain text
    # that the processor expands into <IMG_START> atoms… <IMG_END>).
    template = _chat(
        "<|im_start|>{{ message['role'] }}\n",
        "<image>\n",
        "<|im_end|>\n",
        "<|im_start|>assistant\n",
        prefix="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    )
    tok = qwen_tokenizer(OVIS2_SPECIALS, image_token="<IMG_ATOM>")
    tok.chat_template = template
    image, *indicators = _ids(tok, *OVIS2_SPECIALS[-6:])
    text = _text("qwen2", tok, vocab=QWEN_VOCAB)
    tokens_side = tile // OVIS2_PATCH // 2
    config = tf.Ovis2Config(
        text_config=text,
        vision_config=dict(
            image_size=tile,
            patch_size=OVIS2_PATCH,
            hidden_stride=2,
            vocab_size=OVIS2_VISUAL_VOCAB,
            num_visual_indicator_tokens=5,
            **_SMALL_VISION,
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
    return _seeded(tf.Ovis2ForConditionalGeneration, config), processor


# ------------------------------------------------------------------------------------- Phi-4-multimodal

PHI4_CROP = 32
PHI4_VOCAB = 200_064  # Phi-4-multimodal-instruct's embedding rows (o200k's 199,998 ranks, specials, unused rows)
PHI4_PATCH = 4  # 8×8 patches per crop, 2×2 average-pooled → 4×4 tokens per crop


def _phi4_multimodal(tile: int = PHI4_CROP):
    """Phi-4-multimodal: one flat config, fused qkv, countlens's PIL image processor, a tiny audio tower
    (always built, never run here), the real o200k vocabulary with Phi-4's specials at their ids, and
    the prompt layout `<|user|><|endoftext10|>…<|end|><|assistant|>`."""
    import torch
    import transformers as tf
    from real_vocab import PHI4MM_NAMED, o200k_tokenizer

    from countlens.models.phi4_multimodal import Phi4MultimodalImageProcessorPil

    # The remote-code checkpoint's template writes '<|' + role + '|>' + content + '<|end|>', the user
    # writing <|image_1|>, which became <|endoftext10|>; transformers' processor expands the
    # tokenizer's image token where it stands, so the template writes that token itself.
    template = _chat("<|{{ message['role'] }}|>", "<|endoftext10|>", "<|end|>", "<|assistant|>")
    tok = o200k_tokenizer(**PHI4MM_NAMED)
    tok.chat_template = template
    end_of_text, end = _ids(tok, "<|endoftext|>", "<|end|>")
    text = _text("phi4_multimodal", tok, vocab=PHI4_VOCAB)
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
            **_SMALL_VISION,
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
    image_processor = Phi4MultimodalImageProcessorPil(
        size={"height": tile, "width": tile}, patch_size=PHI4_PATCH, dynamic_hd=36
    )
    processor = tf.Phi4MultimodalProcessor(
        image_processor=image_processor,
        audio_processor=tf.Phi4MultimodalFeatureExtractor(),
        tokenizer=tok,
        chat_template=template,
    )
    model = _seeded(tf.Phi4MultimodalForCausalLM, config)
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


# ------------------------------------------------------------------------------------- Llama-3.2-Vision

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
    from real_vocab import llama3_tokenizer
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    template = _chat(
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n",
        "<|image|>",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        prefix="{{ bos_token }}",
    )
    tok = llama3_tokenizer(image_token="<|image|>")
    tok.chat_template = template
    (image,) = _ids(tok, "<|image|>")
    text = _text("mllama_text_model", tok, vocab=LLAMA3_VOCAB)
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
    model = _seeded(tf.MllamaForConditionalGeneration, config)
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


# --------------------------------------------------------------------------------------------- Llama 4

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
    from real_vocab import digit_bpe

    from countlens.models.llama4 import Llama4ImageProcessorPil

    template = _chat(
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
    text = _text(
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
    ids = dict(zip(LLAMA4_SPECIALS, _ids(tok, *LLAMA4_SPECIALS)))
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
    image_processor = Llama4ImageProcessorPil(size={"height": tile, "width": tile}, max_patches=4)
    processor = tf.Llama4Processor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=LLAMA4_PATCH,
        pixel_shuffle_ratio=0.5,
        chat_template=template,
    )
    model = _seeded(tf.Llama4ForConditionalGeneration, config)
    # The tower's attention output is zeroed, as Phi-4's: a random tower mixes every patch into every token.
    with torch.no_grad():
        for block in model.vision_model.model.layers:
            block.self_attn.o_proj.weight.zero_()
            if block.self_attn.o_proj.bias is not None:
                block.self_attn.o_proj.bias.zero_()
    return model, processor


# ---------------------------------------------------------------------------------------------- table

TINY_IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "qwen2_vl": (64, 64),
    "qwen2_5_vl": (64, 64),
    "qwen3_vl": (64, 64),
    "qwen3_vl_moe": (64, 64),
    "qwen3_5": (64, 64),
    "glm4v": (64, 64),
    "llava": (LLAVA_TILE, LLAVA_TILE),
    "llava_next": (2 * LLAVA_TILE, 2 * LLAVA_TILE),
    "llava_onevision": (2 * LLAVA_TILE, 2 * LLAVA_TILE),
    "gemma3": (GEMMA_IMAGE, GEMMA_IMAGE),
    "gemma4": (64, 64),
    "paligemma": (PALIGEMMA_IMAGE, PALIGEMMA_IMAGE),
    "mistral3": (MISTRAL3_LONGEST, MISTRAL3_LONGEST),
    "idefics3": (2 * IDEFICS_TILE, 2 * IDEFICS_TILE),
    "smolvlm": (2 * IDEFICS_TILE, 2 * IDEFICS_TILE),
    "internvl": (2 * INTERNVL_TILE, 2 * INTERNVL_TILE),
    "internvl3_5": (2 * INTERNVL_TILE, 2 * INTERNVL_TILE),
    "ovis2": (2 * OVIS2_TILE, 2 * OVIS2_TILE),
    "phi4_multimodal": (2 * PHI4_CROP, 2 * PHI4_CROP),
    "mllama": (2 * MLLAMA_TILE, 2 * MLLAMA_TILE),
    "llama4": (2 * LLAMA4_TILE, 2 * LLAMA4_TILE),
}

_BUILDERS = {
    "qwen2_vl": lambda **kw: _qwen("qwen2_vl", **kw),
    "qwen2_5_vl": lambda **kw: _qwen("qwen2_5_vl", **kw),
    "qwen3_vl": lambda **kw: _qwen("qwen3_vl", **kw),
    "qwen3_vl_moe": lambda **kw: _qwen("qwen3_vl_moe", **kw),
    "qwen3_5": lambda **kw: _qwen("qwen3_5", **kw),
    "glm4v": _glm4v,
    "llava": _llava,
    "llava_next": _llava_next,
    "llava_onevision": _llava_onevision,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "paligemma": _paligemma,
    "mistral3": _mistral3,
    "idefics3": _idefics3,
    "smolvlm": lambda **kw: _idefics3("smolvlm", **kw),
    "internvl": _internvl,
    "internvl3_5": lambda **kw: _internvl("qwen3", **kw),
    "ovis2": _ovis2,
    "phi4_multimodal": _phi4_multimodal,
    "mllama": _mllama,
    "llama4": _llama4,
}

TINY_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def build_tiny(name: str, **kw):
    """``(model, processor)`` for the tiny ``name`` (one of `TINY_NAMES`); the Qwen ones and GLM-4.1V
    take ``image_side=`` (pixels of the square image the processor pins, default `TINY_IMAGE_SIZE`), the
    tiled ones (InternVL, Ovis2, Phi-4, Idefics3, SmolVLM) ``tile=`` (the tile / crop side in pixels,
    default 32), PaliGemma ``tile=`` (its image side) and Mistral 3 ``tile=`` (its longest edge)."""
    if name not in _BUILDERS:
        raise KeyError(f"no tiny model {name!r}; have {', '.join(TINY_NAMES)}")
    return _BUILDERS[name](**kw)


def tiny_inputs(name: str, processor, images=None, question: str = "how many circles are there?"):
    """Processor outputs for a batch of 2 (black images unless ``images`` are given)."""
    from PIL import Image

    if images is None:
        h, w = TINY_IMAGE_SIZE[name]
        images = [Image.new("RGB", (w, h)), Image.new("RGB", (w, h), (255, 255, 255))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Images nested per sample: Gemma3's processor reads a flat list as all the images of one sample.
    return processor(text=[text] * len(images), images=[[im] for im in images], padding=True, return_tensors="pt")
