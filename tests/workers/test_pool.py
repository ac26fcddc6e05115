"""WorkerPool end to end with real worker processes (toy jobs in jobs.py).

Deterministic counts and generous bounds only: no wall-clock assertions.
Thresholds are small and heartbeat timeouts short so the file stays fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import trio

from lowwater.workers import JobSpec, PoolConfigError, TaskInfo, WorkerPool, WorkerStartError

from . import jobs

SPEC = JobSpec(jobs.FACTORY)
FAST = dict(heartbeat_s=0.1, heartbeat_timeout_s=5.0, start_timeout_s=30.0, exit_timeout_s=5.0, trim_interval_s=0.05)


class Recorder:
    """Collects rows and events; checks the worker-count invariant as events arrive."""

    def __init__(self) -> None:
        self.rows: list[tuple[list[dict], TaskInfo]] = []
        self.events: list[tuple[str, dict]] = []
        self.pids: set[int] = set()

    async def on_rows(self, rows: list[dict], info: TaskInfo) -> None:
        self.rows.append((rows, info))

    def on_event(self, name: str, fields: dict) -> None:
        self.events.append((name, fields))
        if fields.get("pid"):
            self.pids.add(fields["pid"])

    def index(self, name: str, wid: int) -> int:
        return next(i for i, (n, f) in enumerate(self.events) if n == name and f.get("wid") == wid)

    def one_row_per_task(self, task_ids: list) -> None:
        got = Counter(info.task_id for _, info in self.rows)
        assert got == Counter(task_ids), got
        for rows, info in self.rows:
            assert len(rows) == 1 and rows[0]["task_id"] == info.task_id

    def max_alive(self) -> int:
        alive = peak = 0
        for name, _ in self.events:
            if name == "started":
                alive += 1
            elif name == "reaped":
                alive -= 1
            peak = max(peak, alive)
        assert alive == 0, "every started worker was reaped"
        return peak


def run_pool(task_ids, rec: Recorder, **kwargs):
    kwargs = {**FAST, **kwargs}
    pool = WorkerPool(SPEC, on_event=rec.on_event, **kwargs)
    return trio.run(pool.run, task_ids, rec.on_rows), pool


def assert_gone(pids, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes still alive: {alive}"
        time.sleep(0.1)


def test_recycles_by_count_with_replacement_ready_before_exit():
    rec = Recorder()
    tasks = [f"sleep:0.02:{i}" for i in range(16)]
    report, _ = run_pool(tasks, rec, workers=2, concurrency_per_worker=1, max_tasks_per_worker=3, jitter=0)
    rec.one_row_per_task(tasks)
    per_pid = Counter(info.pid for _, info in rec.rows)
    assert max(per_pid.values()) == 3 and len(per_pid) >= 6
    # A worker retires exactly when it has been given its quota.
    assert report.recycled_by_count == sum(1 for n in per_pid.values() if n == 3)
    assert report.recycled_by_rss == report.replaced_after_crash == report.retried_tasks == 0
    assert report.tasks == report.rows == 16
    # Replacement started and ready before the retiree is told to exit, which
    # precedes its exit; at most one extra worker at any time.
    # (At the end of the run a retiree may be stopped with everyone else.)
    pairs = [(f["replaces"], f["wid"]) for n, f in rec.events if n == "started" and f.get("replaces") is not None]
    handed_over = [(old, new) for old, new in pairs if rec.events[rec.index("exit_sent", old)][1]["why"] == "retired"]
    assert len(handed_over) >= 3
    for old, new in handed_over:
        assert rec.index("retiring", old) < rec.index("started", new)
        assert rec.index("ready", new) < rec.index("exit_sent", old) < rec.index("reaped", old)
    assert rec.max_alive() <= 3 and report.max_workers_alive <= 3
    assert_gone(rec.pids)


def test_recycles_by_current_rss():
    rec = Recorder()
    tasks = [f"leak:30:{i}" for i in range(8)]
    # A fresh worker is ~25 MiB; each task keeps 30 MiB more, so a worker
    # passes 100 MiB after two or three tasks and is recycled.
    report, _ = run_pool(
        tasks, rec, workers=1, concurrency_per_worker=1, max_tasks_per_worker=None, max_rss_mb=100, jitter=0
    )
    rec.one_row_per_task(tasks)
    per_pid = Counter(info.pid for _, info in rec.rows)
    assert max(per_pid.values()) <= 3
    assert report.recycled_by_rss >= 2 and report.recycled_by_count == 0
    retiring = [f for n, f in rec.events if n == "retiring"]
    assert all(f["reason"] == "rss" and f["rss"] > 100 * 2**20 for f in retiring)
    assert rec.max_alive() <= 2
    assert_gone(rec.pids)


def test_jitter_gives_workers_different_thresholds():
    rec = Recorder()
    tasks = [f"ok:{i}" for i in range(4)]
    run_pool(tasks, rec, workers=4, max_tasks_per_worker=500, max_rss_mb=1000, jitter=0.1, seed=7)
    started = [f for n, f in rec.events if n == "started"]
    assert len(started) == 4
    counts = [f["max_tasks"] for f in started]
    rss = [f["max_rss"] for f in started]
    assert all(450 <= c <= 500 for c in counts) and len(set(counts)) > 1
    assert all(900 * 2**20 <= r <= 1000 * 2**20 for r in rss) and len(set(rss)) == 4
    rec.one_row_per_task(tasks)


def test_worker_admission_holds_and_releases():
    rec = Recorder()
    snapshots = []

    async def main():
        pool = WorkerPool(
            SPEC,
            workers=1,
            concurrency_per_worker=2,
            max_tasks_per_worker=None,
            high_water_mb=120,
            low_water_mb=80,
            on_event=rec.on_event,
            **FAST,
        )

        async def on_rows(rows, info):
            snapshots.append(pool.stats())
            await rec.on_rows(rows, info)

        return await pool.run(tasks, on_rows)

    # The hold task keeps 200 MiB for 2 s; the sleep task beside it reports
    # the high RSS with its result, so the next tasks must wait until the
    # hold is freed.
    tasks = ["hold:200:2.0"] + [f"sleep:0.3:{i}" for i in range(5)]
    report = trio.run(main)
    rec.one_row_per_task(tasks)
    names = [n for n, _ in rec.events]
    held, released = names.index("worker_held"), names.index("worker_released")
    assert held < released
    assert "dispatch" not in names[held:released], "nothing is admitted to a held worker"
    assert report.admission_holds >= 1 and report.admission_wait_s > 0
    assert report.worker_rss_peak_mb > 200
    worker = next(iter(snapshots[-1]["workers"].values()))
    assert {"rss_mb", "in_flight", "lag_p50_ms", "lag_p99_ms", "job", "heartbeat_age_s"} <= set(worker)
    assert worker["lag_p99_ms"] >= worker["lag_p50_ms"] >= 0 and worker["job"]["runs"] >= 1
    assert_gone(rec.pids)


def test_pool_admission_against_the_memory_limit():
    rec = Recorder()
    parent = psutil.Process().memory_info().rss / 2**20
    # Low-water mark: parent + a fresh worker (< 60 MiB) + margin; a 300 MiB
    # hold takes the pool far above the high-water mark.
    limit = (parent + 60 + 60) / 0.75
    tasks = ["hold:300:2.0"] + [f"sleep:0.3:{i}" for i in range(4)]
    report, _ = run_pool(
        tasks, rec, workers=1, concurrency_per_worker=2, max_tasks_per_worker=None, memory_limit_mb=limit
    )
    rec.one_row_per_task(tasks)
    names = [n for n, _ in rec.events]
    held, released = names.index("pool_held"), names.index("pool_released")
    assert held < released and "dispatch" not in names[held:released]
    assert report.admission_wait_s > 0 and report.memory_limit_source == "argument"
    assert report.pool_rss_peak_mb > parent + 300


def test_sigkill_mid_run_reruns_in_flight_tasks():
    rec = Recorder()
    victim: dict = {}

    def on_event(name, fields):
        rec.on_event(name, fields)
        if name == "dispatch" and fields["task_id"] == "hang:60:2" and fields["attempt"] == 1:
            victim["pid"] = fields["pid"]

    async def main():
        pool = WorkerPool(SPEC, workers=2, concurrency_per_worker=2, on_event=on_event, **FAST)
        async with trio.open_nursery() as nursery:

            async def killer():
                with trio.fail_after(30):  # a worker that never starts fails here, not at pytest's 600 s
                    while "pid" not in victim:
                        await trio.sleep(0.01)
                os.kill(victim["pid"], signal.SIGKILL)

            nursery.start_soon(killer)
            return await pool.run(tasks, rec.on_rows)

    tasks = ["hang:60:2"] + [f"sleep:0.1:{i}" for i in range(9)]
    report = trio.run(main)
    rec.one_row_per_task(tasks)
    info = next(i for _, i in rec.rows if i.task_id == "hang:60:2")
    assert info.retried and info.attempt == 2 and info.pid != victim["pid"] and info.status == "ok"
    assert report.replaced_after_crash == 1 and report.retried_tasks >= 1 and report.failed_tasks == 0
    assert all(i.retried == (i.attempt > 1) for _, i in rec.rows)
    assert rec.max_alive() <= 3
    assert_gone(rec.pids)


def test_task_that_keeps_killing_its_worker_gets_one_infra_row():
    rec = Recorder()
    tasks = ["die:0", "raise", "ok:1"]
    report, _ = run_pool(tasks, rec, workers=1, concurrency_per_worker=1, max_task_attempts=3)
    rec.one_row_per_task(tasks)
    by_id = {info.task_id: (rows[0], info) for rows, info in rec.rows}
    row, info = by_id["die:0"]
    assert info.status == "failed" and info.attempt == 3 and info.retried
    assert row["error"]["class"] == "infra" and row["error"]["message"].startswith("worker died")
    row, info = by_id["raise"]
    assert info.status == "error" and "ValueError: toy failure" in row["error"]["message"] and not info.retried
    assert by_id["ok:1"][1].status == "ok"
    assert report.replaced_after_crash == 3 and report.failed_tasks == 1 and report.retried_tasks == 2
    assert_gone(rec.pids)


def test_heartbeat_timeout_replaces_a_blocked_worker():
    rec = Recorder()
    tasks = ["block:30:2", "ok:1"]
    report, _ = run_pool(tasks, rec, workers=1, concurrency_per_worker=1, heartbeat_s=0.1, heartbeat_timeout_s=1.0)
    rec.one_row_per_task(tasks)
    info = next(i for _, i in rec.rows if i.task_id == "block:30:2")
    assert info.retried and info.attempt == 2
    assert report.replaced_after_heartbeat_timeout == 1 and report.replaced_after_crash == 0
    killed = [f for n, f in rec.events if n == "killed"]
    assert len(killed) == 1 and killed[0]["reason"] == "heartbeat"
    assert_gone(rec.pids)


def test_allocator_settings_reach_the_worker_and_its_children():
    rec = Recorder()
    tasks = ["env:MALLOC_ARENA_MAX", "env:MALLOC_TRIM_THRESHOLD_", "arenas:8"]
    run_pool(tasks, rec, workers=1, malloc_arena_max=2, malloc_trim_threshold=131072)
    rec.one_row_per_task(tasks)
    by_id = {info.task_id: rows[0] for rows, info in rec.rows}
    assert by_id["env:MALLOC_ARENA_MAX"]["value"] == "2"
    assert by_id["env:MALLOC_TRIM_THRESHOLD_"]["value"] == "131072"
    ready = next(f for n, f in rec.events if n == "ready")
    assert ready["allocator"]["env"] == {"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "131072"}
    from lowwater.workers.allocator import mallopt_available

    if mallopt_available():
        assert ready["allocator"]["mallopt"] == {"M_ARENA_MAX": 1, "M_TRIM_THRESHOLD": 1}
        assert by_id["arenas:8"]["arenas"] <= 2


def test_env_var_alone_does_not_limit_a_forked_worker():
    """The subtlety in allocator.py: a forkserver child's malloc is already
    initialised, so MALLOC_ARENA_MAX set in its environment is ignored by
    the child itself; only mallopt limits it."""
    from lowwater.workers.allocator import mallopt_available

    if not mallopt_available():
        pytest.skip("glibc malloc only")
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        pytest.skip("the forkserver itself was started with an arena limit")
    rec = Recorder()
    run_pool(["arenas:8:1"], rec, workers=1, allocator_hygiene=False)
    assert rec.rows[0][0][0]["arenas"] > 2


def test_worker_does_not_import_the_parents_main_module():
    # The forkserver is one per process and the first pool decides its
    # preload list (an earlier test's eval pool preloads lowwater.eval.job,
    # and with it httpx): restart it so this test sees the lean default.
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # test-only private API (CPython's own tests use it)
    rec = Recorder()
    run_pool(["modules"], rec, workers=1)
    row = rec.rows[0][0][0]
    assert row["modules"] == [], row  # no pytest, httpx or numpy
    assert row["main"] is None  # __main__ is the forkserver's "-c" stub, not pytest's
    assert "pytest" in sys.modules  # ...which the parent has


def test_cancellation_delivers_rows_of_cancelled_tasks_and_stops_workers():
    rec = Recorder()
    tasks = ["cancel-aware:60", "sleep:60:1", "sleep:60:2"]

    async def main():
        pool = WorkerPool(SPEC, workers=1, concurrency_per_worker=4, on_event=rec.on_event, **FAST)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_dispatched():
                    with trio.fail_after(30):  # dispatches that never come fail here, not at pytest's 600 s
                        while sum(n == "dispatch" for n, _ in rec.events) < 3:
                            await trio.sleep(0.01)
                    scope.cancel()

                nursery.start_soon(cancel_when_dispatched)
                await pool.run(tasks, rec.on_rows)
        assert scope.cancelled_caught

    trio.run(main)
    rec.one_row_per_task(tasks)
    by_id = {info.task_id: (rows[0], info) for rows, info in rec.rows}
    assert all(info.status == "cancelled" for _, info in by_id.values())
    assert by_id["cancel-aware:60"][0]["error"]["message"] == "job's own cancelled row"
    assert by_id["sleep:60:1"][0]["error"]["class"] == "cancelled"
    assert rec.max_alive() == 1
    assert_gone(rec.pids)


def test_setup_failure_raises_worker_start_error():
    rec = Recorder()
    pool = WorkerPool(
        JobSpec(jobs.FACTORY, {"fail_setup": True}), workers=1, max_start_failures=2, on_event=rec.on_event, **FAST
    )
    with pytest.raises(WorkerStartError, match="setup refused"):
        trio.run(pool.run, ["ok:1"], rec.on_rows)
    assert rec.rows == []
    assert rec.max_alive() <= 2
    assert_gone(rec.pids)


def test_on_rows_error_propagates_unwrapped_and_stops_workers():
    rec = Recorder()

    async def on_rows(rows, info):
        raise KeyError("writer broke")

    pool = WorkerPool(SPEC, workers=2, on_event=rec.on_event, **FAST)
    with pytest.raises(KeyError, match="writer broke"):
        trio.run(pool.run, [f"ok:{i}" for i in range(5)], on_rows)
    rec.max_alive()
    assert_gone(rec.pids)


def test_fresh_worker_above_max_rss_is_a_config_error():
    pool = WorkerPool(SPEC, workers=1, max_rss_mb=1, **FAST)
    with pytest.raises(PoolConfigError, match="max_rss_mb"):
        trio.run(pool.run, ["ok:1"], Recorder().on_rows)


def test_empty_iterable_starts_no_worker():
    rec = Recorder()
    report, _ = run_pool([], rec, workers=3)
    assert report.workers_started == 0 and rec.events == []


def test_parent_death_leaves_no_orphans():
    script = Path(__file__).with_name("orphan_parent.py")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the parent script printed nothing"
        info = json.loads(line)
        pids = info["workers"] + [info["forkserver"]]
        assert len(info["workers"]) == 2 and all(psutil.pid_exists(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # One worker's loop is blocked in time.sleep: its lifeline thread
        # kills it after orphan_grace_s (1 s in the script).
        assert_gone(pids, timeout_s=20.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_cancels_delivers_rows_and_raises_keyboard_interrupt():
    rec = Recorder()
    tasks = ["sleep:60:1", "sleep:60:2", "sleep:60:3"]

    def on_event(name, fields):
        rec.on_event(name, fields)
        if name == "dispatch" and sum(n == "dispatch" for n, _ in rec.events) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, raised by Trio in the task awaiting run()

    pool = WorkerPool(SPEC, workers=1, concurrency_per_worker=4, on_event=on_event, **FAST)
    with pytest.raises(KeyboardInterrupt):
        trio.run(pool.run, tasks, rec.on_rows)
    rec.one_row_per_task(tasks)
    assert all(info.status == "cancelled" for _, info in rec.rows)
    assert rec.max_alive() == 1
    assert_gone(rec.pids)


def test_a_blocked_parent_does_not_time_its_workers_out():
    rec = Recorder()

    async def on_rows(rows, info):
        await rec.on_rows(rows, info)
        if len(rec.rows) == 1:
            time.sleep(1.5)  # the parent's loop is blocked past heartbeat_timeout_s

    tasks = ["ok:1", "sleep:0.2:2", "ok:3"]
    pool = WorkerPool(
        SPEC,
        workers=1,
        concurrency_per_worker=1,
        on_event=rec.on_event,
        **{**FAST, "heartbeat_s": 0.1, "heartbeat_timeout_s": 1.0},
    )
    report = trio.run(pool.run, tasks, on_rows)
    rec.one_row_per_task(tasks)
    assert report.replaced_after_heartbeat_timeout == 0 and report.workers_started == 1


def test_workers_report_their_leftovers_to_the_parent():
    # Two workers, one leaking task each on its own worker: each worker sends
    # what it left alive as it exits, and the parent's report sums them.
    rec = Recorder()
    report, _ = run_pool(["leak:1", "ok:1", "leak:1", "ok:2"], rec, workers=1, max_tasks_per_worker=2)
    assert report.leftovers == {"leaked_buffers": 2}
    rec = Recorder()
    report, _ = run_pool(["ok:1", "ok:2"], rec, workers=1)
    assert report.leftovers == {}
