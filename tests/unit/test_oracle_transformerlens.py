"""Oracle: countlens' nnsight head patching agrees with the same patch done through TransformerLens.

TransformerLens' `TransformerBridge` wraps a second, independently loaded copy of the tiny VLM (the
full multimodal model: pixel_values go through the HF vision tower and projector inside the bridge).
Each head's z is patched through TL's own hook, ``blocks.{l}.attn.hook_z`` (batch, seq, n_heads,
d_head), from the corrupt run into the clean run at the image tokens; the logit differences must match
`countlens.circuits.methods.patching.patch_heads(..., positions="image")`.

The bridge is built with `build_bridge_from_module` around a preloaded model, never with
`TransformerBridge.boot_transformers`: booting offline can reach transformer-lens 4.3's
`_ensure_torchvision`, which pip-installs torchvision (and a different torch). That helper is also
disabled here as a guard. The Qwen2.5-VL adapter refuses to construct without torchvision (a
`find_spec` check; its forward does not use it), so that check is bypassed for the test.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

tl = pytest.importorskip("transformer_lens")

from tiny_models import TINY_IMAGE_SIZE  # noqa: E402
from tolerance import F32_REL, assert_close, scale_of  # noqa: E402

from countlens.circuits.methods.patching import patch_heads, prepare_pairs  # noqa: E402
from countlens.circuits.sites import group_mask  # noqa: E402
from countlens.datasets.pairs import count_pairs  # noqa: E402

try:
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    from transformer_lens.model_bridge.sources.transformers import helpers as tl_helpers
except ImportError as exc:  # pragma: no cover - other transformer-lens versions
    from importlib.metadata import version

    pytest.skip(
        f"transformer-lens {version('transformer-lens')} lacks build_bridge_from_module: {exc}", allow_module_level=True
    )


@pytest.fixture(autouse=True)
def _no_pip_from_transformer_lens(monkeypatch):
    def refuse() -> bool:
        raise AssertionError("transformer-lens tried to pip-install torchvision")

    monkeypatch.setattr(tl_helpers, "_ensure_torchvision", refuse)


def _bridge(path, monkeypatch):
    """A TransformerBridge around a fresh eager-attention copy of the checkpoint (the bridge edits
    the model it wraps in place, so it never touches the model countlens traces)."""
    from transformer_lens.model_bridge.supported_architectures.qwen2_5_vl import Qwen2_5_VLArchitectureAdapter
    from transformers import AutoModelForImageTextToText

    monkeypatch.setattr(Qwen2_5_VLArchitectureAdapter, "required_libraries", [])
    hf = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager", local_files_only=True)
    hf.eval()
    return build_bridge_from_module(hf, hf.config.architectures[0], hf_config=hf.config)


def _split(inputs: dict):
    rest = dict(inputs)
    return rest.pop("input_ids"), rest  # rest: attention_mask, pixel_values (+ image_grid_thw, mm_token_type_ids)


def _ld(logits, pb):
    rows = torch.arange(len(logits))
    last = logits[:, -1].float()
    return (last[rows, pb.clean_id] - last[rows, pb.corrupt_id]).numpy()


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl"])
@torch.no_grad()
def test_head_patching_agrees_with_transformerlens_hook_z(tiny_checkpoint, loaded, monkeypatch, name):
    path = tiny_checkpoint(name)
    vlm = loaded(name)
    pairs = count_pairs(2, 3, 5, kind="polygons", image_size=TINY_IMAGE_SIZE[name][0], prompt="short", seed=4)
    ds = patch_heads(vlm, pairs, positions="image")
    pb = prepare_pairs(vlm, pairs)
    bridge = _bridge(path, monkeypatch)
    n_layers, n_heads = bridge.cfg.n_layers, bridge.cfg.n_heads
    assert (n_layers, n_heads) == (vlm.arch.n_layers, vlm.arch.n_heads)

    # 1. The bridge's own forward (images included) reproduces the HF logits.
    clean_ids, clean_rest = _split(pb.clean.inputs)
    corrupt_ids, corrupt_rest = _split(pb.corrupt.inputs)
    scale = 0.0
    for ids, rest, inputs in ((clean_ids, clean_rest, pb.clean.inputs), (corrupt_ids, corrupt_rest, pb.corrupt.inputs)):
        hf = vlm.hf(**inputs).logits
        scale = max(scale, scale_of(hf))
        assert_close(bridge(ids, **rest), hf, what="bridge vs HF logits")

    # 2. Corrupt z from TL's cache, then one clean run per (layer, head) with that head patched at hook_z.
    _, cache = bridge.run_with_cache(corrupt_ids, names_filter=lambda n: n.endswith("attn.hook_z"), **corrupt_rest)
    mask = group_mask(pb.clean, "image")
    assert cache["blocks.0.attn.hook_z"].shape == (*mask.shape, n_heads, vlm.arch.d_head)
    clean_ld = _ld(bridge(clean_ids, **clean_rest), pb)
    tl_ld = np.zeros((n_layers, n_heads, len(pairs)), dtype=np.float32)
    for layer in range(n_layers):
        z_corrupt = cache[f"blocks.{layer}.attn.hook_z"]
        for head in range(n_heads):

            def patch(z, hook, z_corrupt=z_corrupt, head=head):
                z = z.clone()
                z[:, :, head][mask] = z_corrupt[:, :, head][mask]
                return z

            logits = bridge.run_with_hooks(clean_ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", patch)], **clean_rest)
            tl_ld[layer, head] = _ld(logits, pb)

    got = ds.logit_diff.transpose("layer", "head", "pair").values
    assert_close(ds.clean_logit_diff, clean_ld, scale=scale, what="clean LD vs TL")
    assert_close(got, tl_ld, scale=scale, what="head-patched LD vs TL")
    # Random-init effects are only ~1e-4–1e-3, so also compare the effects (patched − clean) on their
    # own scale: the layer-0 heads must move LD measurably and agree to 1 % of the largest effect
    # (measured ≤ 4 % of that bound under four kernel choices: both run the same HF modules).
    effect_tl, effect_cl = tl_ld - clean_ld, got - ds.clean_logit_diff.values
    moved = np.abs(effect_cl).max()
    assert moved > 1e-4, f"head patching barely moves LD ({moved:.2e}); the comparison would be vacuous"
    assert_close(effect_cl, effect_tl, scale=1e-2 * moved / F32_REL, what="head effects vs TL")
