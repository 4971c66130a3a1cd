"""A plannable directory for a real checkpoint's published config (tests/data/checkpoints).

`countlens plan` prepares one batch of each stage's samples, so it needs the checkpoint's tokenizer
and chat template, which tests/data/checkpoints does not hold (its README: no tokenizer is copied).
`planning_dir` puts the real config.json and processor files beside the tokenizer and chat template of
the family's tiny test model (`tiny_models.build_tiny`): the real Qwen vocabulary for the Qwen models,
a small stand-in BPE for LLaVA-1.5 (`real_vocab.digit_bpe`). The widths, image sizes and image tokens
the plan sizes from are the real config's and processor's; the stand-in only sets the length of the
prompt's text. Where the stand-in's image token has another id than the config's, the copy's
``image_token_index`` / ``image_token_id`` is set to the stand-in's (the id enters no size).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent / "data" / "checkpoints"

#: Real checkpoint directory → the tiny test model whose tokenizer and chat template stand in.
TOKENIZER_FROM = {
    "Qwen__Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen__Qwen3-VL-8B-Instruct": "qwen3_vl",
    "llava-hf__llava-1.5-7b-hf": "llava",
}
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
    tiny = json.loads((tiny_dir / "config.json").read_text())
    for key in ("image_token_index", "image_token_id"):
        if key in config and key in tiny and config[key] != tiny[key]:
            config[key] = tiny[key]
            (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest
