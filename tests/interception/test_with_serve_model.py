"""The official SDKs through the proxy to ``lowwater serve-model``: multi-turn tool use, streamed and not.

Each agent solves a scripted arithmetic problem with calculator calls; the
trajectory must hold one turn per model call, each with only its new
messages, and the completion token ids the upstream returned.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import trio

from lowwater.envs.arithmetic import problem
from lowwater.envs.calculator import evaluate, format_result
from lowwater.interception import InterceptionServer
from lowwater.serve_model import ScriptedModel, serve_model
from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient

from ._harness import GUARD_S

CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "parameters": {"type": "object"}}]
MESSAGES_TOOLS = [{"name": "calculator", "input_schema": {"type": "object"}}]


def calc(expression: str) -> str:
    return format_result(evaluate(expression))


def chat(slot, question: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=slot.base_url, api_key=slot.secret, max_retries=0)
    messages: list = [{"role": "user", "content": question}]
    for _ in range(20):
        if stream:
            with client.chat.completions.stream(model="m", messages=messages, tools=CHAT_TOOLS) as s:
                completion = s.get_final_completion()
        else:
            completion = client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
        message = completion.choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message.model_dump(exclude_none=True))
        (call,) = message.tool_calls
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": calc(json.loads(call.function.arguments)["expression"]),
            }
        )
    raise AssertionError("no answer")


def responses(slot, question: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=slot.base_url, api_key=slot.secret, max_retries=0)
    items: list = [{"role": "user", "content": question}]
    for _ in range(20):
        if stream:
            with client.responses.stream(model="m", input=items, tools=RESPONSES_TOOLS) as s:
                response = s.get_final_response()
        else:
            response = client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            return response.output_text
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items.append(
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": calc(json.loads(calls[0].arguments)["expression"]),
            }
        )
    raise AssertionError("no answer")


def messages(slot, question: str, stream: bool) -> str:
    client = anthropic.Anthropic(base_url=slot.anthropic_base_url, api_key=slot.secret, max_retries=0)
    history: list = [{"role": "user", "content": question}]
    for _ in range(20):
        request = {"model": "m", "max_tokens": 1024, "messages": history, "tools": MESSAGES_TOOLS}
        if stream:
            with client.messages.stream(**request) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**request)
        if message.stop_reason != "tool_use":
            return "".join(b.text for b in message.content if b.type == "text")
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        (use,) = [b for b in message.content if b.type == "tool_use"]
        history.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": calc(use.input["expression"])}],
            }
        )
    raise AssertionError("no answer")


@pytest.mark.parametrize("agent", [chat, responses, messages])
def test_agents_solve_a_problem_through_the_proxy(agent):
    p = problem(4, 9)

    async def main():
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_model, ScriptedModel())
            async with ModelClient(url + "/v1", retries=0) as client:
                server = InterceptionServer(client, request_logprobs=True)
                await nursery.start(server.run)
                with trio.fail_after(GUARD_S):
                    for stream in (False, True):
                        trajectory = Trajectory(f"{agent.__name__}-{stream}")
                        slot = server.register(trajectory)
                        text = await trio.to_thread.run_sync(agent, slot, p.question, stream)
                        assert text.splitlines()[-1] == f"A: {p.answer}"
                        assert server.unregister(slot.rollout_id) == 0
                        turns = trajectory.turns
                        assert len(turns) == len(p.steps) + 1 and all(t.error is None for t in turns)
                        # Turn 0 sends the question; each later turn adds the model's call and its result.
                        assert [len(t.request_delta) for t in turns][:2] in ([1, 2], [1, 3])
                        if agent is chat:
                            assert all(t.token_ids for t in turns)
                            if not stream:  # a stream carries usage only if the agent asks for it
                                assert all(len(t.token_ids) == t.usage["completion_tokens"] for t in turns)
                        if agent is not messages:
                            assert all(t.logprobs for t in turns if t.finish_reason in ("stop", "completed"))
                    assert len(server.table) == 0
                nursery.cancel_scope.cancel()

    trio.run(main)
