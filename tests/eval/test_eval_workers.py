"""``lowwater eval --workers N``: rollouts in env worker processes that
recycle, and a worker killed mid-eval still leaves exactly one row per task."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter

import psutil
import trio

from lowwater.eval import EvalConfig, run_eval

from ._cli import rows_of, start_eval


def test_workers_recycle_by_count_and_write_one_row_per_task(tmp_path):
    config = EvalConfig(rollouts=24, concurrency=4, workers=2, max_tasks_per_worker=5, out=tmp_path / "r.jsonl")
    report = trio.run(run_eval, config)
    assert report.summary["rollouts"] == 24 and report.summary["completed"] == 24
    assert report.summary["accuracy"] == 1.0
    pool = report.pool
    assert pool is not None and pool["tasks"] == 24
    # 24 tasks at most 5 per worker (jittered down): at least 5 workers, one
    # extra at a time at most.
    assert pool["workers_started"] >= 5 and pool["recycled_by_count"] >= 3
    assert pool["max_workers_alive"] <= 3
    rows = rows_of(config.out)
    assert sorted(r["task_id"] for r in rows) == list(range(24))
    assert all(r["error"] is None and r["turns"] >= 3 for r in rows)


def test_groups_in_workers(tmp_path):
    config = EvalConfig(rollouts=4, group_size=3, concurrency=6, workers=2, out=tmp_path / "g.jsonl")
    report = trio.run(run_eval, config)
    assert report.summary["rollouts"] == 12 and report.summary["errors"] == 0
    counts = Counter(r["task_id"] for r in rows_of(config.out))
    assert counts == {0: 3, 1: 3, 2: 3, 3: 3}


def _workers_of(parent: psutil.Process) -> list[psutil.Process]:
    """The eval's worker processes: the children of its forkserver."""
    workers = []
    for child in parent.children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                workers += child.children()
        except psutil.NoSuchProcess:
            pass
    return workers


def test_sigkill_of_a_worker_mid_eval_leaves_one_row_per_task(tmp_path):
    out = tmp_path / "k.jsonl"
    n = 160
    proc = start_eval(
        "-n", str(n), "--env-option", f"size={n}", "-c", "16", "--workers", "2", out=out, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        parent = psutil.Process(proc.pid)
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            written = out.read_bytes().count(b"\n") if out.exists() else 0
            workers = _workers_of(parent)
            if written >= 20 and workers:
                killed = workers[0].pid
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        assert killed is not None, "no worker to kill before the eval ended"
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    rows = rows_of(out)
    counts = Counter(r["task_id"] for r in rows)
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}
    assert all(r["error"] is None for r in rows)
    # The killed worker had rollouts in flight: they were re-run from their ids.
    retried = [r for r in rows if r.get("retried")]
    assert retried and all(r["attempts"] == 2 for r in retried)
    assert "worker crashes / tasks re-run" in stdout
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
