"""Loaders of local benchmark copies: round trips on tiny fixture files, and clear rejections."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from benchmark_files import clevr_root, mathvista_rows, mmmu_copy, mmmu_rows, png, realworldqa_copy, realworldqa_rows
from PIL import Image

from countlens.datasets.loaders import (
    CountSample,
    LoaderError,
    load_clevr,
    load_countbench,
    load_countingtricks_release,
    load_fsc147,
    load_mathvista,
    load_mmmu,
    load_pixmo_count,
    load_realworldqa,
    load_tallyqa,
)
from countlens.errors import InputError


def png_bytes(size=(10, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, 128).save(buf, format="PNG")
    return buf.getvalue()


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# CountSample


def test_sample_interface_and_errors(tmp_path):
    s = CountSample(png(tmp_path / "a.png"), None, "How many?", 3, [[1, 2], [3, 4], [5, 6]], None, "x", "0")
    assert (s.answer, s.task, s.meta["count"]) == ("3", "count", 3)
    assert s.image.mode == "RGB" and s.image.size == (12, 8)
    assert s.points.shape == (3, 2) and not s.points.flags.writeable
    assert issubclass(LoaderError, InputError)
    assert s == CountSample(tmp_path / "a.png", None, "How many?", 3, None, None, "x", "0") and hash(s)
    with pytest.raises(LoaderError, match="exactly one of image_path and image_bytes"):
        CountSample(None, None, "q", 1, None, None, "x", "0")
    with pytest.raises(LoaderError, match="non-negative"):
        CountSample(tmp_path / "a.png", None, "q", -1, None, None, "x", "0")
    with pytest.raises(LoaderError, match=r"points has shape \(2, 3\)"):
        CountSample(tmp_path / "a.png", None, "q", 2, np.zeros((2, 3)), None, "x", "0")
    bad = CountSample(None, b"not an image", "q", 1, None, None, "x", "7", meta={"file": "f.parquet"})
    with pytest.raises(LoaderError, match=r"f\.parquet: x sample '7': the image bytes are not a readable image"):
        bad.image
    (tmp_path / "corrupt.png").write_bytes(b"garbage")
    corrupt = CountSample(tmp_path / "corrupt.png", None, "q", 1, None, None, "x", "8")
    with pytest.raises(LoaderError, match=r"corrupt\.png.*sample '8'.*not a readable image"):
        corrupt.image


# ---------------------------------------------------------------------------------------------
# FSC-147


def fsc_root(tmp_path: Path, classes: bool = True) -> Path:
    root = tmp_path / "FSC147"
    root.mkdir()
    ann = {
        "1.jpg": {
            "points": [[1.5, 2.0], [3.0, 4.0]],
            "box_examples_coordinates": [[[1, 1], [1, 3], [4, 3], [4, 1]]] * 3,
            "H": 8,
            "W": 12,
        },
        "2.jpg": {"points": [[0, 0]], "box_examples_coordinates": [], "H": 6, "W": 10},
        "3.jpg": {"points": [[5, 5]] * 4},
    }
    (root / "annotation_FSC147_384.json").write_text(json.dumps(ann))
    splits = {"train": ["3.jpg"], "val": [], "test": ["1.jpg", "2.jpg"]}
    (root / "Train_Test_Val_FSC_147.json").write_text(json.dumps(splits))
    if classes:
        (root / "ImageClasses_FSC147.txt").write_text("1.jpg\tsea shells\n2.jpg\tapples\n3.jpg\tbirds\n")
    png(root / "images_384_VarV2" / "1.jpg", (12, 8))
    png(root / "images_384_VarV2" / "2.jpg", (10, 6))
    png(root / "images_384_VarV2" / "3.jpg", (10, 6))
    return root


def test_fsc147_round_trip(tmp_path):
    root = fsc_root(tmp_path)
    samples = load_fsc147(root)
    assert [s.id for s in samples] == ["1.jpg", "2.jpg"]
    a, b = samples
    assert (a.count, a.answer, a.split, a.source) == (2, "2", "test", "fsc147")
    assert a.question == "How many sea shells are there in the image?"
    np.testing.assert_allclose(a.points, [[1.5, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(a.meta["exemplar_boxes"], [[1, 1, 4, 3]] * 3)
    assert a.boxes is None and a.meta["count"] == 2 and a.meta["class"] == "sea shells"
    assert a.image.size == (12, 8) and b.image.size == (10, 6)
    assert [s.id for s in load_fsc147(root, split="train")] == ["3.jpg"]
    assert len(load_fsc147(root, limit=1)) == 1


def test_fsc147_default_object_and_template(tmp_path):
    root = fsc_root(tmp_path, classes=False)
    assert load_fsc147(root, question="Count the {name}.")[0].question == "Count the objects."
    with pytest.raises(LoaderError, match=r"question template .* only \{name\}"):
        load_fsc147(root, question="How many {label}?")


def test_fsc147_rejections(tmp_path):
    root = fsc_root(tmp_path)
    with pytest.raises(LoaderError, match=r"Train_Test_Val_FSC_147\.json: unknown split 'tst'.*'train', 'val', 'test'"):
        load_fsc147(root, split="tst")
    with pytest.raises(LoaderError, match=r"nowhere: FSC-147 root directory not found"):
        load_fsc147(tmp_path / "nowhere")
    ann_file = root / "annotation_FSC147_384.json"
    ann = json.loads(ann_file.read_text())
    ann["2.jpg"]["points"] = "many"
    ann_file.write_text(json.dumps(ann))
    message = r"annotation_FSC147_384\.json: image '2\.jpg': field 'points' has type str, expected list"
    with pytest.raises(LoaderError, match=message):
        load_fsc147(root)
    del ann["2.jpg"]
    ann_file.write_text(json.dumps(ann))
    message = r"annotation_FSC147_384\.json: image '2\.jpg' of split 'test'.*has no annotation"
    with pytest.raises(LoaderError, match=message):
        load_fsc147(root)
    ann_file.unlink()
    with pytest.raises(LoaderError, match=r"annotation_FSC147_384\.json: not found; download FSC-147"):
        load_fsc147(root)


def test_fsc147_missing_images_are_refused_at_load_and_when_opened(tmp_path):
    root = fsc_root(tmp_path)
    (root / "images_384_VarV2" / "3.jpg").unlink()
    missing = r"images_384_VarV2: 1 of the 1 images of split 'train' are missing \(3\.jpg\)"
    with pytest.raises(LoaderError, match=missing):
        load_fsc147(root, split="train")
    (sample,) = load_fsc147(root, split="test", limit=1)
    sample.image_path.unlink()  # gone after loading: opening it names the file
    with pytest.raises(LoaderError, match=r"1\.jpg \(image of fsc147 sample '1\.jpg'\): file not found"):
        sample.image


# ---------------------------------------------------------------------------------------------
# PixMo-Count


def test_pixmo_jsonl_round_trip(tmp_path):
    png(tmp_path / "imgs" / "a.png", (12, 8))
    path = jsonl(
        tmp_path / "pixmo.jsonl",
        [
            {"image": "imgs/a.png", "count": 2, "points": [{"x": 1, "y": 2}, {"x": 3.5, "y": 4}], "label": "dogs"},
            {"image_path": "imgs/a.png", "count": 0, "points": []},
            {"image": "imgs/a.png", "count": 1, "points": [[7, 8]], "id": "p3"},
        ],
    )
    samples = load_pixmo_count(path, split="validation")
    assert [s.count for s in samples] == [2, 0, 1]
    assert samples[0].question == "How many dogs are there in the image?"
    assert samples[1].question == "How many objects are there in the image?"
    np.testing.assert_allclose(samples[0].points, [[1, 2], [3.5, 4]])
    assert samples[1].points.shape == (0, 2)
    assert [s.id for s in samples] == ["0", "1", "p3"]
    assert {s.split for s in samples} == {"validation"} and samples[0].source == "pixmo_count"
    assert samples[0].image.size == (12, 8)
    other = tmp_path / "elsewhere"
    png(other / "imgs" / "a.png", (5, 5))
    assert load_pixmo_count(path, image_root=other, limit=1)[0].image.size == (5, 5)


def test_pixmo_parquet_bytes(tmp_path):
    raw = png_bytes((10, 6))
    table = pa.table(
        {
            "image": [{"bytes": raw, "path": None}, {"bytes": raw, "path": "x.png"}],
            "count": [3, 1],
            "label": ["cats", "cups"],
        }
    )
    pq.write_table(table, tmp_path / "pixmo.parquet")
    samples = load_pixmo_count(tmp_path / "pixmo.parquet")
    assert [s.count for s in samples] == [3, 1] and samples[0].image_path is None
    assert samples[1].image.size == (10, 6) and samples[1].image.mode == "RGB"
    assert samples[0].points is None


@pytest.mark.parametrize(
    "row, message",
    [
        ({"image": "a.png"}, r"pixmo\.jsonl: line 2: field 'count' is missing"),
        ({"image": "a.png", "count": "3"}, r"pixmo\.jsonl: line 2: field 'count' has type str, expected int"),
        ({"image": "a.png", "count": True}, r"pixmo\.jsonl: line 2: field 'count' has type bool, expected int"),
        ({"image": "a.png", "count": -2}, r"pixmo\.jsonl: line 2: field 'count' is -2; a count must be ≥ 0"),
        ({"count": 1}, r"pixmo\.jsonl: line 2: field 'image' / 'image_path' is missing"),
        ({"image": 5, "count": 1}, r"pixmo\.jsonl: line 2: field 'image' has type int"),
        ({"image": "a.png", "count": 1, "points": [[1]]}, r"pixmo\.jsonl: line 2: field 'points': item 0"),
    ],
)
def test_pixmo_rejections(tmp_path, row, message):
    path = jsonl(tmp_path / "pixmo.jsonl", [{"image": "a.png", "count": 1}, row])
    with pytest.raises(LoaderError, match=message):
        load_pixmo_count(path)


def test_file_level_rejections(tmp_path):
    with pytest.raises(LoaderError, match=r"missing\.jsonl: not found; pass the JSONL or parquet file"):
        load_pixmo_count(tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(LoaderError, match=r"data\.csv: unknown annotation format '\.csv'"):
        load_countbench(tmp_path / "data.csv")
    (tmp_path / "broken.jsonl").write_text('{"image": "a.png", "count": 1}\n{oops\n')
    with pytest.raises(LoaderError, match=r"broken\.jsonl: line 2: invalid JSON"):
        load_pixmo_count(tmp_path / "broken.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(LoaderError, match=r"bad\.parquet: not a readable parquet file"):
        load_countbench(tmp_path / "bad.parquet")
    with pytest.raises(LoaderError, match="limit is -1"):
        load_countbench(tmp_path / "bad.parquet", limit=-1)


# ---------------------------------------------------------------------------------------------
# CountBench


def test_countbench_round_trip(tmp_path):
    raw = png_bytes((9, 7))
    png(tmp_path / "img" / "b.png", (4, 3))
    table = pa.table(
        {
            "image": [{"bytes": raw, "path": None}, {"bytes": None, "path": "b.png"}],
            "question": ["How many pens are there?", "How many cars are there?"],
            "number": [4, 7],
            "text": ["four pens", "seven cars"],
        }
    )
    pq.write_table(table, tmp_path / "cb.parquet")
    a, b = load_countbench(tmp_path / "cb.parquet", image_root=tmp_path / "img")
    assert (a.count, a.answer, a.question, a.meta["text"]) == (4, "4", "How many pens are there?", "four pens")
    assert a.image.size == (9, 7) and b.image.size == (4, 3) and b.image_path == tmp_path / "img" / "b.png"
    assert a.source == "countbench" and a.meta["count"] == 4


def test_countbench_rejections(tmp_path):
    path = jsonl(tmp_path / "cb.jsonl", [{"image": "a.png", "number": 3}])
    with pytest.raises(LoaderError, match=r"cb\.jsonl: line 1: field 'question' is missing"):
        load_countbench(path)
    path = jsonl(tmp_path / "cb.jsonl", [{"image": "a.png", "question": "q", "number": 2.5}])
    with pytest.raises(LoaderError, match=r"cb\.jsonl: line 1: field 'number' has type float, expected int"):
        load_countbench(path)
    path = jsonl(tmp_path / "cb.jsonl", [{"image": "nope.png", "question": "q", "number": 2}])
    (sample,) = load_countbench(path)
    with pytest.raises(LoaderError, match=r"nope\.png \(image of countbench sample '0'\): file not found"):
        sample.image


# ---------------------------------------------------------------------------------------------
# TallyQA


def tally_records() -> list[dict]:
    records = [
        {"question": "How many dogs?", "answer": 2, "issimple": True, "question_id": 11, "image_id": 1},
        {"question": "How many dogs are lying?", "answer": 0, "issimple": False, "question_id": 12},
        {"question": "How many cats?", "answer": 5, "issimple": True, "question_id": 13},
    ]
    return [{"image": "VG_100K/1.jpg", **r} for r in records]


def test_tallyqa_round_trip(tmp_path):
    png(tmp_path / "images" / "VG_100K" / "1.jpg", (12, 8))
    (tmp_path / "test.json").write_text(json.dumps(tally_records()))
    samples = load_tallyqa(tmp_path / "test.json", tmp_path / "images")
    assert [(s.id, s.count, s.question) for s in samples] == [
        ("11", 2, "How many dogs?"),
        ("12", 0, "How many dogs are lying?"),
        ("13", 5, "How many cats?"),
    ]
    assert samples[0].meta["issimple"] is True and samples[0].meta["image_id"] == 1
    assert samples[0].image.size == (12, 8)
    assert [s.id for s in load_tallyqa(tmp_path / "test.json", tmp_path / "images", simple_only=True)] == ["11", "13"]
    assert [s.id for s in load_tallyqa(tmp_path / "test.json", tmp_path / "images", simple_only=True, limit=1)] == [
        "11"
    ]
    path = jsonl(tmp_path / "test.jsonl", tally_records())
    assert [s.count for s in load_tallyqa(path, tmp_path / "images")] == [2, 0, 5]


def test_tallyqa_rejections(tmp_path):
    (tmp_path / "images").mkdir()
    records = tally_records()
    del records[1]["issimple"]
    (tmp_path / "train.json").write_text(json.dumps(records))
    assert load_tallyqa(tmp_path / "train.json", tmp_path / "images")[1].meta["issimple"] is None
    with pytest.raises(LoaderError, match=r"train\.json: record 1: field 'issimple' is missing; simple_only needs it"):
        load_tallyqa(tmp_path / "train.json", tmp_path / "images", simple_only=True)
    records[2]["answer"] = -1
    (tmp_path / "train.json").write_text(json.dumps(records))
    with pytest.raises(LoaderError, match=r"train\.json: record 2: field 'answer' is -1"):
        load_tallyqa(tmp_path / "train.json", tmp_path / "images")
    (tmp_path / "obj.json").write_text(json.dumps({"questions": []}))
    with pytest.raises(LoaderError, match=r"obj\.json: expected a JSON list of records, got dict"):
        load_tallyqa(tmp_path / "obj.json", tmp_path / "images")
    with pytest.raises(LoaderError, match=r"nowhere: TallyQA image root not found"):
        load_tallyqa(tmp_path / "train.json", tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------
# CLEVR and MathVista: the reasoning tasks' local copies


def test_clevr_round_trip(tmp_path):
    """Only the questions whose program relates objects in space, unless relations_only=False."""
    samples = load_clevr(clevr_root(tmp_path))
    assert [(s.id, s.answer, s.task, s.source) for s in samples] == [
        ("val_0", "yes", "spatial", "clevr"),
        ("val_2", "gray", "spatial", "clevr"),
    ]
    every = load_clevr(clevr_root(tmp_path / "all"), relations_only=False)
    assert every[1].question == "How many cylinders are there?" and every[1].image.size == (16, 12)
    assert samples[1].meta["image_index"] == 1 and len(load_clevr(clevr_root(tmp_path / "b"), limit=1)) == 1


def test_clevr_rejections(tmp_path):
    root = clevr_root(tmp_path)
    file = root / "questions" / "CLEVR_val_questions.json"
    data = json.loads(file.read_text())
    del data["questions"][2]["answer"]  # as in the test split
    file.write_text(json.dumps(data))
    with pytest.raises(LoaderError, match=r"question 2: field 'answer' is missing; split 'val' has no answers"):
        load_clevr(root)
    root = clevr_root(tmp_path / "scene")
    scenes = json.loads((root / "scenes" / "CLEVR_val_scenes.json").read_text())
    (root / "scenes" / "CLEVR_val_scenes.json").write_text(json.dumps({"scenes": scenes["scenes"][:1]}))
    with pytest.raises(LoaderError, match=r"question 2: image_index 1 has no scene in scenes/CLEVR_val_scenes\.json"):
        load_clevr(root)
    root = clevr_root(tmp_path / "image", scenes=False)
    (root / "images" / "val" / "CLEVR_val_000001.png").unlink()
    with pytest.raises(LoaderError, match=r"1 of the 2 images of split 'val' are missing \(val_2\)"):
        load_clevr(root)
    with pytest.raises(LoaderError, match=r"CLEVR_test_questions\.json: not found"):
        load_clevr(clevr_root(tmp_path / "test"), split="test")
    root = clevr_root(tmp_path / "program")
    data = json.loads((root / "questions" / "CLEVR_val_questions.json").read_text())
    del data["questions"][0]["program"]
    (root / "questions" / "CLEVR_val_questions.json").write_text(json.dumps(data))
    with pytest.raises(LoaderError, match=r"question 0: field 'program' is missing; relations_only=True reads it"):
        load_clevr(root)


@pytest.mark.parametrize(
    "question, step, change, message",
    [
        (2, 1, {"value_inputs": ["purple"]}, r"program step 3 \(unique\) finds 0 objects, not one: the program names"),
        (2, 2, {"value_inputs": ["sphere"]}, r"program step 3 \(unique\) finds 0 objects"),
        (0, 4, {"value_inputs": ["above"]}, r"step 4 \(relate\[above\]\): the scene has no 'above' relationships"),
        (0, 6, {"function": "count"}, r"its program gives '1' on the scene of image 0, the file's answer is 'yes'"),
        (0, 6, {"function": "levitate"}, r"program step 6 \(levitate\): not one of CLEVR's functions"),
        (2, 4, {"inputs": [9]}, r"on the scene of image 1 .* a malformed step \(IndexError"),
    ],
)
def test_clevr_programs_run_on_their_scenes(tmp_path, question, step, change, message):
    """A question whose program names an object its scene lacks, or answers otherwise, is refused; the
    fixture's own programs give its answers (the round trip above)."""
    root = clevr_root(tmp_path)
    file = root / "questions" / "CLEVR_val_questions.json"
    data = json.loads(file.read_text())
    data["questions"][question]["program"][step].update(change)
    file.write_text(json.dumps(data))
    with pytest.raises(LoaderError, match=r"CLEVR_val_questions\.json: question " + str(question) + ".*" + message):
        load_clevr(root)


