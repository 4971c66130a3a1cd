import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds shared fixtures (tiny_models)

from tiny_models import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``make(name)``: the tiny ``name`` model and processor saved to a directory, once per session."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            model, processor = build_tiny(name)
            model.save_pretrained(path)
            processor.save_pretrained(path)
            made[name] = path
        return made[name]

    return make


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is faster than two, and leaves the other core to other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
