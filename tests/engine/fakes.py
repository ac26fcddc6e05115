"""Test doubles for the engine: an interceptor without HTTP and scripted environments."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from lowwater import InterceptTable
from lowwater.environment import Environment, HarnessContext, Score, Task
from lowwater.trajectory import Turn


@attrs.define
class FakeSlot:
    rollout_id: str
    base_url: str
    secret: str


class FakeInterceptor:
    """Registers slots in a real InterceptTable; a harness 'calls' by holding an intercept."""

    def __init__(self) -> None:
        self.table = InterceptTable()
        self.slots: dict[str, Any] = {}
        self.unregistered: list[str] = []

    def register(self, trajectory: Any) -> FakeSlot:
        self.table.open_rollout(trajectory.rollout_id)
        self.slots[trajectory.rollout_id] = trajectory
        return FakeSlot(trajectory.rollout_id, "http://fake/v1", "secret-" + trajectory.rollout_id)

    def unregister(self, rollout_id: str) -> int:
        if rollout_id not in self.slots:
            return 0
        del self.slots[rollout_id]
        self.unregistered.append(rollout_id)
        return len(self.table.close_rollout(rollout_id))


class ScriptedEnv(Environment):
    """Harness behaviour chosen per task prompt: "ok", "raise", "hang", "hang-score", "model-error", "turn-error"."""

    name = "scripted"

    def __init__(self, prompts: list[str] | None = None, table: InterceptTable | None = None) -> None:
        self.prompts = prompts or ["ok"]
        #: The FakeInterceptor's table, where the harness holds its "in-flight call".
        self.table = table
        #: (slot is the rollout's, context is ctx, engine keys in state) seen by each harness call.
        self.seen: list[tuple[bool, bool, list[str]]] = []
        self.group_calls: list[Any] = []
        self.group_rewards: list[float] | None = None

    def tasks(self):
        for i, p in enumerate(self.prompts):
            yield Task(i, p, "42")

    async def harness(self, ctx: HarnessContext) -> None:
        rollout = ctx.rollout
        table = self.table
        assert table is not None, "give ScriptedEnv the FakeInterceptor's table"
        slot = rollout.slot
        self.seen.append(
            (slot is not None and slot.secret == ctx.api_key, rollout.context is ctx, sorted(rollout.state))
        )
        # Hold an intercept like an in-flight model call would.
        request_id = f"{rollout.rollout_id}-req-{rollout.attempt}"
        table.insert(request_id, rollout.rollout_id, b"x" * 1000, protocol="openai.chat", stream=False)
        delta = rollout.trajectory.message_delta([{"role": "user", "content": ctx.task.prompt}])
        rollout.trajectory.add_turn(Turn(0, "openai.chat", "m", delta, {"content": "A: 42"}))
        p = ctx.task.prompt
        if p == "hang":
            await trio.sleep_forever()
        if p == "raise":
            raise KeyError("environment bug")
        if p == "model-error":
            from lowwater.rollout import RolloutFailed

            raise RolloutFailed("model", "upstream 500")
        if p == "turn-error":
            rollout.trajectory.turns[-1].error = "upstream stream cut"
        if p.startswith("flaky") and rollout.attempt == 1:
            import httpx

            raise httpx.ConnectError("refused")
        table.discard(request_id)
        rollout.state["final_text"] = "A: 42"

    async def score(self, rollout) -> Score:
        if rollout.task.prompt == "hang-score":
            await trio.sleep_forever()
        return Score(1.0, {"correct": True})

    async def group_reward(self, group) -> list[float] | None:
        self.group_calls.append([len(t.turns) for t in group.trajectories()])
        return self.group_rewards
