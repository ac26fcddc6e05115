"""A headless Chromium driven by Selenium, and ``lowwater view`` in a subprocess.

CI installs Debian's ``chromium`` and ``chromium-driver`` and the ``test``
extra's ``selenium``; where any of them is missing these tests are skipped
with the reason."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def view():
    """``view(path) -> url``: ``lowwater view path`` until the test ends."""
    procs = []

    def start(path: Path) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lowwater", "view", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read()
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)
