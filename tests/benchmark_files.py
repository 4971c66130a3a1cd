"""Small copies of the general-reasoning benchmarks in their real layouts (MMMU, RealWorldQA,
MathVista as Hugging Face stores them), for the loader, answer-rule and fine-tune tests."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


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
