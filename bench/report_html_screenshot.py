"""docs/img/report_html.png: report.html of a discover run as a reader first sees its head grid, with
the most important head's panel open, drawn by the headless chromium the browser tests use
(tests/browser.py; Debian's chromium and chromium-driver, `make setup` installs them).

    python bench/report_html_screenshot.py runs/demo            # after `make demo`
    python bench/report_html_screenshot.py RUN --out shot.png

The image is stored as a 256-colour PNG (a page of flat colours loses nothing visible), and its size
printed: docs keep it under 300 KB.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pandas as pd
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a discover run directory holding report.html")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "report_html.png")
    args = parser.parse_args()
    page = args.run / "report.html"
    if not page.exists():
        sys.exit(f"{page} does not exist: run `countlens report --run {args.run}` to write it")
    sys.path.insert(0, str(ROOT / "tests"))  # the browser the tests use
    from browser import chromium, missing

    if missing():
        sys.exit(missing())
    from selenium.webdriver.common.by import By

    top = pd.read_csv(args.run / "heads.csv").sort_values("importance", ascending=False)["head_id"].iloc[0]
    with chromium(width=1280, height=1000) as driver:
        driver.get(page.resolve().as_uri())
        driver.find_element(By.CSS_SELECTOR, f'#grid td[data-head="{top}"]').click()
        driver.execute_script("document.getElementById('heads-explorer').scrollIntoView()")
        shot = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shot.quantize(256).save(args.out, optimize=True)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KB ({top}'s panel open)")


if __name__ == "__main__":
    main()
