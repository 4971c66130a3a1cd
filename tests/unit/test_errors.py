"""Bad input gets a CountlensError that names the input and the fix."""

import numpy as np
import pytest
from PIL import Image
from tiny_models import TINY_IMAGE_SIZE

import countlens
from countlens.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CountlensError,
    InputError,
    RunDirError,
    UnsupportedArchitectureError,
)


@pytest.fixture(scope="module")
def qwen(loaded):
    return loaded("qwen2_vl")


def image(mode="RGB"):
    h, w = TINY_IMAGE_SIZE["qwen2_vl"]
    return Image.new(mode, (w, h))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import transformers

    # GLM-4.5V (a mixture-of-experts GLM-4.1V): refused from its config, before any weights are read.
    transformers.Glm4vMoeConfig().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=r"glm4v_moe.*Supported:.*qwen2_vl.*ArchSpec"):
        countlens.load(tmp_path)


def test_bad_dtype_and_config_only_directory(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="not a floating torch dtype"):
        countlens.load(tiny_checkpoint("qwen2_vl"), dtype="bf16")
    import shutil

    for f in tiny_checkpoint("qwen2_vl").iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(CheckpointNotFoundError, match="could not load weights"):
        countlens.load(tmp_path)


def test_missing_checkpoints(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="never downloads"):
        countlens.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointNotFoundError, match="never downloads"):
        countlens.load("some-org/not-in-the-cache")
    with pytest.raises(CheckpointNotFoundError, match="without config.json"):
        countlens.load(tmp_path)
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        countlens.load(tmp_path / "file.bin")


def test_image_mode_and_type(qwen):
    with pytest.raises(InputError, match=r"mode 'RGBA'.*convert\('RGB'\)"):
        qwen.prepare([image("RGBA")], ["how many circles are there?"])
    with pytest.raises(InputError, match="PIL image"):
        qwen.prepare(["not an image"], ["how many circles are there?"])
    with pytest.raises(InputError, match="H×W×3 uint8"):
        qwen.prepare([np.zeros((8, 8), np.float32)], ["how many circles are there?"])
    with pytest.raises(InputError, match="rejected"):  # the processor's own limit: aspect ratio > 200
        qwen.prepare([Image.new("RGB", (1000, 2))], ["how many circles are there?"])


def test_prompt_without_an_image_slot(qwen):
    with pytest.raises(InputError, match="needs exactly one"):
        qwen.prepare([image()], ["how many circles are there?"], chat=False)
    with pytest.raises(InputError, match="one image per prompt"):
        qwen.prepare([image()], ["<image> and <image>"])
    raw = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|>how many circles?<|im_end|><|im_start|>assistant"
    assert len(qwen.prepare([image()], [raw], chat=False).image_pos[0]) == 16


def test_answers_of_any_length_unless_one_token_is_asked_for(qwen, tiny_checkpoint):
    # The real Qwen vocabulary: "3", " circles", then the end-of-answer token <|im_end|>.
    with pytest.raises(InputError, match=r"'3 circles' is 3 tokens.*single token"):
        qwen.prepare([image()], ["how many circles are there?"], ["3 circles"], single_token=True)
    assert len(qwen.prepare([image()], ["how many circles?"], ["3 circles"]).answer_ids[0]) == 3
    for bad in ("", "  ", 3):
        with pytest.raises(InputError, match="empty or not a string"):
            qwen.prepare([image()], ["how many circles?"], [bad])
    word_level = countlens.load(tiny_checkpoint("llava_next"))
    with pytest.raises(InputError, match="vocabulary"):
        word_level.prepare([image()], ["how many circles are there?"], ["zebra"])


def test_mismatched_lengths(qwen):
    with pytest.raises(InputError, match="2 images but 1 prompts"):
        qwen.prepare([image(), image()], ["how many?"])
    with pytest.raises(InputError, match="empty batch"):
        qwen.prepare([], [])
    assert all(issubclass(e, CountlensError) for e in (InputError, ConfigError, RunDirError))


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("image_seq_length", 64, r"64 image tokens but 1x1 tiles of 4x4 gives 16.*\(patch 4, merge 2\)"),
        ("size", {"height": 64, "width": 64}, r"resizes images \(tiles\) to 64×64.*vision_config.image_size is 32×32"),
    ],
)
def test_a_processor_that_disagrees_with_the_config_is_refused(tiny_checkpoint, tmp_path, setting, value, message):
    """InternVL's processor writes image_seq_length tokens per tile whatever the model computes; a
    checkpoint whose two files disagree is refused at load time, naming both, before any weights."""
    import json
    import shutil

    from countlens.errors import CheckpointError

    src = tiny_checkpoint("internvl")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    settings = tmp_path / "processor_config.json"
    cfg = json.loads(settings.read_text())
    if setting == "size":
        cfg["image_processor"]["size"] = value
    else:
        cfg[setting] = value
    settings.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        countlens.load(tmp_path)


def test_a_checkpoint_with_missing_vision_weights_is_refused(tiny_checkpoint, tmp_path):
    """transformers fills missing tensors at random with a warning; countlens refuses, naming them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from countlens.errors import CheckpointError

    shutil.copytree(tiny_checkpoint("internvl"), tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    kept = {k: v for k, v in weights.items() if "vision_tower.encoder.layer.1." not in k}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"model.safetensors\) lacks \d+ weight tensors.*vision_tower.encoder.layer.1"
    ):
        countlens.load(tmp_path)


def test_a_cross_attention_model_has_no_image_token_group(loaded):
    from countlens import circuits
    from countlens.circuits.sites import group_mask
    from countlens.datasets.pairs import count_pairs

    vlm = loaded("mllama")
    pairs = count_pairs(2, 3, 5, kind="polygons", image_size=64, prompt="short", seed=1)
    with pytest.raises(InputError, match="no image tokens.*'image_states'"):
        circuits.patch_layers(vlm, pairs, groups=("image", "last"))
    with pytest.raises(InputError, match="no image tokens.*image_states"):
        group_mask(vlm.prepare([image()], ["how many circles are there?"]), "image")
    with pytest.raises(InputError, match="unknown token group 'image_states'"):
        circuits.patch_layers(loaded("qwen2_vl"), pairs, groups=("image_states",))
