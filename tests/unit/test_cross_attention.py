"""Llama-3.2-Vision's image-state edits against what must hold whatever the weights, and against a
plain-torch-hook reimplementation: patched states at every cross-attention layer are the corrupt run,
a replica's edits stay in its replica, one layer's patch is that layer's alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tolerance import assert_close

from countlens.circuits.engine.edits import Edit, cache_run, run_edits
from countlens.circuits.methods.patching import prepare_pairs
from countlens.circuits.sites import ImageStates
from countlens.datasets.pairs import count_pairs
from countlens.datasets.scene import Scene
from countlens.errors import ConfigError, InputError


@pytest.fixture(scope="module")
def mllama(loaded):
    return loaded("mllama")


@pytest.fixture(scope="module")
def pb(mllama):
    return prepare_pairs(mllama, count_pairs(2, 3, 5, kind="polygons", image_size=64, prompt="short", seed=1))


def _hooked(vlm, batch, donor_states: torch.Tensor, layers) -> torch.Tensor:
    """Last-position logits with ``donor_states`` fed to the cross-attention layers ``layers`` by plain
    forward pre-hooks (the reference for `run_edits`' states edits)."""
    cross = vlm.arch.spec.cross_attention

    def swap(module, args, kwargs):
        states = kwargs[cross.states_kwarg]
        return args, {**kwargs, cross.states_kwarg: donor_states.reshape(states.shape).to(states.dtype)}

    handles = [
        vlm.hf.get_submodule(f"{vlm.arch.layer(layer)}.{cross.attn}").register_forward_pre_hook(swap, with_kwargs=True)
        for layer in layers
    ]
    try:
        return vlm.forward(batch).logits[:, -1].float()
    finally:
        for h in handles:
            h.remove()


@pytest.mark.numeric
def test_state_edits_match_hooks_and_stay_in_their_replica(mllama, pb):
    cross = mllama.arch.cross_layers
    corrupt = cache_run(mllama, pb.corrupt, [])
    clean = cache_run(mllama, pb.clean, [])
    every = torch.ones(len(pb.clean), len(pb.clean.state_cells[0]), dtype=torch.bool)
    none = torch.zeros_like(every)
    replicas = [
        [Edit(ImageStates(cross[0]), none)],  # edits nothing
        [Edit(ImageStates(layer), every) for layer in cross],  # every cross layer reads the corrupt states
        [Edit(ImageStates(-1), every)],  # the projector's output: the same, at the source
        [Edit(ImageStates(cross[0]), every)],  # one layer only
    ]
    out = run_edits(mllama, pb.clean, corrupt, replicas)
    scale = float(clean["logits"].abs().max())
    assert_close(out[0], clean["logits"].cpu(), scale=scale, what="an empty states edit")
    assert_close(out[1], corrupt["logits"].cpu(), scale=scale, what="corrupt states at every cross layer")
    assert_close(out[2], corrupt["logits"].cpu(), scale=scale, what="corrupt states at the projector")
    # One layer's patch: what hooks give, neither the clean nor the corrupt run.
    reference = _hooked(mllama, pb.clean, corrupt["states"], [cross[0]])
    assert_close(out[3], reference.cpu(), scale=scale, what="corrupt states at one cross layer vs hooks")
    assert not torch.allclose(out[3], clean["logits"].cpu()) and not torch.allclose(out[3], out[1])
    # Alone, the one-layer replica gives what it gives beside the others.
    alone = run_edits(mllama, pb.clean, corrupt, [replicas[3]])
    assert_close(alone[0], out[3], scale=scale, what="a replica alone vs stacked")


def test_pairs_whose_tiles_differ_are_refused(mllama):
    pair = count_pairs(1, 3, 5, kind="polygons", image_size=64, prompt="short", seed=1)[0]
    wide = replace(pair.corrupt, scene=Scene(64, 32))  # 64 wide, 32 high: 1×2 tiles, not 2×2
    with pytest.raises(InputError, match=r"cut into \(2, 2\) tiles and the corrupt one into \(1, 2\)"):
        prepare_pairs(mllama, [replace(pair, corrupt=wide)])


def test_the_fine_tune_refuses_a_cross_attention_model(mllama, tmp_path):
    from countlens.datasets.tasks import task_samples
    from countlens.training.finetune import FinetuneConfig, finetune

    with pytest.raises(ConfigError, match="cross-attention.*not defined"):
        finetune(mllama, task_samples("count", 2, 0, image_size=64), tmp_path / "ft", FinetuneConfig(steps=1))
    assert not (tmp_path / "ft").exists()
