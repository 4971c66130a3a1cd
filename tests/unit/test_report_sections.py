"""The fine-tune section of report.md: one splice puts it in (`countlens finetune`) and keeps it
when the report is rebuilt (`countlens report`), byte for byte."""

from countlens.pipeline.report import FINETUNE_SECTION, add_finetune_section, splice_finetune_section

REPORT = "# Report\n\n## 9. Is it a circuit?\n\nsharper\n\n"


def test_a_section_goes_after_the_report_and_replaces_an_earlier_one():
    first = splice_finetune_section(REPORT, f"{FINETUNE_SECTION}\n\nfirst table\n")
    assert first == f"# Report\n\n## 9. Is it a circuit?\n\nsharper\n\n{FINETUNE_SECTION}\n\nfirst table\n"
    second = splice_finetune_section(first, f"{FINETUNE_SECTION}\n\nsecond table\n")
    assert second == first.replace("first table", "second table")


def test_a_rebuilt_report_keeps_the_section_it_had():
    kept = splice_finetune_section(REPORT, f"{FINETUNE_SECTION}\n\nCommand: `x`.\n\ntable\n")
    rebuilt = "# Report, rebuilt\n"
    spliced = splice_finetune_section(rebuilt, kept[kept.index(FINETUNE_SECTION) :])
    assert spliced == f"# Report, rebuilt\n\n{FINETUNE_SECTION}\n\nCommand: `x`.\n\ntable\n"


def test_add_finetune_section_writes_the_table_and_its_command_or_nothing(tmp_path):
    run, out = tmp_path / "run", tmp_path / "run" / "finetune"
    out.mkdir(parents=True)
    (out / "before_after.md").write_text("| row | acc |\n")
    assert add_finetune_section(run, out, "countlens finetune --model toy --circuit run") is None
    assert not (run / "report.md").exists()
    (run / "report.md").write_text(REPORT)
    for _ in range(2):  # a rerun replaces the section
        assert add_finetune_section(run, out, "countlens finetune --model toy --circuit run") == run / "report.md"
    assert (run / "report.md").read_text() == (
        f"{REPORT.rstrip()}\n\n{FINETUNE_SECTION}\n\nCommand: `countlens finetune --model toy --circuit run`.\n\n"
        "| row | acc |\n"
    )
