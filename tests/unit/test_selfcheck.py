"""`countlens check` passes on the organism and every architecture of the matrix, and each check
fails, naming itself and the reason, on a model broken on purpose for it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_arch_matrix import SUPPORTED, VARIANTS
from typer.testing import CliRunner

from countlens.cli import app
from countlens.errors import CheckpointError
from countlens.model.vlm import VLM
from countlens.pipeline.selfcheck import check, failed, table


@pytest.mark.matrix
@pytest.mark.parametrize("name", ("toy", *SUPPORTED, *VARIANTS))
def test_every_check_passes_on_every_architecture(name, loaded):
    rows = check(loaded(name))
    assert not failed(rows), table(failed(rows))
    assert {r.group for r in rows} == {"spec", "image", "answers", "interventions", "memory"}
    assert [r.status for r in rows if r.group == "memory"] == ["skipped"]  # CPU: no device memory counter


def _broken(vlm: VLM, **arch) -> VLM:
    """The same model and processor under an altered `Arch` (a spec or config read wrongly)."""
    broken = VLM(vlm.hf, vlm.processor, name=vlm.name, envoy=vlm.nn)
    object.__setattr__(broken, "arch", replace(vlm.arch, **arch))
    return broken


def _failed(vlm: VLM, groups) -> dict[str, str]:
    return {r.name: r.figure for r in failed(check(vlm, groups=groups))}


def test_a_renamed_spec_path_fails_and_stops_the_rest(loaded):
    vlm = loaded("qwen2_vl")
    broken = _broken(vlm, spec=replace(vlm.arch.spec, o_proj="self_attn.out_proj"))
    rows = check(broken)
    assert [r.name for r in failed(rows)] == ["module paths"] and "out_proj missing" in failed(rows)[0].fix
    assert all(r.passed is None for r in rows if r.group != "spec")
    from countlens.errors import CheckpointError
    from countlens.pipeline.selfcheck import require

    with pytest.raises(CheckpointError, match="module paths.*out_proj missing.*countlens check"):
        require(broken)  # what `countlens discover` runs before its first stage


def test_a_wrong_image_token_id_fails(loaded):
    vlm = loaded("qwen2_vl")
    bad = _failed(_broken(vlm, image_token_id=vlm.arch.image_token_id + 1), ("spec", "image"))
    assert (
        "image tokens of the model's own image size" in bad
        and "0 image tokens" in bad["image tokens of the model's own image size"]
    )


def test_a_processor_whose_patch_disagrees_fails(loaded):
    vlm = loaded("internvl")
    bad = _failed(_broken(vlm, merge_size=1), ("spec", "image"))  # the config read as unmerged patches
    assert (
        "processor agrees with the vision config" in bad
        and "16 image tokens but 1x1 tiles of 8x8 gives 64" in bad["processor agrees with the vision config"]
    )


def test_swapped_rows_fail_the_layout(loaded, monkeypatch):
    import countlens.model.vlm as vlm_module
    from countlens.model.layouts import token_cells

    def upside_down(layout, geom, n, sample, tiles=None, useful=None):
        got = token_cells(layout, geom, n, sample, tiles, useful)
        cells = got.cells.clone()
        placed = cells[:, 0] >= 0
        cells[placed, 0] = geom.token_grid[0] - 1 - cells[placed, 0]
        return replace(got, cells=cells)

    vlm = loaded("toy")
    monkeypatch.setattr(vlm_module, "token_cells", upside_down)
    bad = _failed(vlm, ("image",))
    assert "a darkened quadrant changes its own tokens most" in bad


def test_a_template_without_the_answer_end_fails(loaded):
    vlm = loaded("qwen2_vl")
    tok, template = vlm.tokenizer, vlm.processor.chat_template
    eos = tok.eos_token
    try:
        vlm.processor.chat_template = template.replace("<|im_end|>", "")
        tok.eos_token = None
        vlm.__dict__.pop("answer_end", None)
        bad = _failed(vlm, ("spec",))
    finally:
        vlm.processor.chat_template, tok.eos_token = template, eos
        vlm.__dict__.pop("answer_end", None)
    assert "answers end as the chat template ends them" in bad


def test_the_command_writes_the_table_and_exits_by_its_result(tmp_path):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(app, ["check", "--model", "toy", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert "| spec | module paths | passed |" in result.output and len(rows) == 16  # with "outputs are finite"
    assert {r["status"] for r in rows} == {"passed", "skipped"}


def test_nan_weights_fail_one_row_that_names_them():
    """A checkpoint whose weights hold NaN: one failed row says the outputs are NaN and which weights
    are, instead of every comparison failing with a fix that blames countlens's spec."""
    import torch

    import countlens
    from countlens.pipeline.selfcheck import require

    vlm = countlens.load("toy")  # a private copy: the test writes NaN into it
    name = f"{vlm.arch.o_proj(0)}.weight"
    with torch.no_grad():
        vlm.hf.get_parameter(name)[0, 0] = float("nan")
    rows = check(vlm)
    bad = failed(rows)
    assert [r.name for r in bad] == ["outputs are finite"], table(bad)
    assert "are NaN" in bad[0].figure and name in bad[0].figure and "copy the weight files" in bad[0].fix
    assert all(r.passed is None for r in rows if r.group in ("image", "answers", "interventions"))
    with pytest.raises(CheckpointError, match=f"outputs are finite: .*{name}"):
        require(vlm)  # what `countlens discover` runs before its first stage
