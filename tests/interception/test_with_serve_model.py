"""The official SDKs through the proxy to ``lowwater serve-model``: multi-turn tool use, streamed and not.

Each agent solves a scripted arithmetic problem with calculator calls; the
trajectory must hold one turn per model call, each with only its new
messages, and the completion token ids the upstream returned.
"""

from __future__ import annotations

import pytest
import trio

from _sdk_agents import AGENTS
from lowwater.envs.arithmetic import problem
from lowwater.envs.calculator import evaluate, format_result
from lowwater.interception import InterceptionServer
from lowwater.serve_model import ScriptedModel, serve_model
from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient

from ._harness import GUARD_S


def calc(expression: str) -> str:
    """The calculator, raising on an expression it refuses: the scripted model asks only valid ones."""
    return format_result(evaluate(expression))


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_agents_solve_a_problem_through_the_proxy(protocol):
    p = problem(4, 9)

    async def main():
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_model, ScriptedModel())
            async with ModelClient(url + "/v1", retries=0) as client:
                server = InterceptionServer(client, request_logprobs=True)
                await nursery.start(server.run)
                with trio.fail_after(GUARD_S):
                    for stream in (False, True):
                        trajectory = Trajectory(f"{protocol}-{stream}")
                        slot = server.register(trajectory)
                        base_url = slot.anthropic_base_url if protocol == "messages" else slot.base_url
                        text, calls = await trio.to_thread.run_sync(
                            AGENTS[protocol], base_url, slot.secret, p.question, stream, calc
                        )
                        assert text.splitlines()[-1] == f"A: {p.answer}" and calls == len(p.steps)
                        assert server.unregister(slot.rollout_id) == 0
                        turns = trajectory.turns
                        assert len(turns) == len(p.steps) + 1 and all(t.error is None for t in turns)
                        # Turn 0 sends the question; each later turn adds the model's call and its result.
                        assert [len(t.request_delta) for t in turns][:2] in ([1, 2], [1, 3])
                        if protocol == "chat":
                            assert all(t.token_ids for t in turns)
                            if not stream:  # a stream carries usage only if the agent asks for it
                                assert all(len(t.token_ids) == t.usage["completion_tokens"] for t in turns)
                        if protocol != "messages":
                            assert all(t.logprobs for t in turns if t.finish_reason in ("stop", "completed"))
                    assert len(server.table) == 0
                nursery.cancel_scope.cancel()

    trio.run(main)
