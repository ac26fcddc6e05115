"""Rollout and group lifecycle: every exit path leaves the registry, the
intercept table and the runtime bookkeeping empty."""

from __future__ import annotations

import pytest
import trio

from lowwater.hookspecs import hookimpl
from lowwater.plugins import Plugins, load
from lowwater.rollout import Deadlines, Engine, RetryPolicy, RolloutError, RolloutFailed, classify

from .fakes import FakeInterceptor, ScriptedEnv


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    @hookimpl
    async def rollout_start(self, rollout):
        self.events.append(("start", rollout.rollout_id))

    @hookimpl
    async def rollout_end(self, rollout):
        self.events.append(("end", rollout.rollout_id))

    @hookimpl
    async def group_end(self, group):
        # Members' trajectories are still readable here, after their own cleanup.
        self.events.append(("group_end", str(len(group.trajectories()))))


def make_engine(prompts, *, deadlines=Deadlines(), retry=RetryPolicy(), plugins=None):
    recorder = Recorder()
    plugins = plugins or load(disabled=(), extra=[("recorder", recorder)])
    interceptor = FakeInterceptor()
    env = ScriptedEnv(prompts, interceptor.table)
    engine = Engine(env, interceptor, plugins, http=None, deadlines=deadlines, retry=retry)
    return engine, env, interceptor, recorder


def assert_empty(engine, interceptor):
    assert len(engine.registry) == 0, engine.registry.stats()
    assert engine.registry.stats() == {"trajectories": 0, "groups": 0, "turns": 0}
    assert len(interceptor.table) == 0
    assert interceptor.table.stats()["open_rollouts"] == 0
    assert interceptor.slots == {}
    assert engine.runtimes == {} and engine.in_flight == 0


def run_one(engine, env, **kw):
    rows = []

    async def on_result(rollout):
        # The trajectory is still readable when the row is written.
        rows.append((rollout.result(), rollout.trajectory is not None))

    async def main():
        task = next(env.tasks())
        return await engine.run_rollout(task, on_result=on_result, **kw)

    return trio.run(main), rows


def test_success_records_turns_scores_and_evicts():
    engine, env, interceptor, recorder = make_engine(["ok"])
    rollout, rows = run_one(engine, env)
    assert rollout.error is None and rollout.reward == 1.0 and rollout.turn_count == 1
    ((row, had_trajectory),) = rows
    assert had_trajectory and row["reward"] == 1.0 and row["error"] is None and row["turns"] == 1
    assert set(row["timing"]) >= {"setup_s", "agent_s", "scoring_s", "cleanup_s", "total_s"}
    assert recorder.events == [("start", rollout.rollout_id), ("end", rollout.rollout_id)]
    assert rollout.trajectory is None
    assert_empty(engine, interceptor)


def test_environment_error_is_data_and_not_retried():
    engine, env, interceptor, _ = make_engine(["raise"])
    rollout, rows = run_one(engine, env)
    assert rollout.error == RolloutError("environment", "KeyError: 'environment bug'")
    assert rollout.attempt == 1 and rollout.reward is None
    assert rows[0][0]["error"] == {"class": "environment", "message": "KeyError: 'environment bug'"}
    # The harness left an intercept in flight: unregister swept it.
    assert interceptor.table.stats()["swept"] == 1
    assert_empty(engine, interceptor)


def test_model_error_retries_then_records():
    engine, env, interceptor, _ = make_engine(["model-error"], retry=RetryPolicy(model=2))
    rollout, rows = run_one(engine, env)
    assert rollout.error.cls == "model" and rollout.attempt == 3 and len(rows) == 1
    assert interceptor.table.stats()["swept"] == 3
    assert_empty(engine, interceptor)


def test_transient_error_succeeds_on_retry():
    engine, env, interceptor, _ = make_engine(["flaky"])
    rollout, rows = run_one(engine, env)
    assert rollout.error is None and rollout.attempt == 2 and rows[0][0]["attempt"] == 2
    assert_empty(engine, interceptor)


def test_failed_turn_is_a_model_error_not_a_success():
    engine, env, interceptor, _ = make_engine(["turn-error"], retry=RetryPolicy(model=0))
    rollout, _ = run_one(engine, env)
    assert rollout.error.cls == "model" and "stream cut" in rollout.error.message
    assert rollout.reward is None
    assert_empty(engine, interceptor)


def test_whole_rollout_deadline():
    engine, env, interceptor, recorder = make_engine(["hang"], deadlines=Deadlines(rollout_s=0.2))
    rollout, rows = run_one(engine, env)
    assert rollout.error.cls == "timeout" and "deadline" in rollout.error.message
    assert rows[0][0]["error"]["class"] == "timeout"
    assert ("end", rollout.rollout_id) in recorder.events
    assert_empty(engine, interceptor)


