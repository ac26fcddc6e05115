"""tests/plugin_dist, installed as a third party's distribution would be
(CI: ``pip install -e tests/plugin_dist``): a runtime picked by name with
options, an agent program on the official ``openai`` SDK run by ``--program``,
and a redacting and a rejecting interceptor (``LOWWATER_PLUGINS``)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytest.importorskip("openai")
if not any(ep.name == "lowwater-testdist" for ep in importlib.metadata.entry_points(group="lowwater")):
    pytest.skip("tests/plugin_dist is not installed (pip install -e tests/plugin_dist)", allow_module_level=True)


def lowwater(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lowwater", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def program_eval(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return lowwater(
        "eval", "-n", "3", "-c", "2", "--no-progress", "--out", "r.jsonl",
        "--harness", "program", "--program", f"{sys.executable} -m lowwater_testdist.openai_agent",
        "--pass-env", "PYTHONPATH",  # where the distribution lives when it is not in site-packages
        "--runtime", "testdist-limited",
        "--runtime-option", "cpu_seconds=30",
        "--runtime-option", f"log={tmp_path / 'starts.log'}",
        "--runtime-option", "label=picked-by-name",
        *extra, cwd=tmp_path, env=env,
    )  # fmt: skip


def test_plugins_lists_the_runtime_and_its_options(tmp_path):
    out = lowwater("plugins", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    data = orjson.loads(out.stdout)
    assert "testdist-limited" in data["runtimes"]
    assert {o["name"] for o in data["runtime_options"]["testdist-limited"]} == {"cpu_seconds", "label", "log"}
    bad = lowwater("eval", "--runtime", "testdist-limited", "--runtime-option", "cpu=1", cwd=tmp_path)
    assert bad.returncode == 2 and "did you mean 'cpu_seconds'" in bad.stderr


def test_openai_sdk_agent_in_the_named_runtime_through_a_redacting_interceptor(tmp_path):
    out = program_eval(tmp_path, env={"LOWWATER_PLUGINS": "lowwater_testdist.interceptors"})
    assert out.returncode == 0, out.stderr
    rows = [orjson.loads(line) for line in (tmp_path / "r.jsonl").read_bytes().splitlines()]
    header, results = rows[0], [r for r in rows if "task_id" in r]
    assert header["runtime"]["kind"] == "testdist-limited"
    assert header["runtime"]["options"]["label"] == "picked-by-name"
    assert len(results) == 3 and all(r["error"] is None and r["reward"] == 1.0 for r in results)
    assert "picked-by-name cpu=30" in (tmp_path / "starts.log").read_text()
    transcripts = (tmp_path / "r.samples.jsonl").read_text()
    assert "<redacted>" in transcripts and "tok-S3CR3T" not in transcripts  # the turn shows what went upstream


def test_a_rejecting_interceptor_reaches_the_sdk_as_an_api_error(tmp_path):
    env = {"LOWWATER_PLUGINS": "lowwater_testdist.interceptors", "LOWWATER_TESTDIST_REJECT": "1"}
    out = program_eval(tmp_path, "--summary-json", "s.json", env=env)
    assert out.returncode == 1
    summary = orjson.loads((tmp_path / "s.json").read_bytes())
    assert summary["errors"] == 3
    (top,) = summary["top_errors"]
    assert "403" in top["message"] and "testdist: this eval refuses every call" in top["message"]
