"""Each general-reasoning benchmark's answer reading, on answers worked by hand from its rules, and
`generate` reading a loaded copy's questions by them."""

from __future__ import annotations

import pytest
from benchmark_files import mathvista_copy, mmmu_copy, realworldqa_copy

from countlens.analysis.benchmark_answers import (
    edit_distance,
    mmmu_choice,
    mmmu_open,
    mmmu_open_correct,
    read_answer,
)
from countlens.analysis.evaluate import generate
from countlens.datasets.loaders import QuestionSample, load_mathvista, load_mmmu, load_realworldqa

OPTIONS = ["3", "4", "5", "6"]


@pytest.mark.parametrize(
    "text, want",
    [
        ("(B)", "B"),
        ("B", "B"),
        ("The answer is B.", "B"),  # end punctuation stripped, then " B " found
        ("A or B", "B"),  # several: the one written last
        ("(A) is wrong, (C) is right", "C"),  # brackets first, the last bracketed
        ("I believe the shape has exactly 4 sides in total", "B"),  # > 5 words: an option's text
        ("4 sides", None),  # ≤ 5 words: no option text read; MMMU would pick at random
        ("maybe", None),
        ("Bees", None),  # a letter inside a word is not an answer
    ],
)
def test_mmmu_multiple_choice(text, want):
    assert mmmu_choice(text, ["A", "B", "C", "D"], OPTIONS) == want


@pytest.mark.parametrize(
    "text, gold, right",
    [
        ("The area is 16.", ["16"], True),  # the tail after "is", and its number
        ("16.004", ["16"], True),  # numbers rounded to 2 decimals
        ("16.1", ["16"], False),
        ("1,600", ["1600"], True),  # thousands separators
        ("so the answer is 3", ["2", "3"], True),  # any accepted answer
        ("It is a triangle", ["triangle"], True),  # a gold text inside the key tail
        ("It is a square", ["triangle"], False),
        ("x", ["x"], True),
        ("the answer is ax", ["x"], False),  # one-letter golds must stand apart (" x" / "x ")
    ],
)
def test_mmmu_open(text, gold, right):
    assert mmmu_open_correct(gold, mmmu_open(text)) is right


def test_mmmu_open_reads_key_tails_and_numbers():
    # Each line's shortest tail after a key phrase ("=" in the last line only), as numbers where they are.
    assert set(mmmu_open("The width is 4\nso 2 x 8 = 16")) == {4.0, 16.0}
    assert set(mmmu_open("First, x = 2\nTherefore the result is 5.5")) == {5.5}


def _mathvista(question_type="free_form", answer_type="integer", answer="12", choices=None, precision=None):
    return QuestionSample(
        image_path="x.png",
        image_bytes=None,
        question="q",
        answer=answer,
        task="math",
        source="mathvista",
        id="1",
        choices=choices,
        meta={"question_type": question_type, "answer_type": answer_type, "precision": precision},
    )


@pytest.mark.parametrize(
    "text, read, parsed, right",
    [
        ("B", "4", True, True),  # a letter becomes its option
        ("4", "4", True, True),  # an option itself
        ("(C) 5", "5", True, False),
        ("The answer is (B).", "4", True, True),
        ('The answer is "6".', "6", True, False),  # MathVista's quick extraction
        ("hmm", "3", False, False),  # only the edit-distance fallback reads it: unread, still scored
    ],
)
def test_mathvista_multiple_choice(text, read, parsed, right):
    r = read_answer(text, _mathvista("multi_choice", "text", "4", choices=tuple(OPTIONS)))
    assert (r.answer, r.parsed, r.correct) == (read, parsed, right)


@pytest.mark.parametrize(
    "answer_type, answer, precision, text, read, right",
    [
        ("integer", "12", None, "12", "12", True),
        ("integer", "12", None, "The sum is 12.", "12", True),  # countlens's rule: the last number
        ("integer", "12", None, "5 and 7 make 12", "12", True),
        ("integer", "12", None, "12.0", "12", True),  # int(float(x))
        ("integer", "12", None, "twelve", "", False),
        ("float", "0.5", 1.0, "about 0.52", "0.5", True),  # rounded to the question's precision
        ("float", "1.25", 2.0, "1.254", "1.25", True),
        ("float", "1.25", 2.0, "1.3", "1.3", False),
    ],
)
def test_mathvista_numbers(answer_type, answer, precision, text, read, right):
    r = read_answer(text, _mathvista(answer_type=answer_type, answer=answer, precision=precision))
    assert (r.answer, r.correct, r.parsed) == (read, right, bool(read))


def test_realworldqa_and_edit_distance(tmp_path):
    turn, car, lanes = load_realworldqa(realworldqa_copy(tmp_path))
    assert [read_answer(t, turn).correct for t in ("B", "(B) Right", "Right", "A")] == [True, True, False, False]
    assert [read_answer(t, car).correct for t in ("Yes.", "yes, there is", "No")] == [True, True, False]
    assert [(read_answer(t, lanes).correct, read_answer(t, lanes).parsed) for t in ("2 lanes", "2.0", "two")] == [
        (True, True),
        (True, True),
        (False, False),
    ]
    assert (edit_distance("kitten", "sitting"), edit_distance("", "ab"), edit_distance("ab", "ab")) == (3, 2, 0)


def test_generate_reads_each_benchmark_by_its_rule(loaded, tmp_path):
    """The organism's free answers to the three copies, read by their rules: parsed, correct and
    extracted agree with `read_answer` on the same text; option questions may exceed the token budget
    (the model writes a letter)."""
    vlm = loaded("toy")
    samples = [
        *load_mmmu(mmmu_copy(tmp_path)),
        *load_realworldqa(realworldqa_copy(tmp_path)),
        *load_mathvista(mathvista_copy(tmp_path)),
    ]
    ds = generate(vlm, samples, max_new_tokens=4, batch_size=8)
    for i, s in enumerate(samples):
        r = read_answer(str(ds.text.values[i]), s)
        assert (ds.extracted.values[i], bool(ds.parsed.values[i]), bool(ds.correct.values[i])) == tuple(
            r.__dict__.values()
        )
        assert ds.pred_count.values[i] == -1