def test_mathvista_parquet_and_json_layouts(tmp_path):
    raw = png_bytes((10, 6))
    rows = [
        {**r, "image": f"images/{r['pid']}.jpg", "decoded_image": {"bytes": raw, "path": None}}
        for r in mathvista_rows()
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "testmini-00000-of-00001.parquet")
    samples = load_mathvista(tmp_path)  # the folder: its testmini parquet
    assert [(s.id, s.answer, s.task, s.choices) for s in samples] == [
        ("1", "12", "math", None),
        ("2", "4", "math", ("3", "4", "5")),
        ("3", "0.5", "math", None),
    ]
    assert samples[2].meta["precision"] == 1.0 and samples[0].image.size == (10, 6)
    assert samples[1].question.endswith("(C) 5") and samples[0].question == "What is the sum of the two numbers?"
    # The original release: testmini.json, an object from pid to record, images beside it.
    folder = tmp_path / "release"
    (folder / "images").mkdir(parents=True)
    for r in mathvista_rows():
        png(folder / "images" / f"{r['pid']}.jpg", (8, 8))
    as_json = {
        r["pid"]: {k: v for k, v in r.items() if k != "pid"} | {"image": f"images/{r['pid']}.jpg"}
        for r in mathvista_rows()
    }
    (folder / "testmini.json").write_text(json.dumps(as_json))
    again = load_mathvista(folder / "testmini.json")
    assert [(s.id, s.answer) for s in again] == [(s.id, s.answer) for s in samples] and again[1].image.size == (8, 8)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer": "D"}, r"pid '2': the answer 'D' is not among the choices \['3', '4', '5'\]"),
        ({"question_type": None}, r"pid '2': field 'question_type' is missing"),
        ({"answer_type": "complex"}, r"pid '2': answer_type 'complex' is not one of"),
        ({"image": "images/nowhere.jpg"}, r"1 of the 3 images are missing \(2\)"),
    ],
)
def test_mathvista_rejections(tmp_path, change, message):
    folder = tmp_path / "release"
    (folder / "images").mkdir(parents=True)
    records = {}
    for r in mathvista_rows():
        png(folder / "images" / f"{r['pid']}.jpg", (8, 8))
        records[r["pid"]] = {k: v for k, v in r.items() if k != "pid"} | {"image": f"images/{r['pid']}.jpg"}
    records["2"].update(change)
    (folder / "testmini.json").write_text(json.dumps(records))
    with pytest.raises(LoaderError, match=message):
        load_mathvista(folder / "testmini.json")


