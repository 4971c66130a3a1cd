"""report.html's builder without a browser (`countlens.pipeline.html_report`, `head_panels`): the page
loads nothing from the web, stays bounded however many and however large the run's figures, has a
cell and a panel for every head of heads.csv with heads.csv's numbers, and gives every head the class
heads.csv gives it under the run's thresholds. The page in a real browser:
tests/integration/test_report_html.py."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from PIL import Image

from countlens import html_page
from countlens.analysis.heads import classify_heads, export_heads, read_heads
from countlens.pipeline import head_panels, html_report, presets
from countlens.pipeline.stages import ReportContext

LAYERS, HEADS, SAMPLES, K = 6, 4, 5, 3
REPORT = """# Counting circuit of `toy` (qwen2_vl)

Produced by `countlens discover`. See [the paper](https://arxiv.org/abs/2501.00001).

## 1. Accuracy

![cases](figures/cases.png)

| case | accuracy |
|---:|---:|
| 1A | 0.49 |
"""


def _png(width: int, height: int, noise: bool = False, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else np.full((height, width, 3), 200)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _run(tmp_path, preset: str = "") -> ReportContext:
    """A run directory as `write_report` sees it: heads.csv, the patching and HeadLens results, one
    figure report.md shows and one it does not; measurements drawn so that several classes occur."""
    rng = np.random.default_rng(1)
    coords = {"layer": np.arange(LAYERS), "head": np.arange(HEADS)}

    def grid(low=0.0, high=1.0):  # float32, as discover's results are: heads.csv spells them shorter
        values = rng.uniform(low, high, (LAYERS, HEADS)).astype(np.float32)
        return xr.DataArray(values, dims=("layer", "head"), coords=coords)

    effect = grid(-0.3, 0.6)
    table = classify_heads(
        grid(),
        grid(),
        grid(),
        np.abs(effect),
        grid(0.5, 1.0),
        presets.thresholds(preset),
        alignment=grid(),
        difficulty=grid(0.0, 0.2),
    )
    table.insert(table.columns.get_loc("importance") + 1, "ablation_drop", rng.normal(0, 1, len(table)))
    export_heads(table, tmp_path)
    vocab = np.array(["1", "2", "circle", "red", "</script><b>x"])  # a token that would end the data's tag
    tokens = vocab[rng.integers(0, len(vocab), (LAYERS, HEADS, SAMPLES, K))]
    headlens = xr.Dataset({"token": (("layer", "head", "sample", "k"), tokens)}, coords=coords)
    results = {"heads": effect.to_dataset(name="effect"), "atp": grid(-1, 1).to_dataset(name="effect")}
    results["headlens"] = headlens
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "cases.png").write_bytes(_png(3000, 200))
    (tmp_path / "figures" / "extra.png").write_bytes(_png(300, 200))
    return ReportContext("toy", "qwen2_vl", tmp_path, {"preset": preset}, results, table)


def _page_data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_the_page_loads_nothing_from_the_web(tmp_path):
    page = html_report.render_html(_run(tmp_path), REPORT)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "@import" not in page and "url(http" not in page
    assert "https://arxiv.org/abs/2501.00001" in page  # the address stays readable, as text
    figures = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in figures] == ["cases", "extra"]  # where report.md shows it, then the others
    import base64

    width, height = Image.open(io.BytesIO(base64.b64decode(figures[0][1]))).size
    assert max(width, height) == html_page.MAX_SIDE and width / height == pytest.approx(15, rel=0.02)
    assert "<table>" in page and "<h1" in page  # report.md's markdown rendered


def test_every_head_has_a_cell_and_its_panel_holds_heads_csv(tmp_path):
    page = html_report.render_html(_run(tmp_path), REPORT)
    data = _page_data(page)
    csv = read_heads(tmp_path)
    assert set(data["heads"]) == set(csv["head_id"])
    metrics = {m["key"]: m for m in data["metrics"]}
    assert {"heads", "atp", "importance", "ablation_drop", "image_attention", "class"} <= set(metrics)
    assert "eap_ig" not in metrics  # the run has none: no layer for it
    for _, row in csv.iterrows():
        panel = data["heads"][row["head_id"]]
        numbers = dict(panel["numbers"])
        assert list(numbers) == list(csv.columns)
        for column, value in row.items():
            if isinstance(value, str):
                assert numbers[column] == value
            else:
                assert numbers[column] == float(value), (row["head_id"], column)  # exact: no rounding on the way
        la, h = int(row["layer"]), int(row["head"])
        assert metrics["class"]["values"][la][h] == row["class"]
        assert metrics["importance"]["values"][la][h] == row["importance"]
        assert dict(panel["patching"])[head_panels.PATCHING[0][1]] == pytest.approx(metrics["heads"]["values"][la][h])
        assert panel["tokens"] and all(0 < share <= 1 for _, share in panel["tokens"])
        assert panel["images"] == []  # no results/attention_maps.nc in this run
    assert "</script><b>x" in {tok for panel in data["heads"].values() for tok, _ in panel["tokens"]}


@pytest.mark.parametrize("preset", ["", "counting-circuits"])
def test_the_panel_rules_give_each_head_its_class(tmp_path, preset):
    """The rules the panel shows (`class_rules`) are classify_heads's: under the run's thresholds they
    give every head the class heads.csv has (with the preset's alignment and difficulty tests too)."""
    data = _page_data(html_report.render_html(_run(tmp_path, preset), REPORT))
    classes = [(panel["rules_class"], panel["class"]) for panel in data["heads"].values()]
    assert all(given == shown for given, shown in classes), classes
    assert len({shown for _, shown in classes}) >= 3  # several rules decided, not "other" throughout
    columns = {c["column"] for rule in data["heads"]["L0H0"]["rules"] for conj in rule["any_of"] for c in conj}
    assert ({"alignment", "difficulty"} <= columns) == (preset == "counting-circuits")


def test_tied_tokens_keep_their_decoded_order(tmp_path):
    """Tokens as frequent as each other are listed in the order HeadLens decoded them, not in a set's
    order, which changes with the string hash seed: the page is the same on every render."""
    ctx = _run(tmp_path)
    order = ["7", "circle", "red", "3", "square", "blue"]
    tokens = np.broadcast_to(np.array(order[:K]), (LAYERS, HEADS, SAMPLES, K)).copy()
    tokens[:, :, 1:, :] = np.array(order[K : 2 * K])  # every token in its own share of the samples
    tokens[:, :, 0, :] = np.array(order[:K])
    ctx.results["headlens"] = xr.Dataset({"token": (("layer", "head", "sample", "k"), tokens)})
    panel = _page_data(html_report.render_html(ctx, REPORT))["heads"]["L2H1"]
    assert [tok for tok, _ in panel["tokens"]] == order[K : 2 * K] + order[:K]
    assert [share for _, share in panel["tokens"]] == [(SAMPLES - 1) / SAMPLES] * K + [1 / SAMPLES] * K


def test_the_page_stays_bounded_however_many_figures(tmp_path):
    ctx = _run(tmp_path)
    for i in range(30):  # incompressible figures, ~500 KB each: far more than the budget
        (ctx.figures / f"noise_{i:02d}.png").write_bytes(_png(400, 400, noise=True, seed=i))
    page = html_report.render_html(ctx, REPORT)
    assert len(page.encode()) < html_page.IMAGE_BUDGET * 4 / 3 + 200_000  # base64 of the budget, and the rest
    shown = re.findall(r'alt="(noise_\d+)"', page)
    assert 0 < len(shown) < 30 and "figures/noise_29.png" in page.split("Not embedded")[1]


def test_head_images_fill_the_most_important_panels_only(tmp_path, monkeypatch):
    ctx = _run(tmp_path)
    for i in range(html_page.MAX_IMAGES + 5):  # more figures than the page embeds: they do not crowd the heads out
        (ctx.figures / f"small_{i:02d}.png").write_bytes(_png(40, 30, seed=i))
    assert "attention_maps" not in ctx.results and head_panels.head_images(None, 0, 0) == []  # no maps stored
    monkeypatch.setattr(html_report, "MAX_IMAGE_HEADS", 2)
    sample = _png(64, 64)
    asked = []

    def images(maps, la, h):
        asked.append((la, h))
        return [(f"scene of L{la}H{h}", sample)] * 6

    monkeypatch.setattr(head_panels, "head_images", images)
    data = _page_data(html_report.render_html(ctx, REPORT))
    ranked = read_heads(tmp_path).sort_values("importance", ascending=False)["head_id"].tolist()
    for rank, head_id in enumerate(ranked):
        images = data["heads"][head_id]["images"]
        expected = html_report.MAX_IMAGES_PER_HEAD if rank < 2 else 0
        assert len(images) == expected and data["heads"][head_id]["images_left_out"] == (rank < 2)
        assert all(cap == f"scene of {head_id}" and uri.startswith("data:image/png;base64,") for cap, uri in images)
    assert len(asked) == 2  # the heads past the cap are not asked for their images at all
    shown = re.findall(r'<img alt="(small_\d+)"', html_report.render_html(ctx, REPORT))
    assert len(shown) == html_page.MAX_IMAGES - 2  # the figures' own cap (report.md shows two others)


def test_write_report_writes_the_page_beside_report_md(tmp_path):
    """Through `write_html`, as `write_report` calls it: the file lands beside report.md, as UTF-8."""
    ctx = _run(tmp_path)
    path = html_report.write_html(ctx, REPORT)
    assert path == tmp_path / "report.html" and path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert isinstance(pd.read_csv(tmp_path / "heads.csv"), pd.DataFrame)