def test_phase_deadline_on_scoring():
    engine, env, interceptor, _ = make_engine(["hang-score"], deadlines=Deadlines(scoring_s=0.1))
    rollout, _ = run_one(engine, env)
    assert rollout.error.cls == "timeout" and "TooSlowError" in rollout.error.message
    assert_empty(engine, interceptor)


def test_cancellation_writes_a_cancelled_row_and_cleans_up():
    engine, env, interceptor, recorder = make_engine(["hang"])
    rows = []

    async def on_result(rollout):
        rows.append(rollout.result())

    async def main():
        with trio.move_on_after(0.2):
            await engine.run_rollout(next(env.tasks()), on_result=on_result)
            pytest.fail("the rollout should have been cancelled")

    trio.run(main)
    assert rows[0]["error"] == {"class": "cancelled", "message": "rollout cancelled"}
    assert [e[0] for e in recorder.events] == ["start", "end"]
    assert_empty(engine, interceptor)


def test_group_reward_sees_every_trajectory_after_member_cleanup():
    engine, env, interceptor, recorder = make_engine(["ok"])
    env.group_rewards = [0.5, -0.5, 0.0]
    rows = []

    async def on_result(rollout):
        rows.append(rollout.result())

    async def main():
        return await engine.run_group(next(env.tasks()), 3, on_result=on_result)

    group = trio.run(main)
    # Members' slots were unregistered before the group reward ran; the
    # trajectories were still there: one turn each.
    assert env.group_calls == [[1, 1, 1]]
    assert [r.reward for r in group.rollouts] == [0.5, -0.5, 0.0]
    assert [r["reward"] for r in rows] == [0.5, -0.5, 0.0]
    assert all(r["group_id"] == group.group_id for r in rows)
    assert ("group_end", "3") in recorder.events
    assert_empty(engine, interceptor)


def test_group_with_a_failing_member():
    engine, env, interceptor, _ = make_engine(["ok"])
    engine.env.prompts = ["raise"]
    rows = []

    async def on_result(rollout):
        rows.append(rollout.result())

    async def main():
        from lowwater.environment import Task

        group = await engine.run_group(Task(7, "ok", "42"), 2, on_result=on_result)
        return group, await engine.run_group(Task(8, "raise", "42"), 2, on_result=on_result)

    ok_group, bad_group = trio.run(main)
    assert all(r.error is None for r in ok_group.rollouts)
    assert all(r.error.cls == "environment" for r in bad_group.rollouts)
    assert len(rows) == 4
    assert_empty(engine, interceptor)


def test_group_cancelled_mid_run_is_evicted():
    engine, env, interceptor, _ = make_engine(["hang"])
    rows = []

    async def on_result(rollout):
        rows.append(rollout.result())

    async def main():
        with trio.move_on_after(0.2):
            await engine.run_group(next(env.tasks()), 4, on_result=on_result)

    trio.run(main)
    assert [r["error"]["class"] for r in rows] == ["cancelled"] * 4
    assert_empty(engine, interceptor)


def test_disabled_cleanup_plugin_cannot_leak():
    # The engine alone evicts and releases: no policy is needed for it.
    plugins = load(disabled=("cleanup",))
    assert plugins.cleanup_policies == {}
    engine, env, interceptor, _ = make_engine(["ok", "raise"], plugins=plugins)

    async def main():
        for task in env.tasks():
            await engine.run_rollout(task)
        await engine.run_group(next(env.tasks()), 2)

    trio.run(main)
    assert_empty(engine, interceptor)


def test_many_concurrent_rollouts_mixed_outcomes():
    prompts = ["ok", "raise", "hang", "model-error", "flaky", "turn-error"] * 10
    engine, env, interceptor, _ = make_engine(prompts, deadlines=Deadlines(rollout_s=0.3), retry=RetryPolicy(model=1))
    results = []

    async def on_result(rollout):
        results.append(rollout.error.cls if rollout.error else "ok")

    async def main():
        async with trio.open_nursery() as nursery:
            for task in env.tasks():
                nursery.start_soon(lambda t=task: engine.run_rollout(t, on_result=on_result))

    trio.run(main)
    assert len(results) == 60
    assert results.count("ok") == 20 and results.count("timeout") == 10
    assert_empty(engine, interceptor)


def test_classify_and_retry_policy():
    import httpx

    assert classify(httpx.ReadTimeout("x")).cls == "model"
    assert classify(OSError("disk")).cls == "infra"
    assert classify(trio.TooSlowError()).cls == "timeout"
    assert classify(ValueError("bad")).cls == "environment"
    assert classify(RolloutFailed("infra", "no runtime")) == RolloutError("infra", "no runtime")
    with pytest.raises(ValueError):
        RolloutFailed("bogus", "x")
    policy = RetryPolicy(infra=1)
    assert policy.allows(RolloutError("infra", ""), 1) and not policy.allows(RolloutError("infra", ""), 2)
    assert not policy.allows(RolloutError("cancelled", ""), 1)
    assert not policy.allows(RolloutError("environment", ""), 1)


