"""The plan of a transcoder training (`countlens.pipeline.transcoder_cost`) against a hand count."""

from __future__ import annotations

import math

import pytest

from countlens.errors import InputError
from countlens.features.activations import DEFAULT_MIX, estimate_tokens
from countlens.model.memory import Widths
from countlens.pipeline.graph_cost import GPU_FLOPS
from countlens.pipeline.transcoder_cost import (
    CPU_FORWARD_FLOPS,
    CPU_STEP_FLOPS,
    GPU_STEP_FLOPS,
    mix_forwards,
    training_plan_lines,
    transcoder_cost,
)

#: Two layers of width 8 in bfloat16 (the other widths enter no training figure).
W = Widths(
    n_layers=2,
    n_heads=2,
    n_kv_heads=2,
    d_head=4,
    d_model=8,
    d_ff=16,
    vocab=10,
    layer_linear=0,
    vision_width=0,
    vision_ff=0,
    vision_blocks=0,
    vision_linear=0,
    projector_linear=0,
    patch_embed=0,
    merge=1,
    weight_bytes=0,
    act_bytes=2,
)
ARGS = dict(width=16, k=2, steps=60, batch_tokens=4, max_memory=1000, collect_batch=1, seq=10)


def test_a_streamed_plan_is_the_hand_count():
    c = transcoder_cost(W, 100, collection_flops=3e9, **ARGS)
    params = 2 * 16 * 8 + 16 + 8  # W_enc, W_dec, b_enc, b_dec = 280
    assert c["params"] == params and c["state_bytes"] == 4 * params * 4  # weights, grads, Adam's two moments
    assert c["step_bytes"] == (8 * 4 * 16 + 8 * 4 * 8) * 4  # 8 (B, W) and 8 (B, d) float32 arrays = 3072
    assert c["device_bytes"] == 4480 + 3072
    # in memory both splits, 125 tokens × 2 layers × (input, output) × 8 × 4 bytes = 16000 > 1000: streamed
    assert c["streamed"] and c["held_out_tokens"] == 25 and c["store_bytes"] == 125 * 2 * 2 * 8 * 2
    # a chunk: ≤ 1000 bytes + one batch (10 tokens × 64 bytes) → 26 tokens; one layer as float32: 26 × 2 × 8 × 4
    assert c["chunk_bytes"] == 1664 and c["host_bytes"] == max(1000 + 640, 1664)
    assert c["read_bytes_per_layer"] == 60 * 4 * 2 * 8 * 2
    # per step 10 B·d·W (encoder, decoder, their backward); AuxK's 6 B·d·W on steps 51 … 60
    flops = 2 * (60 * 10 + 10 * 6) * 4 * 8 * 16
    assert c["step_flops"] == 10 * 4 * 8 * 16 and c["train_flops"] == flops
    assert c["seconds"] == pytest.approx(flops / CPU_STEP_FLOPS + 3e9 / CPU_FORWARD_FLOPS)
    gpu = transcoder_cost(W, 100, collection_flops=3e9, device="cuda", **ARGS)
    assert gpu["seconds"] == pytest.approx(flops / GPU_STEP_FLOPS + 3e9 / GPU_FLOPS)


def test_in_memory_plan_and_fewer_layers():
    c = transcoder_cost(W, 100, **{**ARGS, "max_memory": 16000})  # exactly fits: in memory
    assert transcoder_cost(W, 100, **{**ARGS, "max_memory": 15999})["streamed"]
    assert not c["streamed"] and c["store_bytes"] == 0 and c["host_bytes"] == 125 * 2 * 2 * 8 * 4
    one = transcoder_cost(W, 100, layers=1, **ARGS)
    assert one["train_flops"] == (60 * 10 + 10 * 6) * 4 * 8 * 16 and one["store_bytes"] == 125 * 2 * 8 * 2
    assert transcoder_cost(W, 100, store_bytes=4, **ARGS)["store_bytes"] == 125 * 2 * 2 * 8 * 4


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_memory": 0}, "max_memory"),
        ({"max_memory": math.nan}, "max_memory"),
        ({"max_memory": math.inf}, "max_memory"),
        ({"k": 17}, "k=17 is more than width=16"),
        ({"layers": 3}, "layers=3 is more than the model's 2"),
        ({"device": "tpu"}, "'cpu' or 'cuda'"),
        ({"store_bytes": 8}, "store_bytes"),
        ({"collection_flops": -1.0}, "collection_flops"),
        ({"collect_batch": -4}, "collect_batch"),
        ({"collect_batch": 0}, "collect_batch"),
        ({"seq": -100}, "seq"),
        ({"seq": 2.5}, "seq"),
    ],
)
def test_the_plan_refuses_bad_settings(kw, message):
    with pytest.raises(InputError, match=message):
        transcoder_cost(W, 100, **{**ARGS, **kw})


def test_the_lines_plan_the_organisms_default_mix(loaded):
    vlm = loaded("toy")
    data = mix_forwards(vlm)
    assert data["tokens"] == estimate_tokens(vlm, DEFAULT_MIX, 0) and data["flops"] > 0
    lines = training_plan_lines(vlm, width=512, k=16)
    assert lines[0].startswith("transcoders: 6 layers × 512 features (k 16) on d_model 128")
    assert "held in memory" in lines[1] and "calibrated on one CPU thread" in lines[-1]
    streamed = training_plan_lines(vlm, width=512, max_memory=2**20, device="cuda")
    assert "streamed from disk" in streamed[1] and "an assumed rate" in streamed[-1]
    with pytest.raises(InputError, match="Widths"):
        transcoder_cost("toy", 100)
