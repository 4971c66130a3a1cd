"""Tiny random-init Hugging Face VLMs with working offline processors, for the architecture test matrix.

`build_tiny(name)` returns ``(model, processor)``: a model built from a config (no hub), seeded with
``torch.manual_seed(0)``, in eval mode, with ``config.architectures`` set; and a processor made of the
architecture's real processor class, its PIL image processor (torchvision is not installed) and a
word-level tokenizer that carries the architecture's special tokens and a chat template in the style
of the real model. Sizes: text hidden 64, 2 layers, 4 heads / 2 kv heads (where GQA exists), vision
tower 2 layers of width 32, images of 32-64 px that give a 4×4 grid of image tokens per image (or per
tile). Processors that also want a video processor are made image-only (`countlens.processors`).

Image sizes (`TINY_IMAGE_SIZE[name]`, (height, width) of the PIL image to feed):
- qwen2_vl / qwen2_5_vl / qwen3_vl: 64×64, patch 8, merge 2 → 16 image tokens (4×4).
- llava: 32×32 (CLIP, patch 8, CLS dropped) → 16 image tokens (4×4).
- llava_next: 64×64 → anyres 2×2 crops of 32 px: 16 base + 8×(8+1 newline) = 88 tokens.
- llava_onevision: 64×64 → anyres 2×2 crops of 32 px (SigLIP, patch 8): 16 base + 8×(8+1) = 88 tokens.
- gemma3: 64×64 (SigLIP patch 8 → 8×8, avg-pooled 2×2) → 16 image tokens (4×4).
- idefics3: 64×64 → 2×2 tiles of 32 px + a global image, 16 tokens each (80 in all).
- internvl: 64×64 → 2×2 tiles of 32 px + a thumbnail, 16 tokens each (80 in all).
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
_TEMPLATE_WORDS = ["model", "usr", "inst", "/inst", "!"]


def _vocab(specials: list[str]) -> list[str]:
    from countlens.toy.recipe import VOCAB

    return list(dict.fromkeys([*specials, "[UNK]", *VOCAB, *_TEMPLATE_WORDS]))


def _tokenizer(specials: list[str], *, pad: str, eos: str, bos: str | None = None, named: dict | None = None,
               chat_template: str):
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
        + "{% for message in messages %}" + turn_user
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
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
    if tok.unk_token_id in out:
        raise AssertionError(f"unknown special token among {tokens}")
    return out


# ----------------------------------------------------------------------------------------------- Qwen

_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
_QWEN_TEMPLATE = _chat(
    "<|im_start|>{{ message['role'] }}\n", "<|vision_start|><|image_pad|><|vision_end|>", "<|im_end|>\n",
    "<|im_start|>assistant\n",
)
QWEN_PATCH = 8
QWEN_MERGE = 2


def _qwen(name: str):
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from countlens.processors import image_only

    tok = _tokenizer(_QWEN_SPECIALS, pad="<|endoftext|>", eos="<|im_end|>", chat_template=_QWEN_TEMPLATE)
    pad, im_start, im_end, v_start, v_end, image, video = _ids(tok, *_QWEN_SPECIALS)
    side = TINY_IMAGE_SIZE[name][0]
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": side * side},
    )
    text = dict(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=im_start, eos_token_id=im_end, pad_token_id=pad,
    )
    vision = dict(depth=V_LAYERS, num_heads=V_HEADS, in_channels=3, patch_size=QWEN_PATCH,
                  spatial_merge_size=QWEN_MERGE, temporal_patch_size=2)
    top = dict(image_token_id=image, video_token_id=video, vision_start_token_id=v_start,
               vision_end_token_id=v_end, tie_word_embeddings=False)
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
        vision.update(hidden_size=V_HIDDEN, intermediate_size=V_INTERMEDIATE, out_hidden_size=HIDDEN,
                      window_size=2 * QWEN_PATCH * QWEN_MERGE, fullatt_block_indexes=[1])
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)
        model_cls, proc_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor
    elif name == "qwen3_vl":
        text.update(head_dim=HEAD_DIM, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        # Learned position embeddings on a 8×8 grid (interpolated to the image's patch grid);
        # deepstack feeds block 0's merged features into the first text layer.
        vision.update(hidden_size=V_HIDDEN, intermediate_size=V_INTERMEDIATE, out_hidden_size=HIDDEN,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **top)
        model_cls, proc_cls = tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLProcessor
    else:
        raise KeyError(name)
    processor = image_only(proc_cls)(image_processor=image_processor, tokenizer=tok, chat_template=_QWEN_TEMPLATE)
    return _seeded(model_cls, config), processor


# ---------------------------------------------------------------------------------------------- table

TINY_IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "qwen2_vl": (64, 64),
    "qwen2_5_vl": (64, 64),
    "qwen3_vl": (64, 64),
}

_BUILDERS = {
    "qwen2_vl": lambda: _qwen("qwen2_vl"),
    "qwen2_5_vl": lambda: _qwen("qwen2_5_vl"),
    "qwen3_vl": lambda: _qwen("qwen3_vl"),
}

TINY_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def build_tiny(name: str):
    """``(model, processor)`` for the tiny ``name`` (one of `TINY_NAMES`)."""
    if name not in _BUILDERS:
        raise KeyError(f"no tiny model {name!r}; have {', '.join(TINY_NAMES)}")
    return _BUILDERS[name]()


def tiny_inputs(name: str, processor, images=None, question: str = "how many circles are there?"):
    """Processor outputs for a batch of 2 (black images unless ``images`` are given)."""
    from PIL import Image

    if images is None:
        h, w = TINY_IMAGE_SIZE[name]
        images = [Image.new("RGB", (w, h)), Image.new("RGB", (w, h), (255, 255, 255))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[text] * len(images), images=list(images), padding=True, return_tensors="pt")
