"""Test-wide settings: offline, few threads, deterministic."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # What a worker starts (notebook kernels, torchrun ranks, bench scripts) takes one thread too: two
    # OpenMP threads on the one core the other worker leaves spin against each other (a notebook's kernel
    # ran 7× slower than alone).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`make test` runs one worker per core) each worker takes one core: tiny models spend
# their time in Python, and two threads per worker would only contend.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ holds shared builders (tiny_models)

from disk_cache import cached_dir, entry_key  # noqa: E402
from tiny_models import build_tiny  # noqa: E402

from countlens.toy.tiny_models import write_added_tokens  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-subset",
        action="store_true",
        help="of each parametrized numeric test, its first case only, but every case of one marked "
        "numeric(every_case=True): what `make test-kernels` reruns under other CPU kernels",
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """A ``matrix`` test's cases after its first are ``slow``: the inner loop (-m 'not slow') runs each
    matrix on one family, `make test` on all. ``--kernel-subset``: every kind of numeric comparison once,
    every family's matrix row; the native run (`make test`) has already run every case under this
    machine's own kernels."""
    first: set = set()
    for item in items:
        if item.get_closest_marker("matrix"):
            function = (item.path, item.originalname)
            if function in first:
                item.add_marker(pytest.mark.slow)
            first.add(function)
    if not config.getoption("--kernel-subset"):
        return
    seen, keep, drop = set(), [], []
    for item in items:
        marker = item.get_closest_marker("numeric")
        function = (item.path, item.originalname)
        if marker is None or (function in seen and not marker.kwargs.get("every_case")):
            drop.append(item)
        else:
            seen.add(function)
            keep.append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _save_tiny(name: str, kw: dict, path: Path) -> None:
    model, processor = build_tiny(name, **kw)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    write_added_tokens(path, processor.tokenizer)


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """``make(name, **kw)``: the directory of the tiny ``name`` model and processor (`build_tiny`
    keywords), built once and kept in the tests' disk cache (`disk_cache`) for later sessions and
    other workers. Read it; a test that changes a checkpoint's files copies them first."""

    def make(name: str, **kw) -> Path:
        args = (name, *sorted(kw.items()))
        return cached_dir(entry_key("tiny", *args), lambda path: _save_tiny(name, kw, path))

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


@pytest.fixture(scope="session")
def small_transcoders(loaded):
    """The graph tests' shared transcoders of the organism (TopK, width 32, k 4, 8 steps on 16 counting
    scenes, one torch thread), trained once a session. Read them, don't change them."""
    from countlens.features import train_transcoders

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_transcoders(loaded("toy"), width=32, k=4, steps=8, mix={"count": 16}, progress=False).transcoders
    finally:
        torch.set_num_threads(before)


_SHARED: dict[tuple, tuple] = {}  # (name, load keywords) → (VLM, its fingerprint at load)
_FETCHED: set[tuple] = set()  # the shared models handed out during the current test


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
        _FETCHED.add(key)
        return _SHARED[key][0]

    return get


def _check_shared(keys, who: str) -> None:
    """Fail naming ``who`` if a shared model of ``keys`` changed since it was loaded."""
    for key in [k for k in keys if k in _SHARED]:
        vlm, before = _SHARED[key]
        if _fingerprint(vlm) != before:
            del _SHARED[key]  # later tests get a fresh load instead of the changed one
            pytest.fail(
                f"{who} changed the shared model {key[0]!r} (weights, hooks, modules or "
                "mode): load a private copy with countlens.load for a test that edits a model",
                pytrace=False,
            )


@pytest.fixture(autouse=True)
def _noise_tolerated(request):
    """Most tests check mechanics (two code paths agree) on random-init models, whose pairs differ by noise:
    there a normaliser below the noise rule is marked, not refused (`countlens.circuits.tolerate_noise`).
    A test marked ``noise_rule`` runs with the rule enforced, as every user's call is."""
    from countlens.circuits.engine.pair_batch import tolerate_noise

    if request.node.get_closest_marker("noise_rule"):
        yield
        return
    with tolerate_noise():
        yield


@pytest.fixture(autouse=True)
def _shared_models_stay_unchanged(request):
    """After each test, the shared models it was handed (fingerprinting every model after every test cost
    ~10–20 ms a test); a model a module- or class-scoped fixture handed out earlier is checked when the
    module ends (`_shared_models_stay_unchanged_in_module`)."""
    _FETCHED.clear()
    yield
    _check_shared(sorted(_FETCHED, key=repr), request.node.nodeid)


@pytest.fixture(autouse=True, scope="module")
def _shared_models_stay_unchanged_in_module(request):
    yield
    _check_shared(list(_SHARED), f"a test of {request.node.nodeid}")
