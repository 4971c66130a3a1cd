"""Per-layer transcoders (`countlens.features`): the circuit-tracer file format (round trip, a folder
written by hand, every refusal), the activations, the replacement model's hooks, and training's
determinism and resumption."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import save_file
from tolerance import assert_close, bound, scale_of

import countlens.features.train as train_module
from countlens.errors import InputError
from countlens.features import (
    Transcoder,
    TranscoderSet,
    fvu,
    load_transcoders,
    replacement,
    replacement_accuracy,
    save_transcoders,
    train_transcoders,
)
from countlens.features.files import CONFIG

D_MODEL, N_LAYERS = 128, 6  # the organism's
SMALL_MIX = {"count": 4, "color": 1, "shape": 1, "text": 2}


def random_set(
    n=N_LAYERS, d_model=D_MODEL, width=64, activation="topk", k=8, skip=False, seed=0, dtype=torch.float32
) -> TranscoderSet:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        threshold = torch.rand(width, generator=g) * 0.1 if activation == "jumprelu" else None
        tc = Transcoder(
            d_model, width, activation, k=k if activation == "topk" else None, threshold=threshold, skip=skip
        )
        with torch.no_grad():
            for p in tc.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        out.append(tc.to(dtype))
    return TranscoderSet(out, model_name="toy", scan="test/random")


def write_layer(folder, i, width=16, d_model=D_MODEL, extra=None, seed=0, **drop):
    g = torch.Generator().manual_seed(seed + i)
    tensors = {
        "W_enc": torch.randn(width, d_model, generator=g),
        "W_dec": torch.randn(width, d_model, generator=g),
        "b_enc": torch.randn(width, generator=g),
        "b_dec": torch.randn(d_model, generator=g),
        "activation_function.threshold": torch.rand(width, generator=g),
    }
    tensors.update(extra or {})
    for key in drop.get("without", ()):
        tensors.pop(key)
    save_file(tensors, str(folder / f"layer_{i}.safetensors"))
    return tensors


def write_set(folder, n=N_LAYERS, config=None, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        "model_kind": "transcoder_set",
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out",
        "model_name": "toy",
        "scan": "hand/written",
    }
    (folder / CONFIG).write_text(yaml.safe_dump({**base, **(config or {})}))
    return [write_layer(folder, i, **kw) for i in range(n)]


# ----------------------------------------------------------------------------- the file format


@pytest.mark.parametrize(
    "kw",
    [{}, {"activation": "jumprelu", "skip": True}, {"activation": "relu", "dtype": torch.bfloat16}],
    ids=["topk", "jumprelu-skip", "relu-bf16"],
)
def test_save_load_round_trip_is_bit_for_bit(tmp_path, loaded, kw):
    vlm = loaded("toy")
    original = random_set(**kw)
    save_transcoders(original, tmp_path / "set")
    back = load_transcoders(tmp_path / "set", vlm)
    assert (back.model_name, back.scan, back.layers) == ("toy", "test/random", original.layers)
    for a, b in zip(original, back):
        assert (a.activation, a.k) == (b.activation, b.k)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    config = yaml.safe_load((tmp_path / "set" / CONFIG).read_text())
    assert config["model_kind"] == "transcoder_set" and config["feature_input_hook"] == "mlp.hook_in"
    if original[0].activation == "topk":
        assert (config["activation"], config["k"]) == ("topk", 8)
    # Saving again over a set replaces it; no temp folder is left beside it.
    save_transcoders(random_set(seed=1), tmp_path / "set")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


@pytest.mark.numeric
def test_a_hand_written_circuit_tracer_folder_loads_as_jumprelu(tmp_path, loaded):
    tensors = write_set(tmp_path / "ct")
    tcs = load_transcoders(tmp_path / "ct", loaded("toy"))
    assert len(tcs) == N_LAYERS and tcs.d_transcoder == 16 and tcs[2].activation == "jumprelu"
    x = torch.randn(5, D_MODEL, generator=torch.Generator().manual_seed(3))
    t = tensors[2]
    pre = x @ t["W_enc"].T + t["b_enc"]
    by_hand = pre * (pre > t["activation_function.threshold"])
    # F.linear against a matmul and an add: float32 sums of 128 products, rounding relative to the
    # products' sizes (Σ|W x| ≈ 100 here; the pre-activations reach 27). No pre-activation lies within
    # that bound of its threshold (the nearest is 0.0045 away), so rounding cannot turn a feature on or off.
    summed = scale_of(x.abs() @ t["W_enc"].abs().T)
    assert float((pre - t["activation_function.threshold"]).abs().min()) > bound(summed)
    assert_close(tcs[2].encode(x), by_hand, scale=summed, what="JumpReLU encode")
    decoded = scale_of(by_hand.abs() @ t["W_dec"].abs(), summed)  # the decoder's sums, over encode's rounding
    assert_close(tcs[2](x), by_hand @ t["W_dec"] + t["b_dec"], scale=decoded, what="JumpReLU reconstruction")
    # circuit-tracer's TopK sets carry k as a scalar tensor in each layer file.
    write_set(tmp_path / "topk", extra={"k": torch.tensor(3)}, without=["activation_function.threshold"])
    topk = load_transcoders(tmp_path / "topk", loaded("toy"))
    assert topk[0].activation == "topk" and topk[0].k == 3


def refusal_cases():
    def other_format(f):
        f.mkdir()
        (f / "cfg.json").write_text("{}")
        save_file({"W_enc": torch.zeros(2, 2)}, str(f / "sae_weights.safetensors"))

    def other_kind(f):
        write_set(f, config={"model_kind": "cross_layer_transcoder"})

    def missing_layer(f):
        write_set(f)
        (f / "layer_3.safetensors").unlink()

    def widths_differ(f):
        write_set(f)
        write_layer(f, 4, width=32)

    def d_model_differs(f):
        write_set(f, d_model=64)

    def too_few_layers(f):
        write_set(f, n=4)

    def unknown_tensor(f):
        write_set(f, extra={"W_gate": torch.zeros(3)})

    def unknown_key(f):
        write_set(f, config={"sparsity": 0.1})

    def other_hook(f):
        write_set(f, config={"feature_input_hook": "hook_resid_mid"})

    def missing_tensor(f):
        write_set(f, without=["b_dec"])

    return [
        (other_format, "another format"),
        (other_kind, "another format"),
        (missing_layer, r"layers \[3\]"),
        (widths_differ, "differ in d_transcoder"),
        (d_model_differs, "hidden size is 128"),
        (too_few_layers, "holds 4 layers, but toy has 6"),
        (unknown_tensor, "W_gate"),
        (unknown_key, "sparsity"),
        (other_hook, "hook_resid_mid"),
        (missing_tensor, "lacks"),
    ]


@pytest.mark.parametrize("make, message", refusal_cases(), ids=lambda c: getattr(c, "__name__", ""))
def test_load_refuses_before_any_forward(tmp_path, loaded, make, message):
    make(tmp_path / "bad")
    with pytest.raises(InputError, match=message):
        load_transcoders(tmp_path / "bad", loaded("toy"))


def test_save_refuses_a_partial_set_and_a_foreign_folder(tmp_path):
    partial = TranscoderSet([Transcoder(8, 16, k=2)], layers=[2])
    with pytest.raises(InputError, match="layers 0 … n − 1"):
        save_transcoders(partial, tmp_path / "p")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a transcoder set"):
        save_transcoders(random_set(n=2, d_model=8), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "p").exists()


# ----------------------------------------------------------------------------- the transcoder


def test_topk_keeps_exactly_k():
    tc = Transcoder(8, 32, "topk", k=5)
    with torch.no_grad():
        tc.W_enc.copy_(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)))
        tc.b_enc.fill_(100.0)  # every pre-activation positive: exactly k survive
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    a, pre = tc.encode(x), tc.pre_activations(x)
    assert ((a != 0).sum(-1) == 5).all()
    top = pre.topk(5, dim=-1)
    assert torch.equal(a.gather(-1, top.indices), top.values)  # encode's top-k of the same pre_activations call
    with pytest.raises(InputError, match="k=40"):
        Transcoder(8, 32, "topk", k=40)
    with pytest.raises(InputError, match="needs k"):
        Transcoder(8, 32, "topk")


def test_fvu_of_a_perfect_reconstruction_is_zero_and_of_the_mean_one():
    y = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    assert fvu(y, y.clone()) == 0.0
    assert fvu(y, y.mean(0).expand_as(y)) == pytest.approx(1.0)
    with pytest.raises(InputError, match="do not vary"):
        fvu(torch.ones(3, 2), torch.ones(3, 2))


# ----------------------------------------------------------------------------- the replacement model


@pytest.mark.numeric
def test_replacement_writes_the_transcoders_reconstruction(loaded):
    from countlens.datasets.tasks import task_samples

    vlm = loaded("toy")
    tcs = random_set(skip=True)
    samples = task_samples("count", 2, seed=0)
    batch = vlm.prepare_samples(samples)
    seen = {}
    module = vlm.hf.get_submodule(vlm.arch.mlp(3))

    def record(mod, args, output):
        seen["x"], seen["y"] = args[0].detach().clone(), output.detach().clone()

    with replacement(vlm, tcs):
        handle = module.register_forward_hook(record)  # after the swap: sees its output
        try:
            vlm.forward(batch)
        finally:
            handle.remove()
    tc = tcs[3]
    by_hand = tc.decode(tc.encode(seen["x"]), seen["x"])
    # The swap's output against the transcoder called on the recorded input: float32 rounding of its sums.
    assert_close(seen["y"], by_hand, what="the replacement's MLP output")
    # Outside the block the MLP is the model's own again.
    handle = module.register_forward_hook(record)
    try:
        vlm.forward(batch)
    finally:
        handle.remove()
    assert not torch.allclose(seen["y"], tc.decode(tc.encode(seen["x"]), seen["x"]), atol=1e-3)


def test_replacement_accuracy_sets_original_beside_replacement(loaded):
    from countlens.analysis.evaluate import score
    from countlens.datasets.tasks import task_samples

    vlm = loaded("toy")
    samples = task_samples("count", 6, seed=0)
    ds = replacement_accuracy(vlm, random_set(), samples)
    assert list(ds.model.values) == ["original", "replacement"]
    assert ds.accuracy.sel(model="original") == score(vlm, samples).correct.values.mean()
    assert 0 <= float(ds.agreement) <= 1 and ds.attrs["transcoders"] == "test/random"
    with pytest.raises(InputError, match="hidden size"):
        replacement_accuracy(vlm, random_set(n=2, d_model=64), samples)


# ----------------------------------------------------------------------------- training


def small_run(vlm, **kw):
    args = dict(layers=[0, 1], width=32, k=4, steps=6, batch_tokens=64, mix=SMALL_MIX, progress=False)
    return train_transcoders(vlm, **{**args, **kw})


def weights(training):
    return [tc.state_dict() for tc in training.transcoders]


def same(a, b) -> bool:
    return all(torch.equal(x[key], y[key]) for x, y in zip(a, b) for key in x)


def test_training_is_deterministic_and_resumes_to_the_same_weights(tmp_path, loaded, monkeypatch):
    vlm = loaded("toy")
    full = small_run(vlm, out=tmp_path / "full", checkpoint_every=2)
    assert same(weights(full), weights(small_run(vlm)))  # same seed, no checkpoint: same weights
    assert not same(weights(full), weights(small_run(vlm, seed=1)))
    table = full.fidelity
    assert list(table.layer.values) == [0, 1] and (table.l0 <= 4).all() and (table.fvu >= 0).all()
    assert '"text": 2' in table.attrs["dataset"] and table.attrs["seed"] == 0

    calls, step = [], train_module.train_step

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 9:  # layer 1, step 3: its checkpoint is at step 2
            raise KeyboardInterrupt
        return step(*args)

    monkeypatch.setattr(train_module, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        small_run(vlm, out=tmp_path / "cut", checkpoint_every=2)
    monkeypatch.setattr(train_module, "train_step", step)
    calls.clear()

    def counted(*args):
        calls.append(1)
        return step(*args)

    monkeypatch.setattr(train_module, "train_step", counted)
    resumed = small_run(vlm, out=tmp_path / "cut", checkpoint_every=2)
    assert len(calls) == 4  # layer 1's steps 3 … 6 only
    assert same(weights(full), weights(resumed))
    with pytest.raises(InputError, match="checkpoint of another training"):
        small_run(vlm, out=tmp_path / "cut", checkpoint_every=2, seed=5)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"k": 64}, "k=64 is more than width=32"),
        ({"layers": [0, 9]}, r"layers \[9\]"),
        ({"layers": [1, 0]}, "increasing"),
        ({"mix": {"count": 2, "dogs": 3}}, "dogs"),
        ({"mix": {"count": 0}}, "no samples"),
        ({"lr": 0}, "lr"),
        ({"seed": -1}, "seed"),
        ({"held_out": 1.0}, "held_out"),
        ({"out": __file__}, "is a file"),
    ],
)
def test_training_refuses_bad_arguments_before_any_forward(loaded, kw, message):
    with pytest.raises(InputError, match=message):
        small_run(loaded("toy"), **kw)
