"""The organism's recipe: tokenizer, processor, fast collate, and a round trip through countlens.load."""

import torch

import countlens
from countlens.datasets.tasks import TASKS, task_samples
from countlens.toy.recipe import (
    ToyConfig,
    TrainConfig,
    build_image_processor,
    build_model,
    build_processor,
    build_tokenizer,
)
from countlens.toy.train import Collator, training_sample

SMALL = ToyConfig(
    image_size=64,
    patch_size=16,
    merge_size=2,
    vision_depth=1,
    vision_dim=32,
    text_layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    intermediate=96,
    mrope_section=(2, 3, 3),
)


def test_every_answer_is_one_known_token():
    tok = build_tokenizer()
    for t in TASKS:
        for s in task_samples(t, 60, seed=0, image_size=64, size_range=(6, 10), max_count=6):
            ids = tok(s.answer, add_special_tokens=False)["input_ids"]
            assert len(ids) == 1 and ids[0] != tok.unk_token_id, s.answer


def test_fast_collate_equals_the_processor():
    cfg = ToyConfig()
    proc = build_processor(cfg)
    samples = [training_sample(0, i, cfg, TrainConfig()) for i in range(6)]
    inputs, answers = Collator(cfg)(samples)
    texts = [
        proc.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for s in samples
    ]
    ref = proc(text=texts, images=[s.image for s in samples], padding=True, return_tensors="pt")
    assert set(ref.keys()) == set(inputs)
    # Two code paths for pixel_values (the collator's torch x / 255 against the processor's numpy x · (1/255),
    # then (x − mean) / std), but only elementwise IEEE operations on uint8 pixels, each correctly rounded on
    # any CPU and kernel, and nothing summed: bits that agree here agree everywhere.
    for k in ref:
        assert torch.equal(inputs[k], ref[k]), k
    assert answers.tolist() == proc.tokenizer.convert_tokens_to_ids([s.answer for s in samples])


def test_recipe_checkpoint_round_trips_through_load(tmp_path):
    model = build_model(SMALL, seed=0)
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    build_image_processor(SMALL).save_pretrained(tmp_path)
    vlm = countlens.load(tmp_path)
    assert vlm.arch.name == "qwen2_vl" and vlm.arch.n_layers == 2 and vlm.arch.n_kv_heads == 2
    assert vlm.geometry.patch_grid == (4, 4) and vlm.geometry.token_grid == (2, 2)
    saved, loaded = model.state_dict(), vlm.hf.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_training_is_a_pure_function_of_the_seed(tmp_path):
    from dataclasses import replace

    from countlens.toy.train import train

    tc = replace(
        TrainConfig(), steps=3, batch_size=4, vision_pretrain=2, crop_batch=4, vision_warmup=2, warmup=1, threads=1
    )
    train(tmp_path / "a", SMALL, tc)
    train(tmp_path / "b", SMALL, tc)
    train(tmp_path / "c", SMALL, replace(tc, seed=1))
    a, b, c = (countlens.load(tmp_path / d).hf.state_dict() for d in "abc")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (tmp_path / "a" / "train_log.jsonl").read_text().count("\n") >= 2
    assert (tmp_path / "a" / "countlens_recipe.json").exists()


def test_main_training_leaves_the_pretrained_tower_frozen(tmp_path):
    from dataclasses import replace

    from countlens.toy.train import train

    tc = replace(
        TrainConfig(),
        steps=0,
        batch_size=4,
        vision_pretrain=2,
        crop_batch=4,
        vision_warmup=2,
        warmup=1,
        threads=1,
        freeze_vision=True,
    )
    train(tmp_path / "a", SMALL, tc)  # pretraining only
    train(tmp_path / "b", SMALL, replace(tc, steps=3))
    before, after = (countlens.load(tmp_path / d).hf.model.visual.state_dict() for d in "ab")
    frozen = [k for k in before if not k.startswith("merger.")]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("merger."))


