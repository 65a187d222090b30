"""Headless Chromium through Selenium, with the system's chromium and chromedriver (Debian's
`chromium` and `chromium-driver`); never a downloaded browser or driver."""

from __future__ import annotations

import os
import shutil

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium_paths() -> tuple[str, str] | None:
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_chromium(width: int = 1280, height: int = 800):  # noqa: ANN201 - a WebDriver
    """A headless Chromium, or a pytest skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    paths = chromium_paths()
    if paths is None:
        pytest.skip("no chromium and chromedriver on PATH: `apt-get install chromium "
                    "chromium-driver` (make test does this as root on Debian)")
    browser, driver = paths
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver from PATH: Selenium Manager must not try to download one.
    os.environ.setdefault("SE_OFFLINE", "true")
    return webdriver.Chrome(service=Service(driver), options=opts)
