"""``lowwater eval --backend ray`` from the command line: with no
``--address`` it starts a local Ray cluster and stops it (every process it
started is gone after); ``lowwater plugins`` lists the backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.ray


def test_lowwater_plugins_lists_the_ray_backend_and_transport():
    out = subprocess.run(
        [sys.executable, "-m", "lowwater", "plugins", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    assert "ray" in data["backends"] and "ray" in data["shard_transports"]
    assert any(p["name"] == "ray" and p["dist"] == "lowwater-ray" for p in data["plugins"])


def test_eval_backend_ray_on_a_local_cluster_stops_every_process_it_started(tmp_path):
    env = {**os.environ, "LOWWATER_ADMIN_KEY": "cli-test", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "r.jsonl"
    summary = tmp_path / "s.json"
    cmd = [
        sys.executable,
        "-m",
        "lowwater",
        "eval",
        "--backend",
        "ray",
        "--workers",
        "1",
        "--bind",
        "0.0.0.0",
        "-n",
        "16",
        "-c",
        "8",
        "--out",
        str(out),
        "--summary-json",
        str(summary),
        "--no-progress",
        "--no-samples",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            seen |= {p.pid for p in root.children(recursive=True)}
        except psutil.Error:
            pass
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(summary.read_text())["rollouts"] == 16
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["task_id"] for r in rows if "rollout_id" in r) == list(range(16))
    assert len(seen) > 3  # it did start a cluster (gcs, raylet, workers, ...)
    deadline = time.monotonic() + 30
    while True:
        alive = {p: title for p in seen if (title := _running(p)) is not None}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for pid in alive:  # never left behind by this test, whatever the assertion says
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not alive, alive


def _running(pid: int) -> str | None:
    """The command line of ``pid`` if it runs (not a zombie), else ``None``."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return None
