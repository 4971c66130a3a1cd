"""The command line: help works, eval writes its tables, bad arguments exit 2 and write nothing."""

from typer.testing import CliRunner

from countlens.cli import app

runner = CliRunner()


def test_help_of_every_command():
    for args in (["--help"], ["eval", "--help"], ["toy", "--help"], ["toy", "train", "--help"], ["data", "countingtricks", "--help"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Usage" in result.output, args


def test_eval_writes_tables(tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    result = runner.invoke(app, ["eval", "--model", str(tiny_checkpoint("qwen2_vl")), "--n", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Counting, per N" in (out / "accuracy.md").read_text()
    assert len((out / "samples.csv").read_text().splitlines()) == 1 + 8 + 2 + 2


def test_bad_arguments_exit_2_and_write_nothing(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["eval", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o1")], "never downloads"),
        (["eval", "--seed", "5000", "--out", str(tmp_path / "o2")], "training scenes"),
        (["eval", "--out", str(a_file)], "is a file"),
        (["toy", "train", "--out", str(a_file)], "is a file"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_data_countingtricks_writes_images_and_manifest(tmp_path):
    out = tmp_path / "tricks"
    args = ["data", "countingtricks", "--out", str(out), "--cases", "1A,12A", "--n", "3", "--image-size", "224",
            "--patch-size", "14", "--workers", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 6
    assert len(list(out.rglob("*.png"))) == 6


def test_data_countingtricks_rejects_bad_arguments(tmp_path):
    for extra, message in ((["--cases", "1A,99Z"], "unknown COUNTINGTRICKS case"),
                           (["--image-size", "200", "--patch-size", "16"], "not a multiple"),
                           (["--prompt", "loud"], "unknown prompt style")):
        out = tmp_path / "x"
        result = runner.invoke(app, ["data", "countingtricks", "--out", str(out), "--n", "2", *extra])
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
        assert not out.exists()
