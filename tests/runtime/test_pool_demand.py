"""RuntimePool(grow="demand"): one runtime while releases keep up, one more
only while acquires wait longer than the recent hold time, idle extras
retired.  Fake runtimes on a fake clock.  That closing wakes the waiters is
in test_pool.py (for both modes)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from lowwater.runtime import RuntimeConfig, RuntimePool

CFG = RuntimeConfig(persistent=True)


class Fake:
    """A runtime that takes ``start_s`` to start (a warm worker's imports)."""

    start_s = 0.0
    made: list[Fake] = []

    def __init__(self, config):
        self.config = config
        self.stopped = False
        Fake.made.append(self)

    async def start(self):
        await trio.sleep(Fake.start_s)

    async def reset(self):
        pass

    async def healthy(self):
        return not self.stopped

    async def stop(self):
        self.stopped = True


@pytest.fixture(autouse=True)
def _fresh():
    Fake.made, Fake.start_s = [], 0.0


def run(fn):
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def concurrent_holds(pool: RuntimePool, n: int, hold_s: float) -> None:
    """``n`` tasks at once, each holding a runtime of ``pool`` for ``hold_s`` (fake) seconds."""

    async def hold():
        async with pool.acquire(CFG):
            await trio.sleep(hold_s)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(hold)


def test_short_holds_share_one_runtime_even_with_a_slow_first_start():
    Fake.start_s = 3.0  # the first use imports the verifier: no herd of starts meanwhile

    async def main():
        async with RuntimePool(Fake, max_size=4, grow="demand") as pool:
            await concurrent_holds(pool, 200, 0.001)  # scores
            assert pool.created == 1

    run(main)


def test_long_holds_grow_the_pool_up_to_max_size():
    async def main():
        async with RuntimePool(Fake, max_size=4, grow="demand", first_grow_after_s=0.5) as pool:
            # Agents: a program harness holds its runtime for the rollout.
            await concurrent_holds(pool, 16, 2.0)
            assert pool.created == 4  # waiting became dearer than starting, up to the bound
            eager = RuntimePool(Fake, max_size=4)
            assert eager.grow == "eager"

    run(main)


def test_idle_extras_are_retired():
    async def main():
        async with RuntimePool(Fake, max_size=4, grow="demand", first_grow_after_s=0.1, idle_retire_s=5) as pool:
            held = [await pool.acquire(CFG) for _ in range(1)]
            async with trio.open_nursery() as nursery:

                async def more():
                    held.append(await pool.acquire(CFG))

                nursery.start_soon(more)
            assert pool.created == 2
            for runtime in held:
                await pool.release(runtime)
            assert pool.idle == 2
            await trio.sleep(10)
            rt = await pool.acquire(CFG)
            await pool.release(rt)  # the release retires the idle one past 5 s
            assert pool.idle == 1 and sum(f.stopped for f in Fake.made) == 1

    run(main)


def test_bad_grow_is_refused():
    with pytest.raises(ValueError, match="grow"):
        RuntimePool(Fake, grow="lazy")


def test_a_long_queue_grows_the_pool_without_waiting_out_the_patience():
    async def main():
        async with RuntimePool(Fake, max_size=4, grow="demand", first_grow_after_s=1000) as pool:
            started = trio.current_time()
            await concurrent_holds(pool, 32, 2.0)
            # Once two holds of 2 s are known, 30 waiters on one runtime predict a
            # minute's wait: it grows to four at once, not after 1000 s of patience.
            assert pool.created == 4
            assert trio.current_time() - started < 32 * 2.0 / 2

    run(main)