def test_crop_pretraining_reads_patches_tokens_or_the_centre_token_and_a_frozen_tower_leaves_the_warmup_only_the_merger(
    tmp_path,
):
    from dataclasses import replace

    from countlens.toy.train import train

    tc = replace(
        TrainConfig(),
        steps=0,
        batch_size=4,
        vision_pretrain=0,
        crop_batch=4,
        vision_warmup=0,
        threads=1,
        freeze_vision=True,
    )
    runs = {
        "init": tc,
        "patches": replace(tc, vision_pretrain=2, pretrain_reads="patches"),
        "patches+warmup": replace(tc, vision_pretrain=2, pretrain_reads="patches", vision_warmup=2),
        "tokens": replace(tc, vision_pretrain=2),
        "centre": replace(tc, vision_pretrain=2, pretrain_reads="centre"),
    }
    for name, cfg in runs.items():
        train(tmp_path / name, SMALL, cfg)
    init, patches, warm, tokens, centre = (countlens.load(tmp_path / n).hf.model.visual.state_dict() for n in runs)
    tower = [k for k in init if not k.startswith("merger.")]
    merger = [k for k in init if k.startswith("merger.")]
    changed = lambda a, b, keys: not all(torch.equal(a[k], b[k]) for k in keys)  # noqa: E731
    assert changed(init, patches, tower) and not changed(init, patches, merger)  # read before the merger
    assert changed(init, tokens, tower) and changed(init, tokens, merger)  # read after it: the merger trains too
    assert changed(init, centre, tower) and changed(init, centre, merger) and changed(tokens, centre, merger)
    assert not changed(patches, warm, tower) and changed(patches, warm, merger)  # frozen before the dense warmup


def test_unknown_pretrain_readout_is_refused():
    import pytest

    from countlens.errors import CountlensError

    with pytest.raises(CountlensError, match="pretrain_reads 'merger' is unknown; use 'centre', 'tokens' or 'patches'"):
        TrainConfig(pretrain_reads="merger")


def test_crop_size_off_the_token_grid_is_refused_before_writing(tmp_path):
    from dataclasses import replace

    import pytest

    from countlens.errors import CountlensError
    from countlens.toy.train import train

    with pytest.raises(CountlensError, match="crop_size 40 is not a multiple"):
        train(tmp_path / "x", SMALL, replace(TrainConfig(), vision_pretrain=2, crop_size=40, threads=1))
    assert not (tmp_path / "x").exists()


def test_pretraining_crops_hold_objects_at_scene_sizes():
    from countlens.datasets.tasks import SIZE_RANGE
    from countlens.toy.train import pretraining_crops

    tc = TrainConfig()
    crops = pretraining_crops(0, 3, ToyConfig(), tc)
    assert len(crops) == tc.crop_batch and crops == pretraining_crops(0, 3, ToyConfig(), tc)
    assert all(len(c.objects) == 1 for c in crops) and all(c.width == c.height == tc.crop_size for c in crops)
    assert all(SIZE_RANGE[0] <= o.size <= SIZE_RANGE[1] for c in crops for o in c.objects)
    assert crops != pretraining_crops(1, 3, ToyConfig(), tc)


def test_cell_targets_mark_object_centres():
    from countlens.datasets.scene import Obj, Scene
    from countlens.datasets.tasks import TaskSample
    from countlens.toy.train import cell_targets

    scene = Scene(
        64, 64, (Obj("circle", "red", 8, 8, 6), Obj("square", "blue", 12, 10, 4), Obj("triangle", "green", 40, 50, 8))
    )
    t = cell_targets([TaskSample(scene, "q", "3", "count")], SMALL).reshape(2, 2, 3)  # 32-px cells
    assert t[0, 0].tolist() == [2, 0, 0]  # two centres; the first is a red circle
    assert t[1, 1].tolist() == [1, 1, 2]  # green triangle
    assert t[0, 1, 0] == 0 and t[1, 0, 0] == 0


def test_token_index_is_the_centre_cell_row_major():
    from countlens.datasets.scene import Obj
    from countlens.toy.train import token_index

    g = ToyConfig(patch_size=8)  # 16 px tokens on a 12 x 12 grid
    assert token_index(Obj("circle", "red", 40, 10, 6), g) == 0 * 12 + 2
    assert token_index(Obj("square", "red", 15.9, 16.0, 4), g) == 1 * 12 + 0
    assert token_index(Obj("triangle", "red", 191.5, 191.5, 1), g) == 143  # last cell
    crop = ToyConfig(image_size=64, patch_size=8)  # a 4 x 4 crop grid
    assert token_index(Obj("circle", "red", 40, 50, 6), crop) == 3 * 4 + 2
