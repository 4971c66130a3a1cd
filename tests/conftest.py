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


def _fingerprint(vlm) -> tuple:
    """What a test could change on a shared model: its modules, their hooks, and each tensor's identity
    and in-place-edit counter (``_version`` grows on every in-place write, ``p.data[...] = …`` too)."""
    model = vlm.hf
    tensors = tuple(
        (n, t.data_ptr(), t._version, t.requires_grad) for n, t in [*model.named_parameters(), *model.named_buffers()]
    )
    # transformers installs its own output-capturing hooks on a model's first forward: not a test's doing.
    hooks = tuple(
        (name, getattr(h, "__qualname__", repr(h)))
        for name, m in model.named_modules()
        for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values(), *m._backward_hooks.values())
        if not getattr(h, "__module__", "").startswith("transformers.")
    )
    return tensors, hooks, model.training, type(model), vlm.processor, vlm.tokenizer


_SHARED: dict[tuple, tuple] = {}  # (name, load keywords) → (VLM, its fingerprint at load)


@pytest.fixture(scope="session")
def loaded(tiny_checkpoint):
    """``loaded(name, **load_kw)``: the organism ("toy") or a tiny architecture (`build_tiny` names),
    loaded once per session and shared by every test that reads it. Read it, don't change it: a test
    that edits weights, adds LoRA, leaves a hook or trains loads its own with `countlens.load` — one
    that changes a shared model anyway fails at its end (`_shared_models_stay_unchanged`)."""
    import countlens

    def get(name: str, **kw):
        key = (name, *sorted(kw.items()))
        if key not in _SHARED:
            vlm = countlens.load("toy" if name == "toy" else tiny_checkpoint(name), **kw)
            _SHARED[key] = (vlm, _fingerprint(vlm))
        return _SHARED[key][0]

    return get


@pytest.fixture(autouse=True)
def _shared_models_stay_unchanged(request):
    yield
    for key, (vlm, before) in list(_SHARED.items()):
        if _fingerprint(vlm) != before:
            del _SHARED[key]  # later tests get a fresh load instead of the changed one
            pytest.fail(
                f"{request.node.nodeid} changed the shared model {key[0]!r} (weights, hooks, modules or "
                "mode): load a private copy with countlens.load for a test that edits a model",
                pytrace=False,
            )
