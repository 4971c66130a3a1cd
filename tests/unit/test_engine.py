"""The engine under the sites (`countlens.circuits.engine`): its hook backend, its one freeze, and the
sweeps' runner checking pairs once at the door. Each against plain torch or the model's own forward."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

import countlens.circuits.engine.pair_batch as pair_batch
from countlens.circuits.engine import Hook, hooked
from countlens.circuits.engine.freeze import Clamp, frozen, norm_paths, qk_paths
from countlens.circuits.engine.record import record
from countlens.circuits.methods.patching import patch_heads
from countlens.circuits.sites import HeadZ, MlpOut, Residual
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError


@pytest.fixture(scope="module")
def organism(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def batch(organism):
    pairs = count_pairs(2, seed=5, grid=organism.geometry)
    return organism.prepare_samples([p.clean for p in pairs])


def _hooks_on(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooked_reads_and_writes_as_a_plain_hook_does_and_always_removes_its_hooks(organism, batch):
    arch, hf = organism.arch, organism.hf
    before = _hooks_on(hf)
    seen = {}
    plain = hf.get_submodule(arch.o_proj(0)).register_forward_pre_hook(lambda m, a: seen.update(plain=a[0].clone()))
    try:
        with torch.no_grad(), hooked(hf, [Hook(arch.o_proj(0), "input", lambda z: seen.update(engine=z.clone()))]):
            hf(**batch.inputs, use_cache=False, logits_to_keep=1)
    finally:
        plain.remove()
    assert torch.equal(seen["engine"], seen["plain"])  # one tensor read twice
    with torch.no_grad(), hooked(hf, [Hook(arch.layer(0), "output", torch.zeros_like)]):
        zeroed = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits
    with torch.no_grad():
        ref = hf.get_submodule(arch.layer(0)).register_forward_hook(lambda m, a, o: torch.zeros_like(o))
        try:
            expected = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits
        finally:
            ref.remove()
    assert torch.equal(zeroed, expected)  # one computation, two ways of hooking it
    with (
        pytest.raises(AttributeError),
        hooked(hf, [Hook(arch.layer(0), "output", print), Hook("no.such", "output", print)]),
    ):
        pass
    with pytest.raises(RuntimeError, match="inside"), hooked(hf, [Hook(arch.layer(0), "output", print)]):
        raise RuntimeError("inside")
    assert _hooks_on(hf) == before


def test_frozen_detach_keeps_the_forward_and_a_clamp_of_the_run_replays_it(organism, batch):
    hf = organism.hf
    with torch.no_grad():
        plain = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits.float()
        with frozen(organism, norms="detach", attention="detach"):
            held = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits.float()
        clamp = Clamp()
        with hooked(hf, clamp.hooks(organism)):
            hf(**batch.inputs, use_cache=False, logits_to_keep=1)
        clamp.close(organism)
        with frozen(organism, norms=clamp, attention=clamp):
            replayed = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits.float()
    assert_close(held, plain, what="logits with norms and attention detached")
    assert_close(replayed, plain, what="logits with the clean run's norm scales and q, k replayed")
    assert set(clamp.scales) == set(norm_paths(organism)) and set(clamp.qk) == set(qk_paths(organism))

    # Clamp.only: the chosen norm held (one hook, on it), the others live; on the clean input it replays
    final = organism.arch.final_norm
    before = _hooks_on(hf)
    with torch.no_grad(), frozen(organism, norms=clamp.only([final])):
        assert _hooks_on(hf) - before == 1
        alone = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits.float()
    assert_close(alone, plain, what="logits with the final norm's clean scale replayed")
    assert list(clamp.only([final]).scales) == [final] and not clamp.only([final]).qk
    with pytest.raises(InputError, match="no recorded norms"):
        clamp.only(["nowhere"])
    with pytest.raises(InputError, match="holds no norm scales"), frozen(organism, norms=Clamp()):
        pass


def test_frozen_attention_holds_q_and_k_out_of_the_gradient(organism, batch):
    """In a forward whose stream carries a gradient, q and k carry none under frozen attention (v does)."""
    arch, hf = organism.arch, organism.hf
    got = {}

    def leaf(x):
        return x.detach().requires_grad_(True)

    def seen(name):
        return lambda t: got.update({name: t.requires_grad})

    probes = [Hook(arch.layer(0), "input", leaf)]
    probes += [Hook(p(1), "output", seen(p.__name__)) for p in (arch.q_proj, arch.k_proj, arch.v_proj)]
    with torch.enable_grad(), frozen(organism, attention="detach"), hooked(hf, probes):
        hf(**batch.inputs, use_cache=False, logits_to_keep=1)
    assert got == {"q_proj": False, "k_proj": False, "v_proj": True}
    with torch.enable_grad(), hooked(hf, probes):
        hf(**batch.inputs, use_cache=False, logits_to_keep=1)
    assert got == {"q_proj": True, "k_proj": True, "v_proj": True}


def test_frozen_refuses_what_it_cannot_hold(organism, loaded):
    with pytest.raises(InputError, match="'detach' or a Clamp"), frozen(organism, norms="scale"):
        pass
    hybrid = loaded("qwen3_5")
    with pytest.raises(InputError, match="softmax self-attention only"), frozen(hybrid, attention="detach"):
        pass


def test_a_sweep_checks_its_pairs_once_at_the_door(organism, monkeypatch):
    """patch_heads over 3 chunks: the pairs are checked once, not once more per call layer and per chunk."""
    pairs = count_pairs(3, seed=2, grid=organism.geometry)
    calls = []
    real = pair_batch.check_pairs
    monkeypatch.setattr(pair_batch, "check_pairs", lambda *a: calls.append("prepare") or real(*a))
    import countlens.circuits.engine.sweep as sweep

    real_sweep = sweep.check_pairs
    monkeypatch.setattr(sweep, "check_pairs", lambda *a: calls.append("door") or real_sweep(*a))
    patch_heads(organism, pairs, batch_size=1)
    assert calls == ["door"]


def test_record_keys_by_site_and_label_and_its_gradients_equal_plain_autograd(organism, batch):
    """`record` with a metric: each site's gradient of Σ rows metric(logits), against a plain-torch pass that
    makes the same tensors require a gradient and asks autograd for them."""
    arch, hf = organism.arch, organism.hf
    ids = torch.tensor([3, 5])

    def metric(logits):
        return logits[torch.arange(len(logits)), ids] - logits.logsumexp(-1)

    sites = [HeadZ(1, 0), HeadZ(1, 2), Residual(0), Residual(-1), MlpOut(1)]
    cache = record(organism, batch, sites, metric=metric)
    assert torch.equal(cache["L1H0"], cache[HeadZ(1, 0)]) and cache.heads(1).shape[0] == 2
    seen = {}

    def leaf(m, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
        seen["embed"] = x
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handles = [
        hf.get_submodule(arch.layer(0)).register_forward_pre_hook(leaf, with_kwargs=True),
        hf.get_submodule(arch.o_proj(1)).register_forward_pre_hook(lambda m, a: seen.update(z=a[0])),
        hf.get_submodule(arch.layer(0)).register_forward_hook(lambda m, a, o: seen.update(h=o)),
        hf.get_submodule(arch.mlp(1)).register_forward_hook(lambda m, a, o: seen.update(mlp=o)),
    ]
    try:
        for p in hf.parameters():
            p.requires_grad_(False)
        with torch.enable_grad():
            logits = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float()
            gz, gh, ge, gm = torch.autograd.grad(
                metric(logits).sum(), [seen["z"], seen["h"], seen["embed"], seen["mlp"]]
            )
    finally:
        for p in hf.parameters():
            p.requires_grad_(True)
        for h in handles:
            h.remove()
    d = arch.head_dim(1)
    for got, want in [
        (cache.grad[HeadZ(1, 0)], gz[..., :d]),
        (cache.grad[HeadZ(1, 2)], gz[..., 2 * d : 3 * d]),
        (cache.grad[Residual(0)], gh),
        (cache.grad[Residual(-1)], ge),
        (cache.grad[MlpOut(1)], gm),
    ]:
        assert_close(got, want.float(), what="record's gradient against plain autograd")
    with pytest.raises(InputError, match="metric is a function"):
        record(organism, batch, sites, metric=3)
    with pytest.raises(KeyError, match="no recorded site is labelled 'L9H9'"):
        cache["L9H9"]


def test_every_site_kind_has_one_interface_and_says_which_backends_serve_it(organism, batch):
    """Location, width, label and backends on every kind; the engine's torch hooks read exactly the kinds
    whose backends name them (the others are refused naming the way that serves them)."""
    import typing

    from countlens.circuits import sites

    kinds = [*typing.get_args(sites.Site), sites.VisionBlock]
    examples = {
        sites.Residual: sites.Residual(1),
        sites.HeadZ: sites.HeadZ(1, 0),
        sites.Q: sites.Q(1, 0),
        sites.K: sites.K(1, 0),
        sites.V: sites.V(1, 0),
        sites.MlpIn: sites.MlpIn(1),
        sites.MlpOut: sites.MlpOut(1),
        sites.Pattern: sites.Pattern(1, 0),
        sites.Logits: sites.Logits(organism.arch.n_layers),
        sites.AttnIn: sites.AttnIn(1),
        sites.Embed: sites.Embed("image"),
        sites.VisionBlock: sites.VisionBlock(0),
    }
    for kind in kinds:
        for part in ("location", "width", "label", "backends"):
            assert hasattr(kind, part), f"{kind.__name__} has no {part}"
    labels = [site.label for site in examples.values()]
    assert len(set(labels)) == len(labels), labels
    for site in examples.values():
        if "hooks" in site.backends:
            assert site in record(organism, batch, [site])
        else:
            with pytest.raises(InputError, match="patch it through effect"):
                record(organism, batch, [site])


def test_gradients_read_by_label_and_a_site_before_layer_0_takes_no_metric(organism, batch):
    from countlens.circuits.sites import VisionBlock

    cache = record(organism, batch, [HeadZ(1, 0)], metric=lambda logits: logits[:, 0])
    assert torch.equal(cache.grad["L1H0"], cache.grad[HeadZ(1, 0)]) and cache.get("L9H9") is None
    assert cache.logits.device.type == "cpu" and cache.logits.dtype == torch.float32
    with pytest.raises(InputError, match="runs before it"):
        record(organism, batch, [VisionBlock(0)], metric=lambda logits: logits[:, 0])


def test_frozen_holds_a_fused_qkv_projections_q_and_k_only(loaded):
    """Phi-4's one qkv projection: detached or clamped, q and k are held and v stays live; the forward is
    the model's own either way."""
    from tiny_models import TINY_IMAGE_SIZE

    from countlens.datasets.tasks import task_samples

    vlm = loaded("phi4_multimodal")
    samples = task_samples("count", 2, seed=1, image_size=TINY_IMAGE_SIZE["phi4_multimodal"][0])
    batch = vlm.prepare_samples(samples)
    hf = vlm.hf
    with torch.no_grad():
        plain = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits.float()
        clamp = Clamp()
        with hooked(hf, clamp.hooks(vlm)):
            hf(**batch.inputs, use_cache=False, logits_to_keep=1)
        clamp.close(vlm)
        for attention in ("detach", clamp):
            with frozen(vlm, attention=attention):
                held = hf(**batch.inputs, use_cache=False, logits_to_keep=1).logits.float()
            assert_close(held, plain, what=f"a fused model's logits with attention held ({attention!r:.20})")
    got = {}

    def leaf(x):
        got["x"] = x.detach().requires_grad_(True)
        return got["x"]

    probes = [Hook(vlm.arch.layer(0), "input", leaf), Hook(vlm.arch.q_proj(0), "output", lambda y: got.update(y=y))]
    with torch.enable_grad(), frozen(vlm, attention="detach"), hooked(hf, probes):
        hf(**batch.inputs, use_cache=False, logits_to_keep=1)
        qk = vlm.arch.heads(0) * vlm.arch.head_dim(0)
        qk += (got["y"].shape[-1] - qk) // 2
        held, live = got["y"][..., :qk].sum(), got["y"][..., qk:].sum()
        (g_held,) = torch.autograd.grad(held, got["x"], retain_graph=True, allow_unused=True)
        (g_live,) = torch.autograd.grad(live, got["x"])
    assert g_held is None or float(g_held.abs().sum()) == 0  # q and k carry no gradient
    assert float(g_live.abs().sum()) > 0  # v still does
