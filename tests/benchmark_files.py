"""Small copies of the reasoning benchmarks in their real layouts (CLEVR v1.0 as distributed; MMMU,
RealWorldQA, MathVista as Hugging Face stores them), for the loader, answer-rule, discover and
fine-tune tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def png(path: Path, size=(12, 8), color=(200, 10, 10)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def png_bytes(size=(24, 24), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _image() -> dict:
    return {"bytes": png_bytes(), "path": None}


def mmmu_rows(subject: str = "Math") -> list[dict]:
    """MMMU's columns: a multiple-choice, two open (one with a list of accepted answers) and a
    two-image question."""
    blank = {f"image_{i}": None for i in range(1, 8)}
    base = {"explanation": "", "img_type": "['Diagrams']", "topic_difficulty": "Easy", "subfield": "Geometry"}
    return [
        {
            **base,
            **blank,
            "id": f"validation_{subject}_1",
            "question": "<image 1> How many sides does the shape have?",
            "options": "['3', '4', '5', '6']",
            "answer": "B",
            "question_type": "multiple-choice",
            "image_1": _image(),
        },
        {
            **base,
            **blank,
            "id": f"validation_{subject}_2",
            "question": "What is the area of the square in <image 1>?",
            "options": "[]",
            "answer": "16",
            "question_type": "open",
            "image_1": _image(),
        },
        {
            **base,
            **blank,
            "id": f"validation_{subject}_3",
            "question": "Which two numbers are shown? <image 1>",
            "options": "[]",
            "answer": "['2', '3']",
            "question_type": "open",
            "image_1": _image(),
        },
        {
            **base,
            **blank,
            "id": f"validation_{subject}_4",
            "question": "Which of <image 1> and <image 2> has more sides?",
            "options": "['the first', 'the second']",
            "answer": "A",
            "question_type": "multiple-choice",
            "image_1": _image(),
            "image_2": _image(),
        },
    ]


def mmmu_copy(root: Path, rows_by_subject: dict[str, list[dict]] | None = None) -> Path:
    """``root/MMMU/<Subject>/validation-00000-of-00001.parquet``; returns ``root/MMMU``."""
    rows_by_subject = rows_by_subject or {"Math": mmmu_rows("Math")}
    for subject, rows in rows_by_subject.items():
        folder = root / "MMMU" / subject
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), folder / "validation-00000-of-00001.parquet")
    return root / "MMMU"


def realworldqa_rows() -> list[dict]:
    """RealWorldQA's columns: a lettered multiple-choice, a yes/no and a number question."""
    letter = "Please answer directly with only the letter of the correct option and nothing else."
    short = "Please answer directly with a single word or number."
    return [
        {
            "image": _image(),
            "question": f"Which way does the road turn?\nA. Left\nB. Right\nC. Straight\n{letter}",
            "answer": "B",
        },
        {"image": _image(), "question": f"Is there a car in front of us?\n{short}", "answer": "Yes"},
        {"image": _image(), "question": f"How many lanes does the road have?\n{short}", "answer": "2"},
    ]


def realworldqa_copy(root: Path, rows: list[dict] | None = None) -> Path:
    """``root/RealWorldQA/data/test-00000-of-00001.parquet``; returns ``root/RealWorldQA``."""
    folder = root / "RealWorldQA" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows or realworldqa_rows()), folder / "test-00000-of-00001.parquet")
    return root / "RealWorldQA"


def mathvista_rows() -> list[dict]:
    """MathVista's testmini columns: an integer, a multiple-choice and a float question."""
    base = {"unit": None, "precision": None, "choices": None, "question_type": "free_form", "query": None}
    return [
        {
            **base,
            "pid": "1",
            "question": "What is the sum of the two numbers?",
            "answer": "12",
            "answer_type": "integer",
        },
        {
            **base,
            "pid": "2",
            "question": "How many bars are there?",
            "query": "How many bars are there?\nChoices:\n(A) 3\n(B) 4\n(C) 5",
            "answer": "4",
            "answer_type": "text",
            "question_type": "multi_choice",
            "choices": ["3", "4", "5"],
        },
        {
            **base,
            "pid": "3",
            "question": "What is the slope?",
            "answer": "0.5",
            "answer_type": "float",
            "precision": 1.0,
        },
    ]


def mathvista_copy(root: Path) -> Path:
    """``root/MathVista/data/testmini-00000-of-00001.parquet`` with its images as bytes; returns the file."""
    folder = root / "MathVista" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{**r, "image": f"images/{r['pid']}.jpg", "decoded_image": _image()} for r in mathvista_rows()]
    pq.write_table(pa.Table.from_pylist(rows), folder / "testmini-00000-of-00001.parquet")
    return folder / "testmini-00000-of-00001.parquet"