# ---------------------------------------------------------------------------------------------
# MMMU and RealWorldQA: general-reasoning columns of the fine-tune's table


def test_mmmu_layout_prompts_and_multi_image_questions(tmp_path):
    """Hugging Face's layout (a parquet per subject); the question becomes MMMU's own prompt, letters are
    the choices, a list literal gives several accepted answers, and a two-image question is left out."""
    root = mmmu_copy(tmp_path, {"Math": mmmu_rows("Math"), "Art": mmmu_rows("Art")[:1]})
    said = []
    samples = load_mmmu(root, log=said.append)
    assert [s.id for s in samples] == [
        "validation_Art_1",
        "validation_Math_1",
        "validation_Math_2",
        "validation_Math_3",
    ]  # subjects in name order, the two-image question left out and said
    assert said == ["MMMU: 1 questions with several images left out (a sample holds one image)"]
    choice, area, pair = samples[1:]
    assert (choice.answer, choice.choices, choice.meta["options"]) == ("B", ("A", "B", "C", "D"), ["3", "4", "5", "6"])
    assert choice.question == (
        "<image 1> How many sides does the shape have?\n\n(A) 3\n(B) 4\n(C) 5\n(D) 6\n\n"
        "Answer with the option's letter from the given choices directly."
    )
    assert area.choices is None and area.question.endswith("Answer the question using a single word or phrase.")
    assert (pair.answer, pair.meta["answers"]) == ("2", ["2", "3"])
    assert (choice.task, choice.source, choice.image.size) == ("reasoning", "mmmu", (24, 24))
    one_file = root / "Math" / "validation-00000-of-00001.parquet"
    assert [s.id for s in load_mmmu(one_file, limit=2)] == ["validation_Math_1", "validation_Math_2"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"answer": "E"}, r"row 0: the answer 'E' is not the letter of one of its 4 options \(A, B, C, D\)"),
        ({"answer": "?"}, r"row 0: the answer is hidden \('\?'\), as in MMMU's test split"),
        ({"image_1": None}, r"row 0: the question shows <image 1> but its row has no image_1"),
        ({"question_type": "essay"}, r"row 0: question_type 'essay' is not one of"),
        ({"options": "['3', '4'"}, r"row 0: field 'options' .* is not a list literal"),
        ({"question": None}, r"row 0: field 'question' is missing"),
    ],
)
def test_mmmu_rejections(tmp_path, change, message):
    rows = mmmu_rows()
    rows[0].update(change)
    root = mmmu_copy(tmp_path, {"Math": rows})
    with pytest.raises(LoaderError, match=r"validation-00000-of-00001\.parquet: " + message):
        load_mmmu(root)
    with pytest.raises(LoaderError, match=r"no validation_x-\*\.parquet files"):
        load_mmmu(tmp_path / "MMMU" / "Math", split="validation_x")


