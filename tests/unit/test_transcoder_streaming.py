"""Transcoders trained from activations streamed from disk (`countlens.features.activations`' store):
one chunk held at a time, the same weights as in memory where the data are the same, bad stores
refused before any forward or step."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import countlens.features.train as train_module
from countlens.errors import DeviceError, InputError
from countlens.features import train_transcoders
from countlens.features.activation_store import MANIFEST, ActivationStore, open_store
from countlens.features.activations import Activations, collect_activations, fidelity, mix_samples

NO_TEXT = {"count": 4, "color": 1, "shape": 1}
MIX = {"count": 4, "color": 1, "shape": 1, "text": 2}
#: Bytes per token of the toy's two layers (inputs and outputs, float32, d_model 128).
PER_TOKEN = 2 * 2 * 128 * 4


def run(vlm, **kw):
    args = dict(layers=[0, 1], width=32, k=4, steps=12, batch_tokens=32, mix=MIX, progress=False)
    return train_transcoders(vlm, **{**args, **kw})


def same(a, b) -> bool:
    return all(torch.equal(x.state_dict()[key], y.state_dict()[key]) for x, y in zip(a, b) for key in x.state_dict())


@contextlib.contextmanager
def no_forward(vlm):
    def refuse(*args, **kwargs):
        raise AssertionError("a forward ran")

    handle = vlm.hf.register_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


def test_one_chunk_in_the_given_order_trains_bit_for_bit_as_in_memory(loaded, tmp_path, monkeypatch):
    vlm = loaded("toy")
    memory = run(vlm, mix=NO_TEXT)
    given_order = train_module.collect_activations

    def unshuffled(*args, **kw):
        return given_order(*args, **{**kw, "order_seed": None})

    monkeypatch.setattr(train_module, "collect_activations", unshuffled)
    streamed = run(vlm, mix=NO_TEXT, max_memory=1000, out=tmp_path)  # streamed; one batch, so one chunk
    assert [len(open_store(tmp_path / "activations" / s, vlm, [0, 1])) for s in ("train", "held_out")] == [1, 1]
    assert same(memory.transcoders, streamed.transcoders)
    # held-out FVU: the two-pass formula in memory, running sums from the store
    assert torch.allclose(torch.tensor(memory.fidelity.fvu.values), torch.tensor(streamed.fidelity.fvu.values))
    assert (memory.fidelity.l0 == streamed.fidelity.l0).all() and (memory.fidelity.dead == streamed.fidelity.dead).all()


def test_streamed_training_holds_one_chunk_and_stays_near_the_in_memory_result(loaded, tmp_path, monkeypatch):
    vlm = loaded("toy")
    live: list[weakref.ref] = []
    most = []
    read = ActivationStore.read

    def counted(self, layer, index):
        most.append(sum(ref() is not None for ref in live))  # chunk tensors still alive at this read
        pair = read(self, layer, index)
        live.extend(weakref.ref(t) for t in pair)
        return pair

    monkeypatch.setattr(ActivationStore, "read", counted)
    bound = 40 * PER_TOKEN  # under one scene (about 50 tokens)
    streamed = run(vlm, steps=30, max_memory=bound, batch_size=1, out=tmp_path)
    store = open_store(tmp_path / "activations" / "train", vlm, [0, 1])
    assert len(store) >= 6 and max(most) == 0  # many chunks, never two held
    # collecting: a chunk is flushed once it reaches the bound, so it holds < bound + one sample
    longest = max(len(x) for x, _ in (store.read(0, i) for i in range(len(store))))
    assert all(n * PER_TOKEN < bound + longest * PER_TOKEN for n in store.chunk_tokens)
    assert store.n_tokens == sum(json.loads(streamed.fidelity.attrs["dataset"])["tokens"]["train"].values())
    # every kind is in the store (kinds read back), and the held-out split was streamed too
    assert set(store.kinds) == {"count", "color", "shape", "text"}
    memory = run(vlm, steps=30)
    # two paths (other batches): the held-out FVU within 0.05 of each other, L0 = k
    assert abs(memory.fidelity.fvu - streamed.fidelity.fvu).max() < 0.05
    assert (streamed.fidelity.l0 == 4).all()


def test_a_store_keeps_the_activations_exactly(loaded, tmp_path):
    vlm = loaded("toy")
    samples = mix_samples(MIX, 0)
    memory = collect_activations(vlm, [2], *samples, batch_size=1)  # padding is a batch's
    store = collect_activations(vlm, [2], *samples, store=tmp_path, max_memory=50 * 1024, batch_size=1)
    assert len(store) > 1
    x = torch.cat([store.read(2, i)[0] for i in range(len(store))])
    assert torch.equal(x, memory.inputs[2]) and list(store.kinds) == list(memory.kinds)


STREAMED = dict(max_memory=1000, batch_size=1)  # a chunk per sample


@pytest.fixture(scope="module")
def streamed(loaded, tmp_path_factory):
    """(the out folder of one streamed training, its result): copied by the tests that change it."""
    out = tmp_path_factory.mktemp("streamed")
    return out, run(loaded("toy"), out=out, **STREAMED)


def copied(streamed, tmp_path):
    shutil.copytree(streamed[0], tmp_path, dirs_exist_ok=True)
    return tmp_path / "activations" / "train"


def refused(vlm, out, match, monkeypatch):
    step = train_module.train_step
    monkeypatch.setattr(train_module, "train_step", lambda *a: (_ for _ in ()).throw(AssertionError("a step")))
    (out / "checkpoint.pt").unlink()  # so that training would start over
    before = sorted(p.name for p in out.rglob("*"))
    with no_forward(vlm), pytest.raises(InputError, match=match):
        run(vlm, out=out, **STREAMED)
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing written
    monkeypatch.setattr(train_module, "train_step", step)


def test_a_store_of_another_model_is_refused_before_any_forward(loaded, streamed, tmp_path, monkeypatch):
    vlm = loaded("toy")
    folder = copied(streamed, tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "model": "Qwen/Qwen2.5-VL-7B-Instruct", "d_model": 3584}))
    refused(vlm, tmp_path, "holds the activations of .*Qwen.*delete", monkeypatch)


@pytest.mark.parametrize(
    "setting, value", [("dtype", "bfloat16"), ("grid", {"image": [448, 448], "patch": 14, "merge": 2})]
)
def test_a_store_of_the_model_in_another_dtype_or_image_size_is_refused(
    loaded, streamed, tmp_path, monkeypatch, setting, value
):
    """The same checkpoint loaded in another dtype or at another image size makes other activations: the
    manifest records both, and a store made otherwise is refused before any forward."""
    vlm = loaded("toy")
    folder = copied(streamed, tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert (
        manifest["settings"]["dtype"] == "float32" and manifest["settings"]["grid"]["patch"] == vlm.geometry.patch_size
    )
    manifest["settings"][setting] = value
    (folder / MANIFEST).write_text(json.dumps(manifest))
    refused(vlm, tmp_path, f"other settings: .*{setting}", monkeypatch)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda t: {**t, "in.1": t["in.1"][:, :64].contiguous()}, r"in\.1.* are \[\(\[\d+, 64\]"),
        (lambda t: {**t, "out.0": t["out.0"].double()}, "float64"),
        (lambda t: {**t, "out.1": t["out.1"].index_fill(0, torch.tensor([1]), math.nan)}, r"out\.1 holds NaN"),
        (lambda t: {key: v for key, v in t.items() if key != "kinds"}, "kinds"),
    ],
    ids=["width", "dtype", "nan", "missing"],
)
def test_a_damaged_store_is_refused_before_training(loaded, streamed, tmp_path, monkeypatch, damage, match):
    vlm = loaded("toy")
    folder = copied(streamed, tmp_path)
    chunk = folder / "chunk00000.safetensors"
    save_file(damage(load_file(chunk)), chunk)
    refused(vlm, tmp_path, match, monkeypatch)


def test_an_unfinished_store_is_refused_by_name(loaded, tmp_path):
    with pytest.raises(InputError, match="no manifest.json: an interrupted collection"):
        open_store(tmp_path, loaded("toy"), [0])


@pytest.mark.parametrize("bound", [0, -5, math.nan, math.inf, True, "4GB"])
def test_a_bad_memory_bound_is_refused_before_anything(loaded, tmp_path, bound):
    vlm = loaded("toy")
    message = r"max_memory \(bytes, e.g. 4294967296: 4 GiB\) must be a finite number > 0"
    with no_forward(vlm), pytest.raises(InputError, match=message):
        run(vlm, max_memory=bound, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="max_memory"):
        collect_activations(vlm, [0], *mix_samples(MIX, 0), store=tmp_path / "s", max_memory=bound)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("value", ["0", "nan", "inf", "-1"])
def test_the_cli_refuses_a_bad_memory_bound_before_loading(tmp_path, value, monkeypatch):
    from typer.testing import CliRunner

    import countlens
    from countlens.cli import app

    monkeypatch.setattr(countlens, "load", lambda *a, **k: pytest.fail("the model loaded"))
    result = CliRunner().invoke(app, ["features", "train", "--out", str(tmp_path / "o"), "--max-memory", value])
    assert result.exit_code == 2 and "--max-memory must be a finite number of GiB" in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_training_on_an_explicit_device_is_the_default_and_a_bad_one_is_refused(loaded, tmp_path):
    vlm = loaded("toy")
    assert same(run(vlm, steps=3).transcoders, run(vlm, steps=3, device="cpu").transcoders)
    with no_forward(vlm), pytest.raises(InputError, match="device 'gpu0' is not a torch device"):
        run(vlm, device="gpu0", out=tmp_path / "o")
    if not torch.cuda.is_available():  # a GPU this machine lacks: refused before any forward, not after collecting
        with no_forward(vlm), pytest.raises(DeviceError, match="'cuda'.*give 'cpu'"):
            run(vlm, device="cuda", out=tmp_path / "o")
        tcs, d = run(vlm, steps=1).transcoders, vlm.arch.d_model
        held = Activations({0: torch.zeros(1, d)}, {0: torch.zeros(1, d)}, np.array(["count"], dtype=object))
        with pytest.raises(DeviceError, match="'cuda:1'"):
            fidelity(tcs, held, device="cuda:1")
    assert not (tmp_path / "o").exists()


def test_an_interrupted_collection_is_collected_again_and_a_finished_store_reused(loaded, streamed, tmp_path):
    vlm = loaded("toy")
    forwards = []

    def third(*args):
        forwards.append(1)
        if len(forwards) == 3:
            raise KeyboardInterrupt

    handle = vlm.hf.register_forward_pre_hook(third)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(vlm, out=tmp_path / "cut", **STREAMED)
    finally:
        handle.remove()
    train = tmp_path / "cut" / "activations" / "train"
    assert any(train.glob("chunk*.safetensors")) and not (train / MANIFEST).exists()  # unfinished: no manifest
    resumed = run(vlm, out=tmp_path / "cut", **STREAMED)
    assert same(resumed.transcoders, streamed[1].transcoders)  # as the uninterrupted run
    copied(streamed, tmp_path / "again")
    (tmp_path / "again" / "checkpoint.pt").unlink()
    with no_forward(vlm):  # a finished store is read, not collected again
        again = run(vlm, out=tmp_path / "again", **STREAMED)
    assert same(again.transcoders, streamed[1].transcoders)
