"""VLM details beyond the matrix: remote loading, dynamic geometry, image slots in prompts."""

import pytest
from PIL import Image

import countlens


@pytest.fixture(scope="module")
def qwen_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2_vl")


def fake_hub_cache(root, repo_id: str, files_from) -> None:
    """A Hugging Face cache holding ``repo_id`` (what a download would have left), offline."""
    import shutil

    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(files_from, repo / "snapshots" / ("0" * 40))


def test_remote_needs_a_hub_id(qwen_dir):
    with pytest.raises(countlens.CountlensError, match="needs a hub id"):
        countlens.load(qwen_dir, remote=True)


def test_remote_load_builds_a_meta_model_and_sends_traces_remote(qwen_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    fake_hub_cache(tmp_path, "tiny/qwen2-vl", qwen_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    vlm = countlens.load("tiny/qwen2-vl", remote=True)
    assert vlm.remote and vlm.device.type == "meta"
    batch = vlm.prepare([Image.new("RGB", (64, 64))], ["how many circles are there?"], ["3"])
    assert batch.inputs["input_ids"].device.type == "cpu"  # NDIF places the inputs
    seen = {}
    monkeypatch.setattr(vlm.nn, "trace", lambda **kw: seen.update(kw))
    vlm.trace(batch)
    assert seen["remote"] is True and "input_ids" in seen


def test_dynamic_resolution_geometry_follows_the_processor(loaded):
    vlm = loaded("qwen2_vl")
    g = vlm.geometry_for(32, 96)  # the tiny processor pins the area to 64² pixels
    batch = vlm.prepare([Image.new("RGB", (96, 32))], ["how many circles are there?"])
    assert batch.geometry[0] == g
    assert len(batch.image_pos[0]) == g.token_grid[0] * g.token_grid[1]
    assert batch.image_cell[0][-1].tolist() == [g.token_grid[0] - 1, g.token_grid[1] - 1]


def test_image_slot_inside_the_prompt(loaded):
    vlm = loaded("qwen2_vl")
    batch = vlm.prepare([Image.new("RGB", (64, 64))] * 2, ["please: <image> how many circles?", "how many circles?"])
    ids = batch.inputs["input_ids"]
    tok = vlm.tokenizer
    first_image = int(batch.image_pos[0][0])
    assert "please" in tok.convert_ids_to_tokens(ids[0, :first_image].tolist())
    assert "please" not in tok.convert_ids_to_tokens(ids[1].tolist())
