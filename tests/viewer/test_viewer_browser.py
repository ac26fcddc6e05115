"""``lowwater view`` in a real browser (headless Chromium through Selenium):
the page loads a run, sorts and filters its rollouts, opens a transcript on
demand, draws the memory plot, and copes with thousands of rollouts; the
screenshot is checked to be non-blank."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import trio

from lowwater.eval import EvalConfig
from lowwater.eval.header import build_header
from lowwater.eval.results import SUMMARY_TYPE
from lowwater.eval.samples import SAMPLES_TYPE

pytest.importorskip("selenium")
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait


def wait(driver, condition, timeout=30, message=None):
    try:
        return WebDriverWait(driver, timeout).until(condition)
    except TimeoutException:
        raise AssertionError(f"timed out: {message() if message else ''}") from None


def ready(driver):
    wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") in ("true", "error"))
    assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true", driver.page_source[:2000]


def count_text(driver):
    return driver.find_element(By.ID, "count").text


def view_eval(browser, view, out: Path, *args: str, timeout: float = 240) -> None:
    """Run ``lowwater eval ARGS --out OUT --no-progress`` and open its results in
    the viewer, waiting until the page has loaded them."""
    done = subprocess.run(
        [sys.executable, "-m", "lowwater", "eval", *args, "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    browser.get(view(out))
    ready(browser)


def set_value(driver, element_id, value):
    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(value)


def assert_not_blank(png: bytes) -> None:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 20, "the screenshot is (nearly) one colour"
    background = max(colours)[0] / (image.width * image.height)
    assert background < 0.97, "the screenshot is almost all background"


def test_a_real_run_in_the_browser(tmp_path, browser, view):
    out = tmp_path / "r.jsonl"
    view_eval(browser, view, out, "-n", "6", "--group-size", "2")
    assert count_text(browser) == "12 of 12 rollouts"
    assert "arithmetic" in browser.find_element(By.ID, "title").text
    # the memory plot: two lines, a title naming env, model and run
    plot = browser.find_element(By.ID, "memory-plot")
    assert len(plot.find_elements(By.TAG_NAME, "polyline")) == 2
    assert "arithmetic" in plot.text and "scripted" in plot.text and "rollouts finished" in plot.text
    # sort by task, descending on the second click
    header = browser.find_element(By.CSS_SELECTOR, "th[data-key=task_id]")
    header.click()
    header.click()
    first = browser.find_element(By.CSS_SELECTOR, "#rows tbody tr td").text
    assert first == "5"
    # filter by group: both members of one group
    group = browser.find_element(By.CSS_SELECTOR, "#rows tbody tr td.mono").text
    set_value(browser, "f-group", group)
    wait(browser, lambda d: count_text(d) == "2 of 12 rollouts", message=lambda: (group, count_text(browser)))
    set_value(browser, "f-group", "")
    Select(browser.find_element(By.ID, "f-error")).select_by_value("timeout")
    wait(browser, lambda d: count_text(d) == "0 of 12 rollouts")
    Select(browser.find_element(By.ID, "f-error")).select_by_value("none")
    wait(browser, lambda d: count_text(d) == "12 of 12 rollouts")
    # open a transcript: the prompt, the calculator calls and their results
    browser.find_elements(By.CSS_SELECTOR, "#rows tbody tr")[0].click()
    wait(browser, EC.visibility_of_element_located((By.ID, "transcript-prompt")))
    panel = browser.find_element(By.ID, "transcript")
    assert browser.find_element(By.ID, "transcript-prompt").text.strip()
    assert "calculator" in panel.text and "TOOL" in panel.text and "reward 1" in panel.text
    # the tools offered: one folded block per turn, the first naming them, the
    # others "same as turn 1"; the definitions appear when a block is opened
    blocks = panel.find_elements(By.CSS_SELECTOR, ".turn details.tools")
    assert len(blocks) == len(panel.find_elements(By.CSS_SELECTOR, ".turn")) >= 2
    summaries = [b.find_element(By.TAG_NAME, "summary").text for b in blocks]
    assert summaries[0] == "tools offered (1): calculator", summaries
    assert all(s == "tools offered (1) · same as turn 1: calculator" for s in summaries[1:]), summaries
    definition = blocks[1].find_element(By.TAG_NAME, "pre")
    assert not definition.is_displayed()
    blocks[1].find_element(By.TAG_NAME, "summary").click()
    wait(browser, lambda d: definition.is_displayed() and '"expression"' in definition.text)
    blocks[1].find_element(By.TAG_NAME, "summary").click()  # folded again for the screenshot
    png = browser.get_screenshot_as_png()
    (tmp_path / "viewer.png").write_bytes(png)
    if os.environ.get("LOWWATER_VIEWER_SCREENSHOT"):  # to look at it: a path to copy it to
        Path(os.environ["LOWWATER_VIEWER_SCREENSHOT"]).write_bytes(png)
    assert_not_blank(png)


def synthetic_run(tmp_path, n):
    """A results file of ``n`` rollouts (a fifth errored, of every class) with their transcripts."""
    rng = random.Random(7)
    out = tmp_path / "big.jsonl"
    header = build_header(EvalConfig(out=out, group_size=1), "bigrun")
    rows, samples = [orjson.dumps(header)], [orjson.dumps({"type": SAMPLES_TYPE, "run_id": "bigrun"})]
    classes = ["infra", "model", "environment", "timeout", "cancelled"]
    for i in range(n):
        error = {"class": classes[(i // 5) % 5], "message": f"failure {i % 7}"} if i % 5 == 4 else None
        reward = None if error else rng.choice([0.0, 0.25, 1.0])
        rid = f"r-{i:06d}"
        rows.append(orjson.dumps({
            "task_id": i, "rollout_id": rid, "group_id": None, "attempt": 1, "reward": reward,
            "metrics": {"correct": reward == 1.0}, "turns": 2, "error": error, "timing": {"total_s": 0.1},
            "run_id": "bigrun", "attempts": 1,
        }))  # fmt: skip
        samples.append(orjson.dumps({
            "rollout_id": rid, "task_id": i, "group_id": None, "attempt": 1,
            "task": {"prompt": f"question number {i}", "answer": "42", "metadata": {}}, "state": {},
            "turns": [{"index": 0, "protocol": "openai.chat", "model": "m", "request_delta": [
                {"role": "user", "content": f"question number {i}"}], "request_delta_start": 0,
                "completion": {"role": "assistant", "content": f"answer {i}"}, "usage": {"total_tokens": 9},
                "duration_s": 0.01}],
            "reward": reward, "metrics": {}, "error": error, "timing": {},
        }))  # fmt: skip
    memory = {
        "baseline_bytes": 40 << 20,
        "peak_bytes": 50 << 20,
        "samples": [[t, (40 + t) << 20, t * 100] for t in range(11)],
    }
    summary = {"rollouts": n, "completed": n - n // 5, "errors": n // 5, "accuracy": 0.3, "reward_mean": 0.4,
               "turns_mean": 2, "wall_s": 10, "rollouts_per_s": n / 10, "rss_baseline_mb": 40, "rss_peak_mb": 50,
               "rss_resting_mb": 41, "error_rate": 0.2, "top_errors": []}  # fmt: skip
    rows.append(orjson.dumps({"type": SUMMARY_TYPE, "run_id": "bigrun", "summary": summary, "memory": memory}))
    out.write_bytes(b"\n".join(rows) + b"\n")
    (tmp_path / "big.samples.jsonl").write_bytes(b"\n".join(samples) + b"\n")
    return out


def test_thousands_of_rollouts(tmp_path, browser, view):
    n = 5000
    browser.get(view(synthetic_run(tmp_path, n)))
    ready(browser)
    assert count_text(browser) == f"{n} of {n} rollouts"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rows tbody tr")) == 200  # one page in the DOM
    Select(browser.find_element(By.ID, "f-error")).select_by_value("timeout")
    wait(browser, lambda d: count_text(d) == f"{n // 25} of {n} rollouts")
    Select(browser.find_element(By.ID, "f-error")).select_by_value("")
    set_value(browser, "f-reward-min", "0.5")
    completed_full = count_text(browser)
    assert int(completed_full.split()[0]) < n
    # sort by reward, go to page 2, open a transcript there: fetched on demand
    browser.find_element(By.CSS_SELECTOR, "th[data-key=reward]").click()
    browser.find_element(By.ID, "next").click()
    row = browser.find_elements(By.CSS_SELECTOR, "#rows tbody tr")[3]
    rid = row.get_attribute("data-rollout")
    row.click()
    wait(browser, EC.text_to_be_present_in_element((By.ID, "transcript-title"), rid))
    wait(browser, EC.visibility_of_element_located((By.ID, "transcript-prompt")))
    number = int(rid.split("-")[1])
    assert browser.find_element(By.ID, "transcript-prompt").text == f"question number {number}"
    assert_not_blank(browser.get_screenshot_as_png())


def test_api_without_a_browser(tmp_path):
    """The JSON API itself (what the page reads), through the ASGI app."""
    import httpx

    from lowwater.http import serve
    from lowwater.viewer import Viewer

    out = synthetic_run(tmp_path, 30)

    async def main():
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, Viewer(out))
            async with httpx.AsyncClient(base_url=f"http://{address}") as http:
                run = (await http.get("/api/run")).json()
                assert run["header"]["run_id"] == "bigrun" and run["summary"]["summary"]["rollouts"] == 30
                rows = (await http.get("/api/rows")).json()["rows"]
                assert len(rows) == 30 and rows[4]["error_class"] == "infra"
                sample = (await http.get("/api/sample/r-000007")).json()
                assert sample["task"]["prompt"] == "question number 7"
                assert (await http.get("/api/sample/nope")).status_code == 404
                assert (await http.get("/static/../results.jsonl")).status_code == 404
                page = await http.get("/")
                assert page.status_code == 200 and "app.js" in page.text
                assert "default-src 'self'" in page.headers["content-security-policy"]
            nursery.cancel_scope.cancel()

    trio.run(main)


GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(
    not (GSM8K / "test.jsonl").is_file(),
    reason="GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)",
)
def test_gsm8k_transcripts_open_in_the_viewer(tmp_path, browser, view):
    from lowwater.plugins import load

    if "gsm8k" not in load().environments:
        pytest.skip("lowwater-gsm8k is not installed (pip install -e plugins/lowwater-gsm8k)")
    out = tmp_path / "g.jsonl"
    view_eval(
        browser, view, out,
        "gsm8k", "--data", str(GSM8K / "test.jsonl"), "-n", "10",
        "--model", f"replay:{GSM8K / 'example_model_solutions.jsonl'}#175b_verification", "--max-error-rate", "1",
        timeout=300,
    )  # fmt: skip
    assert count_text(browser) == "10 of 10 rollouts"
    Select(browser.find_element(By.ID, "f-correct")).select_by_value("false")
    wait(browser, lambda d: int(count_text(d).split()[0]) < 10)
    browser.find_elements(By.CSS_SELECTOR, "#rows tbody tr")[0].click()
    wait(browser, EC.visibility_of_element_located((By.ID, "transcript-prompt")))
    panel = browser.find_element(By.ID, "transcript").text
    assert "calculator" in panel and "correct" in panel
    assert_not_blank(browser.get_screenshot_as_png())
