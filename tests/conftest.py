"""Test-wide settings: offline, few threads, deterministic."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ holds shared builders (tiny_models)

from tiny_models import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``make(name, **kw)``: the tiny ``name`` model and processor (`build_tiny` keywords) saved to a
    directory, once per session."""
    made: dict[tuple, Path] = {}

    def make(name: str, **kw) -> Path:
        key = (name, *sorted(kw.items()))
        if key not in made:
            path = tmp_path_factory.mktemp(name)
            model, processor = build_tiny(name, **kw)
            model.save_pretrained(path)
            processor.save_pretrained(path)
            made[key] = path
        return made[key]

    return make

