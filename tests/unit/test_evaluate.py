"""Evaluation: answer parsing, greedy generation on the organism, metrics and the case table."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from countlens.analysis.evaluate import generate, score
from countlens.analysis.metrics import accuracy, digit_in_conflict, number_avoidance, summary
from countlens.analysis.parse import parse_count
from countlens.analysis.tables import case_table, to_latex, to_markdown, write_table
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError


@pytest.fixture(scope="module")
def vlm(loaded):
    return loaded("toy")


@pytest.mark.parametrize(
    "text, want",
    [
        ("I think there are 3 circles", 3),
        ("three", 3),
        ("There are no circles.", 0),
        ("none", 0),
        ("None.", 0),
        ("I don't know", None),
        ("nothing", None),
        ("nonexistent", None),
        ("someone", None),
        ("12.", 12),
        ("4 or 5", 4),
        ("Seventeen", 17),
        ("twenty-one", 21),
        ("twenty", 20),
        ("", None),
    ],
)
def test_parse_count(text, want):
    assert parse_count(text) == want


def test_parse_count_rejects_non_text():
    with pytest.raises(InputError, match="string"):
        parse_count(3)


def test_generate_end_to_end_agrees_with_scoring(vlm):
    samples = task_samples("count", 6, seed=1, image_size=vlm.geometry.image_height)
    gen = generate(vlm, samples, max_new_tokens=4, batch_size=4)
    assert gen.sizes == {"sample": 6}
    for text, pred, parsed in zip(gen.text.values, gen.pred_count.values, gen.parsed.values):
        assert isinstance(text, str) and text and "<" not in text  # decoded words, no special tokens
        assert len(text.split()) <= 4
        want = parse_count(text)
        assert parsed == (want is not None) and pred == (-1 if want is None else want)
    assert (gen["count"].values == [int(s.answer) for s in samples]).all()
    assert (gen.correct.values == (gen.pred_count.values == gen["count"].values)).all()
    # Greedy decoding's first token is single-token scoring's arg-max: two computations (generation's
    # batches of 4, scoring's of 6), whose top two logits stand ≥ 0.28 apart here (measured): no tie.
    sc = score(vlm, samples, batch_size=6)
    assert [t.split()[0] for t in gen.text.values] == list(sc.pred.values)
    assert (sc.pred_count.values == gen.pred_count.values).all()
    assert float(accuracy(sc, "task")["accuracy"].iloc[0]) == pytest.approx(float(sc.correct.mean()))


@pytest.mark.parametrize(
    "text, want",
    [
        ("There are 7 circles", 7),
        ("I see 12 dots, not 13", 12),
        ("cannot tell", 0),  # "no" inside "cannot": the code's regex has no word boundaries
        ("someone", 1),
        ("fourteen", 4),  # "four" is tried before "fourteen"
        ("often", 10),
        ("none", 0),
        ("Seventeen", 7),  # no "seventeen" in its words: "seven"
        ("x", None),
        ("", None),
    ],
)
def test_the_mas_papers_parser_as_its_code_reads(text, want):
    from countlens.reference.counting_to_four.parse import parse_count_as_reference

    assert parse_count_as_reference(text) == want


def test_generate_reads_counts_with_the_papers_parser_when_asked(vlm):
    from countlens.reference.counting_to_four.parse import parse_count_as_reference

    samples = task_samples("count", 4, seed=2, image_size=vlm.geometry.image_height)
    ds = generate(vlm, samples, max_new_tokens=3, batch_size=4, parser="paper-code")
    assert ds.attrs["parser"] == "paper-code"
    assert [(-1 if (c := parse_count_as_reference(t)) is None else c) for t in ds.text.values] == list(
        ds.pred_count.values
    )
    with pytest.raises(InputError, match="unknown parser"):
        generate(vlm, samples, parser="regex")


def _ds(**vars_) -> xr.Dataset:
    n = len(next(iter(vars_.values())))
    return xr.Dataset({k: ("sample", np.asarray(v)) for k, v in vars_.items()}, coords={"sample": np.arange(n)})


def test_summary_accuracy_mae_unparsed():
    ds = _ds(
        count=[3, 4, 5, 6, -1],
        pred_count=[3, 5, -1, 9, -1],
        parsed=[True, True, False, True, False],
        correct=[True, False, False, False, True],
        case=["1A", "1A", "9A", "9A", ""],
    )
    overall = summary(ds)
    assert list(overall.index) == ["all"] and int(overall.loc["all", "n"]) == 5
    assert overall.loc["all", "accuracy"] == pytest.approx(2 / 5)
    assert overall.loc["all", "mae"] == pytest.approx((0 + 1 + 3) / 3)  # parsed counting answers only
    assert overall.loc["all", "unparsed"] == pytest.approx(1 / 4)  # counting samples only
    by_case = summary(ds, "case")
    assert by_case.loc["1A", "mae"] == pytest.approx(0.5) and by_case.loc["9A", "mae"] == pytest.approx(3.0)
    assert by_case.loc["9A", "unparsed"] == pytest.approx(0.5) and np.isnan(by_case.loc["", "mae"])
    with pytest.raises(InputError, match="'colour'"):
        summary(ds, "colour")


def test_summary_parses_score_tokens():
    ds = _ds(pred=np.array(["Ġ3", "▁five", "red"], dtype=object), count=[3, 4, 2], correct=[True, False, False])
    row = summary(ds).loc["all"]
    assert row["mae"] == pytest.approx(0.5) and row["unparsed"] == pytest.approx(1 / 3)


def test_number_avoidance_on_synthetic_data():
    counts = np.repeat(np.arange(3, 13), 10)
    acc = {n: 1.0 - (n - 3) / 10 for n in range(3, 13)}  # 100 % at 3, 10 % at 12
    correct = np.concatenate([np.arange(10) < round(10 * acc[n]) for n in range(3, 13)])
    out = number_avoidance(_ds(count=counts, correct=correct))
    assert out["r"] == pytest.approx(-1.0)
    assert out["per_count"][3] == pytest.approx(1.0) and out["per_count"][12] == pytest.approx(0.1)
    assert out["n"] == {n: 10 for n in range(3, 13)}
    flat = number_avoidance(_ds(count=[3, 4], correct=[True, True]))
    assert np.isnan(flat["r"])


def test_digit_in_conflict_on_synthetic_data():
    std = _ds(correct=[True, True, True, False])
    conflict = _ds(
        count=[3, 4, 5, 6],
        pred_count=[4, 4, 7, -1],
        parsed=[True, True, True, False],
        correct=[False, True, False, False],
    )
    out = digit_in_conflict(std, conflict, distractors=[4, 2, 7, 8])
    assert out["accuracy_std"] == 0.75 and out["accuracy_conflict"] == 0.25 and out["drop"] == 0.5
    assert out["distractor_share"] == 0.5  # samples 0 and 2 repeat the hint
    assert out["distractor_share_of_errors"] == pytest.approx(2 / 3)
    with pytest.raises(InputError, match="one distractor digit per sample"):
        digit_in_conflict(std, conflict, distractors=[4, 2])


def test_case_table_layout_and_files(tmp_path):
    a = _ds(case=["9A", "1A", "1A", "5A", "6A"], correct=[False, True, False, True, True])
    b = _ds(case=["1A", "9A"], correct=[True, True])
    table = case_table({"model-a": a, "model-b": b})
    assert list(table.columns) == ["model-a", "model-b"]
    assert list(table.index) == [
        "1A",
        "5A",
        "6A",
        "9A",
        "mean (position)",
        "mean (dilation)",
        "mean (adjacency)",
        "mean (all)",
    ]
    assert table.loc["1A", "model-a"] == 50.0 and table.loc["mean (dilation)", "model-a"] == 100.0
    assert table.loc["mean (all)", "model-a"] == pytest.approx((50 + 100 + 100 + 0) / 4)
    assert np.isnan(table.loc["5A", "model-b"]) and table.loc["mean (all)", "model-b"] == 100.0
    assert "| 1A | 50.0 | 100.0 |" in to_markdown(table) and r"\textbf{100.0}" in to_latex(table)
    paths = write_table(table, tmp_path / "t5")
    assert [p.name for p in paths] == ["t5.md", "t5.csv", "t5.tex"] and all(p.exists() for p in paths)
    with pytest.raises(InputError, match="not COUNTINGTRICKS cases"):
        case_table({"m": _ds(case=["", "1A"], correct=[True, True])})