def test_realworldqa_layout_and_options(tmp_path):
    """Options written inside the question ("A. Left") become letter choices; other questions stay open."""
    samples = load_realworldqa(realworldqa_copy(tmp_path))
    turn, car, lanes = samples
    assert (turn.choices, turn.meta["options"], turn.answer) == (("A", "B", "C"), ["Left", "Right", "Straight"], "B")
    assert (car.choices, car.answer, lanes.answer) == (None, "Yes", "2")
    assert (turn.id, turn.source, turn.task, turn.image.size) == ("row 0", "realworldqa", "reasoning", (24, 24))
    assert len(load_realworldqa(tmp_path / "RealWorldQA" / "data" / "test-00000-of-00001.parquet", limit=1)) == 1


def test_realworldqa_rejections(tmp_path):
    rows = realworldqa_rows()
    rows[0]["answer"] = "D"
    with pytest.raises(
        LoaderError, match=r"row 0: the answer 'D' is not the letter of one of the options .*\(A, B, C\)"
    ):
        load_realworldqa(realworldqa_copy(tmp_path / "a", rows))
    # The JSON form, images as paths beside the file: one of them missing.
    folder = tmp_path / "json"
    rows = [{**r, "image": f"photos/{i}.png"} for i, r in enumerate(realworldqa_rows())]
    for i in (0, 2):
        png(folder / "photos" / f"{i}.png")
    (folder / "realworldqa.json").write_text(json.dumps(rows))
    with pytest.raises(LoaderError, match=r"1 of the 3 images are missing \(record 1\)"):
        load_realworldqa(folder / "realworldqa.json")
    with pytest.raises(LoaderError, match=r"nowhere: not found"):
        load_realworldqa(tmp_path / "nowhere")


