"""Worker backends: the registry hook, the built-in local backend, task
streams that stay open across runs of ids, attempts carried by the stream,
and pins that keep a retiring worker until its step is cleared.

Counts and orderings only; no wall-clock assertions.
"""

from __future__ import annotations

import pytest
import trio

from lowwater import plugins as plugins_mod
from lowwater.hookspecs import hookimpl
from lowwater.plugins import PluginError, UnknownName
from lowwater.workers import JobSpec, PoolConfig, PoolReport, TaskInfo, WorkerPool
from lowwater.workers.backend import BackendOptions, LocalBackend, WorkerBackend, open_backend
from lowwater.workers.stream import TaskAttempt, TaskStream

from . import jobs

SPEC = JobSpec(jobs.FACTORY)
FAST = dict(heartbeat_s=0.1, heartbeat_timeout_s=5.0, start_timeout_s=30.0, exit_timeout_s=5.0, trim_interval_s=0.05)


class Recording(WorkerBackend):
    """A backend that runs tasks in this process, recording what it was given."""

    name = "recording"
    made: list[Recording] = []

    def __init__(self, options: BackendOptions | None = None) -> None:
        super().__init__(options)
        self.ran: list = []
        Recording.made.append(self)

    def pool(self, spec, config, *, on_event=None, pin_by=None):
        backend = self

        class Pool:
            async def run(self, task_ids, on_rows):
                report = PoolReport()
                for task_id in task_ids:
                    backend.ran.append(task_id)
                    await on_rows([{"task_id": task_id}], TaskInfo(task_id, 1, False, None, -1, "ok"))
                    report.tasks += 1
                return report

            def stats(self):
                return {"workers": {}, "pool": {}}

            def unpin(self, key):
                return 0

        return Pool()


class RecordingPlugin:
    @hookimpl
    def register_backends(self, register):
        register("recording", Recording)


def test_local_backend_is_built_in_and_lookup_names_the_installed_ones():
    plugins = plugins_mod.load()
    assert plugins.backends["local"] is LocalBackend
    with pytest.raises(UnknownName, match=r"unknown backend 'nope' \(installed: .*local"):
        open_backend(plugins, "nope")


def test_register_backends_adds_a_backend_and_a_duplicate_name_is_refused():
    plugins = plugins_mod.load(extra=[("recording", RecordingPlugin())])
    backend = open_backend(plugins, "recording", BackendOptions(address="somewhere:1"))
    assert isinstance(backend, Recording) and backend.options.address == "somewhere:1"

    class Again:
        @hookimpl
        def register_backends(self, register):
            register("local", LocalBackend)

    with pytest.raises(PluginError, match="backend 'local' registered by both"):
        plugins_mod.load(extra=[("again", Again())])


def test_eval_runs_its_workers_on_the_named_backend(tmp_path):
    from lowwater.eval import EvalConfig, run_eval

    Recording.made.clear()
    plugins = plugins_mod.load(extra=[("recording", RecordingPlugin())])
    config = EvalConfig(rollouts=5, workers=1, backend="recording", address="x:1", out=tmp_path / "r.jsonl")
    report = trio.run(lambda: run_eval(config, plugins=plugins))
    (backend,) = Recording.made
    assert backend.options.address == "x:1" and len(backend.ran) == 5
    assert report.summary["rollouts"] == 5


def test_a_backend_other_than_local_needs_workers():
    from lowwater.eval import EvalConfig

    with pytest.raises(ValueError, match="--backend ray runs env workers: give --workers K"):
        EvalConfig(backend="ray")


def test_local_backend_pool_is_a_worker_pool():
    pool = LocalBackend().pool(SPEC, PoolConfig(workers=1, **FAST))
    assert isinstance(pool, WorkerPool)


def test_a_stream_keeps_workers_between_ids_and_carries_attempts():
    """Ids submitted over time run on the same workers; a TaskAttempt runs at its attempt."""
    stream = TaskStream()
    got: list = []
    started: list = []

    async def main():
        pool = WorkerPool(SPEC, workers=1, **FAST, on_event=lambda n, f: n == "started" and started.append(f))

        async def on_rows(rows, info):
            got.append((info.task_id, info.attempt, info.pid))

        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def run():
                await pool.run(stream, on_rows)
                done.set()

            nursery.start_soon(run)
            stream.submit(["ok:1", "ok:2"])
            while len(got) < 2:
                await trio.sleep(0.01)
            await trio.sleep(0.3)  # idle: the pool waits for more ids, workers stay
            stream.submit([TaskAttempt("ok:3", 2)])
            while len(got) < 3:
                await trio.sleep(0.01)
            stream.close()
            await done.wait()

    trio.run(main)
    assert sorted(g[:2] for g in got) == [("ok:1", 1), ("ok:2", 1), ("ok:3", 2)]
    assert len({g[2] for g in got}) == 1 and len(started) == 1  # one worker served all three


def test_an_empty_stream_starts_no_worker():
    stream = TaskStream()
    stream.close()
    events: list = []

    async def main():
        pool = WorkerPool(SPEC, workers=1, **FAST, on_event=lambda n, f: events.append(n))
        return await pool.run(stream, lambda rows, info: None)

    report = trio.run(main)
    assert report.tasks == 0 and "started" not in events


def test_a_retiring_worker_waits_for_its_pins():
    """A worker due to retire (max_tasks_per_worker=1) that produced data of
    step "s0" exits only after unpin("s0"); its replacement serves meanwhile."""
    stream = TaskStream()
    events: list = []

    async def main():
        pool = WorkerPool(
            SPEC,
            workers=1,
            max_tasks_per_worker=1,
            jitter=0.0,
            **FAST,
            on_event=lambda n, f: events.append((n, f.get("wid"))),
            pin_by=lambda task_id: str(task_id).split("|")[0],
        )
        rows: list = []

        async def on_rows(r, info):
            rows.append(info.worker)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.run, stream, on_rows)
            stream.submit(["s0|ok"])
            while not rows:
                await trio.sleep(0.01)
            # The retiree (wid 0) waits: its replacement becomes ready, yet no exit is sent.
            while ("ready", 1) not in events:
                await trio.sleep(0.01)
            await trio.sleep(0.3)
            assert ("exit_sent", 0) not in events
            assert pool.stats()["workers"][0]["pinned"] == ["s0"]
            assert pool.unpin("s0") == 1
            while ("exit_sent", 0) not in events:
                await trio.sleep(0.01)
            stream.submit(["s1|ok"])
            while len(rows) < 2:
                await trio.sleep(0.01)
            stream.close()

        assert rows == [0, 1]

    trio.run(main)