def clevr_root(tmp_path: Path, scenes: bool = True) -> Path:
    """CLEVR v1.0's layout: questions/, images/<split>/ and scenes/ (objects and relationships), two
    images and three questions whose programs answer them on their scenes."""
    root = tmp_path / "CLEVR_v1.0"

    def node(function, *inputs, value=None):
        return {"function": function, "inputs": list(inputs), "value_inputs": [value] if value else []}

    right_of_cube = [  # image 0: a red cube (x 1) left of a blue sphere (x 3)
        node("scene"),
        node("filter_color", 0, value="red"),
        node("filter_shape", 1, value="cube"),
        node("unique", 2),
        node("relate", 3, value="right"),
        node("filter_shape", 4, value="sphere"),
        node("exist", 5),
    ]
    cylinders = [node("scene"), node("filter_shape", 0, value="cylinder"), node("count", 1)]
    left_of_brown = [  # image 1: a green cylinder (x 0), a gray sphere (x 2), a brown cylinder (x 5)
        node("scene"),
        node("filter_color", 0, value="brown"),
        node("filter_shape", 1, value="cylinder"),
        node("unique", 2),
        node("relate", 3, value="left"),
        node("filter_shape", 4, value="sphere"),
        node("unique", 5),
        node("query_color", 6),
    ]
    questions = [
        ("Is there a sphere right of the red cube?", "yes", 0, right_of_cube),
        ("How many cylinders are there?", "2", 1, cylinders),
        ("What color is the sphere left of the brown cylinder?", "gray", 1, left_of_brown),
    ]
    records = [
        {
            "question": q,
            "answer": a,
            "image_index": i,
            "question_family_index": f,
            "split": "val",
            "image_filename": f"CLEVR_val_{i:06d}.png",
            "program": program,
        }
        for f, (q, a, i, program) in enumerate(questions)
    ]
    (root / "questions").mkdir(parents=True)
    (root / "questions" / "CLEVR_val_questions.json").write_text(json.dumps({"info": {}, "questions": records}))
    for i in (0, 1):
        png(root / "images" / "val" / f"CLEVR_val_{i:06d}.png", (16, 12))
    if scenes:

        def thing(color, shape, size="large"):
            return {"color": color, "shape": shape, "size": size, "material": "rubber"}

        listed = [
            {
                "image_index": 0,
                "objects": [thing("red", "cube"), thing("blue", "sphere", "small")],
                "relationships": {"left": [[], [0]], "right": [[1], []], "front": [[], []], "behind": [[], []]},
            },
            {
                "image_index": 1,
                "objects": [thing("brown", "cylinder"), thing("green", "cylinder"), thing("gray", "sphere")],
                "relationships": {"left": [[1, 2], [], [1]], "right": [[], [0, 2], [0]]},
            },
        ]
        (root / "scenes").mkdir()
        (root / "scenes" / "CLEVR_val_scenes.json").write_text(json.dumps({"scenes": listed}))
    return root


def voc_root(root: Path, ids=("000001", "000002", "000003", "000004", "000005", "000006")) -> Path:
    """VOC2007's layout: ImageSets/Main/{trainval,test}.txt, Annotations/<id>.xml, JPEGImages/<id>.jpg;
    each image 40 × 20 px with one or two boxes (a difficult one kept)."""
    voc = root / "VOC2007"
    (voc / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
    (voc / "Annotations").mkdir(exist_ok=True)
    (voc / "JPEGImages").mkdir(exist_ok=True)
    for k, image_id in enumerate(ids):
        Image.new("RGB", (40, 20), (20 * k, 100, 50)).save(voc / "JPEGImages" / f"{image_id}.jpg")
        objects = [("dog", 0, (2 + k, 2, 12 + k, 12)), ("person", 1, (20, 4, 36, 18))][: 1 + k % 2]
        body = "".join(
            f"<object><name>{name}</name><difficult>{hard}</difficult><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin>"
            f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            for name, hard, (x0, y0, x1, y1) in objects
        )
        (voc / "Annotations" / f"{image_id}.xml").write_text(
            f"<annotation><filename>{image_id}.jpg</filename><size><width>40</width><height>20</height>"
            f"<depth>3</depth></size>{body}</annotation>"
        )
    half = len(ids) // 2
    (voc / "ImageSets" / "Main" / "trainval.txt").write_text("\n".join(ids[:half]) + "\n")
    (voc / "ImageSets" / "Main" / "test.txt").write_text("\n".join(f"{i} -1" for i in ids[half:]) + "\n")
    return voc
