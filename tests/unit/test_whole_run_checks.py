"""A long run checks all of itself before its first write: every fine-tune variant's needs before
the baseline, every discover stage's inputs before spec.json.

Both tests enumerate the registries (`finetune_job.VARIANTS`, `stages.STAGES`), so a variant or a
stage added later is checked here without an edit: a refusal that came only when its turn came would
leave the earlier variants' files (or the spec) behind, and the corrected rerun would meet the
resume guard.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from countlens.datasets import task_samples
from countlens.errors import InputError, LayerError
from countlens.pipeline.config import DiscoverConfig
from countlens.pipeline.finetune_job import VARIANTS
from countlens.pipeline.stages import STAGES

#: The variants whose losses read attention probabilities, which a linear-attention layer has not.
ATTENTION_VARIANTS = [name for name, terms in VARIANTS.items() if terms["focus"] > 0 or terms["mas"] > 0]


@pytest.mark.matrix
@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_a_variant_that_needs_softmax_is_refused_before_the_baseline(variant, tmp_path, tiny_checkpoint):
    """Qwen3.5's layer 0 is linear attention: a table of +SFT (which may train there) and then a
    focus or MAS variant (which may not) is refused before the baseline and +SFT's training."""
    from countlens.pipeline.finetune_job import before_after
    from countlens.pipeline.presets import recipe

    circuit = tmp_path / "circuit"
    circuit.mkdir()
    (circuit / "heads.csv").write_text("head_id,layer,head,class,importance\nL1H0,1,0,other,0.5\n")
    samples = task_samples("count", 2, 1, image_size=64)
    out = tmp_path / "out"
    with pytest.raises(LayerError, match="layer 0 of qwen3_5 is a linear-attention layer") as info:
        before_after(
            str(tiny_checkpoint("qwen3_5")),
            circuit,
            out,
            overrides={"target_layers": (0,), "steps": 1},
            train=samples,
            sets={"mine": samples},
            recipe=replace(recipe(), rows=("+SFT", variant)),
            log=lambda _: None,
        )
    assert "focus / MAS losses" in str(info.value), str(info.value)
    assert not out.exists()  # no baseline, no +SFT adapter: the corrected rerun starts clean


STAGE_INPUTS = sorted({(stage.name, name) for stage in STAGES for name in stage.inputs})


@pytest.mark.parametrize(("stage", "name"), STAGE_INPUTS, ids=[f"{s}-{n}" for s, n in STAGE_INPUTS])
def test_every_stage_input_is_built_before_the_spec(stage, name, tmp_path, loaded, monkeypatch):
    """Each input of each stage (every stage enabled: the probes too) made to fail: discover refuses
    before its run directory exists."""
    from countlens.pipeline import discover as discover_module

    made = discover_module.stage_inputs

    def broken(vlm, config, prompt):
        inputs = dict(made(vlm, config, prompt))

        def fail(*args, **kwargs):
            raise InputError(f"{name} cannot be made")

        inputs[name] = fail
        return inputs

    monkeypatch.setattr(discover_module, "stage_inputs", broken)
    config = DiscoverConfig(n_per_case=1, n_pairs=2, n_samples=2, probes=True)
    assert all(s.enabled(config) for s in STAGES)  # the input belongs to a stage this run takes
    with pytest.raises(InputError, match=f"{name} cannot be made"):
        discover_module.discover(loaded("toy"), tmp_path / "run", config)
    assert not (tmp_path / "run").exists()
