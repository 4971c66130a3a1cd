"""A plannable directory for a real checkpoint's published config (tests/data/checkpoints).

`countlens plan` prepares one batch of each stage's samples, so it needs the checkpoint's tokenizer
and chat template, which tests/data/checkpoints does not hold (its README: no tokenizer is copied).
`planning_dir` puts the real config.json and processor files beside the tokenizer and chat template of
the family's tiny test model (`tiny_models.build_tiny`): the real Qwen vocabulary for the Qwen models,
a small stand-in BPE for LLaVA-1.5 (`real_vocab.digit_bpe`). The widths, image sizes and image tokens
the plan sizes from are the real config's and processor's; the stand-in only sets the length of the
prompt's text. Where the stand-in's image token has another id than the config's, the copy's
``image_token_index`` / ``image_token_id`` is set to the stand-in's (the id enters no size). Where the
checkpoint's processor file was not found, a stand-in processor is written (`STAND_IN_PROCESSOR`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent / "data" / "checkpoints"

#: Real checkpoint directory → the tiny test model whose tokenizer and chat template stand in.
TOKENIZER_FROM = {
    "Qwen__Qwen2.5-VL-3B-Instruct": "qwen2_5_vl",
    "Qwen__Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen__Qwen3-VL-8B-Instruct": "qwen3_vl",
    "Qwen__Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe",
    "Qwen__Qwen3.5-27B": "qwen3_5",
    "Qwen__Qwen3.5-35B-A3B": "qwen3_5",
    "llava-hf__llava-1.5-7b-hf": "llava",
    "llava-hf__llava-onevision-qwen2-7b-ov-hf": "llava_onevision",
    "OpenGVLab__InternVL3-8B-hf": "internvl",
    "zai-org__GLM-4.1V-9B-Thinking": "glm4v",
    "mistralai__Mistral-Small-3.1-24B-Instruct-2503": "mistral3",
    "meta-llama__Llama-3.2-11B-Vision-Instruct": "mllama",
    "google__gemma-4-26B-A4B": "gemma4",
    "google__gemma-4-26B-A4B-it": "gemma4",
    "HuggingFaceTB__SmolVLM-256M-Instruct": "idefics3",
    "HuggingFaceTB__SmolVLM-500M-Instruct": "idefics3",
    "HuggingFaceTB__SmolVLM-Instruct": "idefics3",
    "HuggingFaceTB__SmolVLM2-2.2B-Instruct": "smolvlm",
}


def _qwen3_vl_budget(config: dict) -> dict:
    pre = json.loads((CHECKPOINTS / "Qwen__Qwen3-VL-30B-A3B-Instruct" / "preprocessor_config.json").read_text())
    return {k: pre[k] for k in ("size", "patch_size", "merge_size", "temporal_patch_size")}


#: Checkpoints whose processor file was not found (tests/data/checkpoints/README.md): the image
#: processor settings that size an image, for a stand-in processor (the tiny model's processor_config.json
#: with these set; its normalisation and the like size nothing). Each is named in the README: Qwen3.5's
#: processor is Qwen3-VL's class with Qwen3-VL's published budget, patch and merge (Qwen3.5's vision
#: config has the same patch 16, merge 2, temporal 2); Gemma 4's and Llama-3.2's take what their own
#: config.json fixes (patch, pooling and default token budget; tile side and tile count).
STAND_IN_PROCESSOR = {
    "Qwen__Qwen3.5-27B": _qwen3_vl_budget,
    "Qwen__Qwen3.5-35B-A3B": _qwen3_vl_budget,
    "google__gemma-4-26B-A4B": lambda c: {
        "patch_size": c["vision_config"]["patch_size"],
        "pooling_kernel_size": c["vision_config"]["pooling_kernel_size"],
        "max_soft_tokens": c["vision_config"]["default_output_length"],
    },
    "meta-llama__Llama-3.2-11B-Vision-Instruct": lambda c: {
        "size": {"height": c["vision_config"]["image_size"], "width": c["vision_config"]["image_size"]},
        "max_image_tiles": c["vision_config"]["max_num_tiles"],
    },
}
STAND_IN_PROCESSOR["google__gemma-4-26B-A4B-it"] = STAND_IN_PROCESSOR["google__gemma-4-26B-A4B"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def planning_dir(name: str, tiny_dir: Path, dest: Path) -> Path:
    """``dest`` holding checkpoint ``name``'s published files and the tokenizer files of ``tiny_dir`` (a
    saved tiny model of family `TOKENIZER_FROM[name]`)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in _TOKENIZER_FILES:
        if (tiny_dir / f).exists():
            shutil.copy(tiny_dir / f, dest / f)
    for f in (CHECKPOINTS / name).iterdir():
        shutil.copy(f, dest / f.name)
    config = json.loads((dest / "config.json").read_text())
    if name in STAND_IN_PROCESSOR:
        proc = json.loads((tiny_dir / "processor_config.json").read_text())
        proc["image_processor"].update(STAND_IN_PROCESSOR[name](config))
        if "image_seq_length" in proc:  # Gemma 4's processor repeats its image token this often
            proc["image_seq_length"] = proc["image_processor"]["max_soft_tokens"]
        (dest / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
    tiny = json.loads((tiny_dir / "config.json").read_text())
    for key in ("image_token_index", "image_token_id"):
        if key in config and key in tiny and config[key] != tiny[key]:
            config[key] = tiny[key]
            (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest
