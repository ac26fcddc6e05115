"""Leftovers reach the summary: per-rollout state a worker (or this process)
still holds after the run is counted in ``--summary-json`` and the summary
table, not only logged inside the worker (it used to be ``leftovers = {}``
for every pooled eval)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).parent / "plugins"


def run_eval(tmp_path: Path, *args: str, leak: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    if leak:
        env["LOWWATER_PLUGINS"] = "leaky_intercepts"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowwater",
            "eval",
            # Long enough for several of the heartbeat ticks (1 s) the plugin leaks on, even
            # at the in-process speed of the data plane (200 rollouts took under 1 s).
            "--env-option",
            "size=800",
            "-n",
            "800",
            "-c",
            "4",
            "--out",
            "r.jsonl",
            "--summary-json",
            "s.json",
            "--no-progress",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    summary["_stdout"] = out.stdout
    return summary


def test_pooled_eval_reports_what_its_workers_left(tmp_path):
    (tmp_path / "a").mkdir()
    clean = run_eval(tmp_path / "a", "--workers", "2", leak=False)
    assert clean["leftovers"] == {}
    leaky_dir = tmp_path / "b"
    leaky_dir.mkdir()
    leaky = run_eval(leaky_dir, "--workers", "2", leak=True)
    # Every worker ticked at least once while it ran, and each tick leaked one intercept.
    assert leaky["leftovers"].get("intercepts", 0) >= 2, leaky["leftovers"]
    assert "left alive after the run" in leaky["_stdout"] and "intercepts" in leaky["_stdout"]


def test_in_process_eval_reports_its_leftovers(tmp_path):
    summary = run_eval(tmp_path, leak=True)
    assert summary["leftovers"].get("intercepts", 0) >= 1, summary["leftovers"]


def test_a_bad_lowwater_plugins_name_is_one_line(tmp_path):
    env = {**os.environ, "LOWWATER_PLUGINS": "no_such_module_xyz"}
    out = subprocess.run(
        [sys.executable, "-m", "lowwater", "eval", "-n", "1", "--out", "r.jsonl", "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "LOWWATER_PLUGINS" in out.stderr and "no_such_module_xyz" in out.stderr
