"""Training on the newer families: a hybrid model's attention losses read only its softmax layers and
LoRA reaches its linear-attention layers too; PaliGemma's answer tokens stay out of its bidirectional
prefix."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import countlens
from countlens.datasets.tasks import task_samples
from countlens.errors import LayerError
from countlens.training.capture import attention_at
from countlens.training.collate import training_batch
from countlens.training.finetune import FinetuneConfig, finetune


def test_a_hybrid_model_trains_with_attention_losses_on_its_softmax_layers(tiny_checkpoint, tmp_path):
    vlm = countlens.load(tiny_checkpoint("qwen3_5"))  # layers 0, 2 linear; 1, 3 softmax
    samples = task_samples("count", 4, 1000, image_size=64)
    with pytest.raises(LayerError, match="linear-attention layer"):
        with attention_at(vlm, [0]):
            pass
    rows = []
    config = FinetuneConfig(steps=1, batch_size=2, save_every=1, target_layers=(1, 3), focus=1.0, mas=0.1, lr=1e-3)
    adapter = finetune(vlm, samples, tmp_path / "ft", config, progress=rows.append)
    assert rows and torch.isfinite(torch.tensor(rows[0]["loss"])) and {"focus", "mas"} <= set(rows[0])
    names = list(load_file(adapter / "adapter_model.safetensors"))
    assert any(".linear_attn.out_proj." in n for n in names) and any(".self_attn.o_proj." in n for n in names)
    with pytest.raises(LayerError, match="focus / MAS"):
        finetune(vlm, samples, tmp_path / "bad", FinetuneConfig(steps=1, target_layers=(0,), focus=1.0))


def test_paligemma_answers_are_its_causal_suffix(loaded):
    vlm = loaded("paligemma")
    batch = training_batch(vlm, task_samples("count", 2, 7, image_size=32))
    types, mask = batch.inputs["token_type_ids"], batch.inputs["attention_mask"]
    answer = batch.labels != -100
    assert answer.any() and (types[answer] == 1).all()  # answer tokens: the causal suffix
    prompt = mask.bool() & ~answer & (torch.arange(mask.shape[1]) < batch.prompt.inputs["input_ids"].shape[1])
    assert (types[prompt] == 0).all()  # image and prompt: the bidirectional prefix
