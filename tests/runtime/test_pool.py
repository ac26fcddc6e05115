"""RuntimePool: reuse with reset, replacement of unhealthy runtimes, start
failures, bounded size, and an empty pool after aclose on every exit path."""

from __future__ import annotations

import functools
import sys

import pytest
import trio
import trio.testing

from lowwater.rollout import classify
from lowwater.runtime import (
    PoolClosed,
    RuntimeConfig,
    RuntimePool,
    RuntimeStartError,
    SubprocessRuntime,
)

from ._procs import live_children

PY = sys.executable
CFG = RuntimeConfig(persistent=True)
HANG_S = 60


class Tracking(SubprocessRuntime):
    """A subprocess runtime that records its instances and can be made unhealthy or failing."""

    instances: list[Tracking] = []
    fail_start = False
    fail_reset = False

    def __init__(self, config):
        super().__init__(config)
        self.sick = False
        Tracking.instances.append(self)

    async def start(self):
        if Tracking.fail_start:
            raise OSError("disk full")
        await super().start()

    async def reset(self):
        if Tracking.fail_reset:
            raise OSError("reset failed")
        await super().reset()

    async def healthy(self):
        return not self.sick and await super().healthy()


@pytest.fixture(autouse=True)
def _fresh_tracking():
    Tracking.instances = []
    Tracking.fail_start = False
    Tracking.fail_reset = False
    yield


def assert_empty(pool: RuntimePool) -> None:
    stats = pool.stats()
    assert stats["idle"] == 0 and stats["in_use"] == 0, stats
    assert live_children() == []
    for rt in Tracking.instances:
        assert rt._root is None or not rt._root.exists(), "a runtime directory outlived aclose"


TRACKED = {"subprocess": Tracking}


def run_in_pool(fn, factories=TRACKED) -> None:
    """``trio.run`` ``await fn(pool)`` inside ``async with RuntimePool(factories)``
    (``None``: the built-in runtimes), then check the closed pool left nothing."""

    async def main():
        async with RuntimePool(factories) as pool:
            await fn(pool)
        assert_empty(pool)

    trio.run(main)


