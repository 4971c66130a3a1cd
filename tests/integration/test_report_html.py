"""report.html in a real browser (headless chromium, tests/browser.py), on a small discover run of the
organism made once per session: the page runs without a console error, a click on a head opens its
panel with heads.csv's numbers, the grid recolours by the chosen result, and it draws something.

Without chromium the tests fail where CI is set (CI always runs them) and are skipped elsewhere,
naming the packages to install. The builder alone: tests/unit/test_html_report.py.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from typer.testing import CliRunner

from countlens.cli import app

pytestmark = pytest.mark.slow  # a discover run and a browser


@pytest.fixture(scope="session")
def run(browser, toy_run, tmp_path_factory):
    """The shared small discover run (every head, every section; few samples, conftest.py), copied, its
    report.html rewritten by `countlens report`, the command that re-renders a run."""
    out = Path(shutil.copytree(toy_run, tmp_path_factory.mktemp("report_html") / "run"))
    (out / "report.html").unlink()
    assert CliRunner().invoke(app, ["report", "--run", str(out)]).exit_code == 0
    assert (out / "report.html").stat().st_size < 5_000_000
    return out


def _open(driver, run):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get((run / "report.html").as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#grid td[data-head]"))


def test_the_page_runs_without_errors_and_loads_nothing(browser, run):
    _open(browser, run)
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [name for name in loaded if not name.startswith(("data:", "file:"))], loaded


def test_a_click_on_a_head_opens_its_panel_with_heads_csv(browser, run):
    from selenium.webdriver.common.by import By

    _open(browser, run)
    csv = pd.read_csv(run / "heads.csv")
    cells = browser.find_elements(By.CSS_SELECTOR, "#grid td[role=button]")
    assert sorted(c.get_attribute("data-head") for c in cells) == sorted(csv["head_id"])
    for _, row in csv.iloc[[0, len(csv) // 2, -1]].iterrows():  # the most important head, a middle one, the last
        browser.find_element(By.CSS_SELECTOR, f'#grid td[data-head="{row["head_id"]}"]').click()
        assert browser.find_element(By.ID, "panel").is_displayed()
        assert browser.find_element(By.ID, "panel-id").text == row["head_id"]
        shown = {
            tr.get_attribute("data-col"): (tr.get_attribute("data-value"), tr.find_element(By.TAG_NAME, "td").text)
            for tr in browser.find_elements(By.CSS_SELECTOR, "#panel-numbers tr")
        }
        assert list(shown) == list(csv.columns)
        for column, value in row.items():
            exact, text = shown[column]
            if isinstance(value, str):
                assert exact == text == value
            elif pd.isna(value):
                assert exact == "" and text == "–"
            else:  # the exact number in data-value, four significant digits on screen
                assert float(exact) == float(value), (row["head_id"], column)
                assert float(text) == pytest.approx(float(value), rel=1e-3, abs=1e-12)
        assert row["class"] in browser.find_element(By.ID, "panel-class").text
        assert browser.find_elements(By.CSS_SELECTOR, "#panel-tokens tr")  # HeadLens's decoded tokens
        assert "attention_maps.nc" in browser.find_element(By.ID, "panel-images").text  # this run has none


def test_the_selector_recolours_the_grid(browser, run):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _open(browser, run)

    def colours() -> list[str]:
        return [
            c.value_of_css_property("background-color")
            for c in browser.find_elements(By.CSS_SELECTOR, "#grid td[role=button]")
        ]

    select = Select(browser.find_element(By.ID, "metric"))
    labels = [o.text for o in select.options]
    assert {"patching effect (signed, exact)", "AtP estimate of the patching effect", "ablation_drop", "class"} <= set(
        labels
    )
    before = colours()
    select.select_by_visible_text("class")
    assert colours() != before and len(set(colours())) >= 2
    assert "visual grounding" in browser.find_element(By.ID, "legend").text


def test_the_page_draws_something(browser, run):
    _open(browser, run)
    pixels = np.asarray(Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB"), dtype=float)
    assert pixels.var() > 0 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 16