def test_group_size_must_be_positive():
    engine, env, _, _ = make_engine(["ok"])
    with pytest.raises(ValueError):
        trio.run(lambda: engine.run_group(next(env.tasks()), 0))


def test_unknown_harness():
    with pytest.raises(ValueError, match="harness"):
        Engine(ScriptedEnv(), FakeInterceptor(), Plugins(), None, harness="docker")


def test_slot_and_context_are_rollout_attributes_not_state():
    engine, env, interceptor, _ = make_engine(["ok", "raise", "hang"], deadlines=Deadlines(rollout_s=0.2))

    async def main():
        return [await engine.run_rollout(task) for task in env.tasks()]

    rollouts = trio.run(main)
    # During the harness: the slot is the one ctx carries, the context is ctx,
    # and the engine put nothing in the environment's state.
    assert env.seen == [(True, True, [])] * 3
    assert rollouts[0].state == {"final_text": "A: 42"}
    assert [r.state for r in rollouts[1:]] == [{}, {}]
    # Released on success, error and timeout.
    assert all(r.slot is None and r.context is None for r in rollouts)
    assert_empty(engine, interceptor)


def test_cancelled_rollout_releases_slot_and_context():
    engine, env, interceptor, _ = make_engine(["hang"])
    started = []

    async def main():
        async with trio.open_nursery() as nursery:

            async def one():
                started.append(await engine.run_rollout(next(env.tasks())))

            nursery.start_soon(one)
            await trio.sleep(0.1)
            assert len(interceptor.slots) == 1 and len(engine.registry) == 1
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert started == []  # cancellation propagated, after cleanup
    assert env.seen == [(True, True, [])]
    assert_empty(engine, interceptor)


class Order:
    """Records what a hook and a policy see at rollout_end and group_end."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    @hookimpl
    async def rollout_end(self, rollout):
        self.seen.append(("hook", "rollout_end", rollout.trajectory is not None))

    @hookimpl
    async def group_end(self, group):
        self.seen.append(("hook", "group_end", len(group.trajectories())))


class OrderPolicy:
    def __init__(self, order: Order) -> None:
        self.order = order

    async def rollout_end(self, rollout):
        self.order.seen.append(("policy", "rollout_end", rollout.trajectory is not None))

    async def group_end(self, group):
        self.order.seen.append(("policy", "group_end", len(group.trajectories())))


def _order_engine(prompts):
    order = Order()
    plugins = load(disabled=("cleanup",), extra=[("order", order)])
    plugins.cleanup_policies["order"] = OrderPolicy(order)
    engine, env, interceptor, _ = make_engine(prompts, plugins=plugins)
    return engine, env, interceptor, order


def test_hooks_read_trajectories_and_policies_run_after_eviction():
    engine, env, interceptor, order = _order_engine(["ok"])

    async def main():
        await engine.run_rollout(next(env.tasks()))
        await engine.run_group(next(env.tasks()), 2)

    trio.run(main)
    assert order.seen[:2] == [("hook", "rollout_end", True), ("policy", "rollout_end", False)]
    # A group member's trajectory outlives its own rollout_end (members end
    # concurrently); the group's hooks read both, its policies run once they
    # are evicted.
    assert sorted(order.seen[2:6]) == [("hook", "rollout_end", True)] * 2 + [("policy", "rollout_end", True)] * 2
    assert order.seen[6:] == [("hook", "group_end", 2), ("policy", "group_end", 0)]
    assert_empty(engine, interceptor)


@pytest.mark.parametrize("failure", ["raise", "hang"])
def test_a_failing_result_sink_still_evicts(failure):
    engine, env, interceptor, _ = make_engine(["ok"], deadlines=Deadlines(cleanup_s=0.2))

    async def on_result(rollout):
        if failure == "hang":
            await trio.sleep_forever()  # the cleanup deadline ends it
        raise OSError("disk full")

    async def main():
        if failure == "raise":
            with pytest.raises(OSError):
                await engine.run_rollout(next(env.tasks()), on_result=on_result)
            with pytest.raises(OSError):
                await engine.run_group(next(env.tasks()), 2, on_result=on_result)
        else:
            await engine.run_rollout(next(env.tasks()), on_result=on_result)
            await engine.run_group(next(env.tasks()), 2, on_result=on_result)

    trio.run(main)
    assert_empty(engine, interceptor)


def test_group_cancelled_during_the_group_reward_is_evicted():
    engine, env, interceptor, _ = make_engine(["ok"])
    reward_started = trio.Event()

    async def hang(group):
        reward_started.set()
        await trio.sleep_forever()

    env.group_reward = hang
    rows = []

    async def on_result(rollout):
        rows.append(rollout.result())

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: engine.run_group(next(env.tasks()), 3, on_result=on_result))
            await reward_started.wait()
            # Members are closed (slots gone), their trajectories still held.
            assert interceptor.slots == {} and len(engine.registry) == 3
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(rows) == 3
    assert_empty(engine, interceptor)