def test_release_resets_and_the_next_acquire_reuses_it(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os\ndef main(argv):\n    return str(os.getpid())\n")

    async def main():
        pool = RuntimePool({"subprocess": Tracking})
        rt = await pool.acquire(CFG)
        (rt.workdir / "left-over").write_text("x")
        pid = await rt.run_script(script, [], warm=True)
        assert pool.stats() == {"idle": 0, "in_use": 1, "created": 1, "replaced": 0, "stopped": 0, "start_failures": 0}
        await pool.release(rt)
        assert (pool.idle, pool.in_use) == (1, 0)
        async with pool.acquire(RuntimeConfig(persistent=True)) as again:
            assert again is rt and list(rt.workdir.iterdir()) == []
            assert await rt.run_script(script, [], warm=True) == pid  # the warm worker survived reset
        assert pool.stats()["created"] == 1
        await pool.aclose()
        assert_empty(pool)
        assert pool.stats()["stopped"] == 1

    trio.run(main)


def test_different_configs_get_different_runtimes():
    async def body(pool):
        a = await pool.acquire(CFG)
        await pool.release(a)
        b = await pool.acquire(RuntimeConfig(persistent=True, env={"X": "1"}))
        assert b is not a
        await pool.release(b)
        assert pool.idle == 2

    run_in_pool(body)


def _fail_health_check(rt):
    rt.sick = True


def _fail_reset(rt):
    Tracking.fail_reset = True


def _delete_workdir(rt):
    rt.workdir.rmdir()  # the built-in runtime's health check finds it gone


@pytest.mark.parametrize(
    ("breaks", "factories"),
    [(_fail_health_check, TRACKED), (_fail_reset, TRACKED), (_delete_workdir, None)],
    ids=["health-check", "reset", "deleted-workdir"],
)
def test_a_runtime_broken_while_held_is_replaced_at_release(breaks, factories):
    async def body(pool):
        rt = await pool.acquire(CFG)
        breaks(rt)
        await pool.release(rt)
        assert pool.stats()["replaced"] == 1 and pool.idle == 0 and rt._stopped
        again = await pool.acquire(CFG)
        assert again is not rt
        await pool.release(again)

    run_in_pool(body, factories)


def test_a_runtime_unhealthy_while_idle_is_replaced_at_acquire():
    async def body(pool):
        first = await pool.acquire(CFG)
        await pool.release(first)
        first.sick = True
        second = await pool.acquire(CFG)  # found out at acquire, replaced, not handed out
        assert second is not first and first._stopped
        assert pool.stats()["replaced"] == 1 and pool.stats()["created"] == 2
        await pool.release(second)

    run_in_pool(body)


def test_provisioning_failures_raise_runtime_start_error():
    def broken_factory(config):
        raise ValueError("bad image")

    async def main():
        pool = RuntimePool({"subprocess": Tracking, "broken": broken_factory}, max_size=1)
        Tracking.fail_start = True
        with pytest.raises(RuntimeStartError, match="failed to start") as err:
            await pool.acquire(CFG)
        assert isinstance(err.value.__cause__, OSError)
        assert classify(err.value).cls == "infra"
        assert Tracking.instances[0]._stopped  # a half-started runtime is stopped
        with pytest.raises(RuntimeStartError, match="factory failed"):
            await pool.acquire(RuntimeConfig(kind="broken"))
        with pytest.raises(RuntimeStartError, match="no runtime named 'nope'"):
            async with pool.acquire(RuntimeConfig(kind="nope")):
                pass
        assert pool.stats()["start_failures"] == 3
        # The size limit was given back each time: this does not wait.
        Tracking.fail_start = False
        with trio.fail_after(HANG_S):
            async with pool.acquire(CFG) as rt:
                assert (await rt.run([PY, "-c", "print(1)"])).stdout == b"1\n"
        await pool.aclose()
        assert_empty(pool)

    trio.run(main)


def test_aclose_after_an_error_inside_acquire():
    async def main():
        pool = RuntimePool({"subprocess": Tracking})
        with pytest.raises(KeyError):
            async with pool.acquire(CFG) as rt:
                await rt.run([PY, "-c", "pass"])
                raise KeyError("rollout bug")
        assert (pool.idle, pool.in_use) == (1, 0)
        await pool.aclose()
        assert_empty(pool)

    trio.run(main)


def test_aclose_after_cancellation_of_holders_mid_run():
    async def holder(pool, started):
        async with pool.acquire(CFG) as rt:
            started.append(rt)
            await rt.run([PY, "-c", "import time; time.sleep(60)"])

    async def main():
        pool = RuntimePool({"subprocess": Tracking})
        started: list = []
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(holder, pool, started)
            with trio.fail_after(HANG_S):
                while len(started) < 4 or len(live_children(4, settle_s=0)) < 4:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert pool.in_use == 0 and pool.idle == 4  # released (reset) under cancellation
        await pool.aclose()
        assert_empty(pool)

    trio.run(main)


def test_aclose_while_runtimes_are_held():
    async def main():
        pool = RuntimePool({"subprocess": Tracking}, max_size=2)
        a = await pool.acquire(CFG)
        b = await pool.acquire(CFG)
        await pool.release(b)
        await pool.aclose()
        assert_empty(pool)
        assert a._stopped and b._stopped
        await pool.release(a)  # a late release is fine and stops nothing more
        with pytest.raises(PoolClosed):
            await pool.acquire(CFG)
        assert isinstance(PoolClosed("x"), RuntimeStartError)
        await pool.aclose()  # idempotent
        assert_empty(pool)

    trio.run(main)


@pytest.mark.parametrize(
    "options",
    # demand: the waiter would get a second runtime only after HANG_S of waiting.
    [{"max_size": 1}, {"max_size": 4, "grow": "demand", "first_grow_after_s": HANG_S}],
    ids=["eager", "demand"],
)
def test_acquire_waiting_for_a_slot_when_the_pool_closes(options):
    async def main():
        pool = RuntimePool({"subprocess": Tracking}, **options)
        held = await pool.acquire(CFG)
        outcome = []

        async def waiter():
            try:
                await pool.acquire(CFG)
            except PoolClosed:
                outcome.append("closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            await pool.aclose()
            await pool.release(held)
        assert outcome == ["closed"] and pool.stats()["created"] == 1
        assert_empty(pool)

    trio.run(main)


def test_max_size_bounds_runtimes_in_use():
    async def main():
        pool = RuntimePool({"subprocess": Tracking}, max_size=2)
        peak = 0

        async def user(i):
            nonlocal peak
            async with pool.acquire(CFG) as rt:
                peak = max(peak, pool.in_use)
                await rt.run([PY, "-c", f"print({i})"])

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(user, i)
        assert peak == 2 and pool.stats()["created"] == 2 and pool.idle == 2
        await pool.aclose()
        assert_empty(pool)

    trio.run(main)


def test_max_idle_stops_extra_runtimes():
    async def main():
        pool = RuntimePool({"subprocess": Tracking}, max_idle=1)
        a, b = await pool.acquire(CFG), await pool.acquire(CFG)
        await pool.release(a)
        await pool.release(b)
        assert pool.idle == 1 and b._stopped and pool.stats()["replaced"] == 0
        await pool.aclose()
        assert_empty(pool)

    trio.run(main)


def test_release_of_a_foreign_runtime_is_refused():
    async def main():
        async with RuntimePool() as pool:
            rt = await pool.acquire(CFG)
            await pool.release(rt)
            with pytest.raises(ValueError):
                await pool.release(rt)
            async with SubprocessRuntime() as other:
                with pytest.raises(ValueError):
                    await pool.release(other)

    trio.run(main)


def test_a_single_factory_serves_every_config():
    async def body(pool):
        async with pool.acquire(RuntimeConfig(kind="anything")) as rt:
            assert isinstance(rt, Tracking)

    run_in_pool(body, functools.partial(Tracking))


def test_cancelled_during_start_leaves_nothing():
    class SlowStart(Tracking):
        async def start(self):
            await super().start()
            await trio.sleep_forever()

    async def main():
        pool = RuntimePool({"subprocess": SlowStart}, max_size=1)
        with trio.move_on_after(0.2):
            await pool.acquire(CFG)
        assert SlowStart.instances and SlowStart.instances[0]._stopped
        assert pool.stats()["start_failures"] == 0 and pool.in_use == 0
        SlowStart.start = Tracking.start  # type: ignore[method-assign]
        with trio.fail_after(HANG_S):
            async with pool.acquire(CFG):
                pass
        await pool.aclose()
        assert_empty(pool)

    trio.run(main)
