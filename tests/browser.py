"""A headless browser for report.html: Debian's chromium, driven through its chromium-driver by selenium.

`missing` names the Debian packages that are not installed (``make setup`` installs them where it
can); `chromium` opens one headless window that records the page's console, so a test can read its
errors (``driver.get_log("browser")``). Used by tests/integration/test_report_html.py and by
bench/report_html_screenshot.py, which draws docs/img/report_html.png with the same browser.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The Debian package of each program the browser needs, and where Debian puts it.
PROGRAMS = {"chromium": ("chromium", "/usr/bin/chromium"), "chromedriver": ("chromium-driver", "/usr/bin/chromedriver")}


def _find(program: str) -> str | None:
    package, path = PROGRAMS[program]
    return path if Path(path).exists() else shutil.which(program)


def missing() -> str | None:
    """What is missing for a browser, with how to install it; None when nothing is."""
    packages = [PROGRAMS[p][0] for p in PROGRAMS if _find(p) is None]
    try:
        import selenium  # noqa: F401 - only whether it is installed
    except ImportError:
        return "the Python package selenium is not installed: pip install -e '.[dev]' (make setup)"
    if packages:
        return (
            f"the Debian packages {', '.join(packages)} are not installed (no chromium / chromedriver on PATH): "
            f"as root, apt-get install -y {' '.join(packages)} (make setup does it where it can)"
        )
    return None


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator:
    """A headless chromium window of ``width`` × ``height`` pixels, logging the page's console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _find("chromium")
    # --no-sandbox: chromium refuses to run as root with its sandbox (containers, CI); the pages are ours.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(_find("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()