def test_the_mas_papers_released_countingtricks_in_both_label_layouts(tmp_path):
    """images/<case>/*.png with run.py's per-image labels, or the generator's per-case label list
    (whose circle centres become points); images in run.py's name order; a missing label refused."""
    root = tmp_path / "mock-counting"
    for k in (0, 1, 10):
        png(root / "images" / "1A" / f"img_{k}.png", (16, 16))
        (root / "labels" / "1A").mkdir(parents=True, exist_ok=True)
        (root / "labels" / "1A" / f"img_{k}.json").write_text(json.dumps({"count": k + 1}))
    png(root / "images" / "8A" / "img_0.png", (16, 16))
    circles = [{"x": 67, "y": 94, "radius": 54, "patch_ids": [1]}]
    (root / "labels" / "8A_labels.json").write_text(
        json.dumps([{"image_id": "img_0.png", "count": 1, "circles": circles}])
    )
    samples = load_countingtricks_release(root)
    assert [(s.id, s.count) for s in samples] == [
        ("1A/img_0.png", 1),
        ("1A/img_1.png", 2),
        ("1A/img_10.png", 11),
        ("8A/img_0.png", 1),
    ]
    assert samples[3].points.tolist() == [[67.0, 94.0]] and samples[0].points is None
    assert samples[0].question == "How many red circle dots in the image?" and samples[0].meta["case"] == "1A"
    assert [s.id for s in load_countingtricks_release(root, ["8A"])] == ["8A/img_0.png"]
    png(root / "images" / "8A" / "img_1.png", (16, 16))
    with pytest.raises(LoaderError, match=r"img_1\.png: no label .*8A_labels\.json"):
        load_countingtricks_release(root)
    with pytest.raises(LoaderError, match=r"no folder for cases \['9A'\]"):
        load_countingtricks_release(root, ["9A"])
