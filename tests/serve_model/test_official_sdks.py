"""The official ``openai`` and ``anthropic`` SDKs (sync, in a worker thread) against serve-model.

The SDKs' streaming helpers accumulate the events themselves, so they check
that each protocol's event format is the real one.
"""

from __future__ import annotations

import json

import anthropic
import openai
import trio

from lowwater.envs.arithmetic import problem
from lowwater.serve_model import ScriptedModel

from ._client import (
    CHAT_TOOLS,
    MESSAGES_TOOLS,
    RESPONSES_TOOLS,
    calculate,
    gsm8k_rows,
    replay_model,
    requires_data,
    run_with_server,
)


def in_thread(model, fn):
    async def body(url, client):
        return await trio.to_thread.run_sync(fn, url)

    return run_with_server(model, body)


def openai_chat(url: str, question: str, stream: bool) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": question}]
    for calls in range(50):
        if stream:
            with client.chat.completions.stream(model="m", messages=messages, tools=CHAT_TOOLS) as s:
                completion = s.get_final_completion()
        else:
            completion = client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
        message = completion.choices[0].message
        if completion.choices[0].finish_reason != "tool_calls":
            return message.content, calls
        (call,) = message.tool_calls
        messages.append(message.model_dump(exclude_none=True))
        result = calculate(json.loads(call.function.arguments)["expression"])
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise AssertionError("no final answer")


def openai_responses(url: str, question: str, stream: bool) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    items: list = [{"role": "user", "content": question}]
    for calls in range(50):
        if stream:
            with client.responses.stream(model="m", input=items, tools=RESPONSES_TOOLS) as s:
                response = s.get_final_response()
        else:
            response = client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)
        function_calls = [o for o in response.output if o.type == "function_call"]
        if not function_calls:
            return response.output_text, calls
        items += [o.model_dump(exclude_none=True) for o in response.output]
        (call,) = function_calls
        items.append(
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": calculate(json.loads(call.arguments)["expression"]),
            }
        )
    raise AssertionError("no final answer")


def anthropic_messages(url: str, question: str, stream: bool) -> tuple[str, int]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": question}]
    for calls in range(50):
        if stream:
            with client.messages.stream(model="m", max_tokens=1024, messages=messages, tools=MESSAGES_TOOLS) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(model="m", max_tokens=1024, messages=messages, tools=MESSAGES_TOOLS)
        if message.stop_reason != "tool_use":
            return "".join(b.text for b in message.content if b.type == "text"), calls
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        (use,) = [b for b in message.content if b.type == "tool_use"]
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": calculate(use.input["expression"])}
                ],
            }
        )
    raise AssertionError("no final answer")


AGENTS = (openai_chat, openai_responses, anthropic_messages)


def test_sdks_solve_a_scripted_problem_streamed_and_not():
    p = problem(4, 9)

    def all_agents(url):
        return [agent(url, p.question, stream) for agent in AGENTS for stream in (False, True)]

    for text, calls in in_thread(ScriptedModel(), all_agents):
        assert text.splitlines()[-1] == f"A: {p.answer}" and calls == len(p.steps)


@requires_data
def test_sdks_replay_a_gsm8k_row_streamed_and_not():
    row = gsm8k_rows()[17]
    recorded = row["175b_finetuning"]["solution"]

    def all_agents(url):
        return [agent(url, row["question"], stream) for agent in AGENTS for stream in (False, True)]

    for text, calls in in_thread(replay_model("175b_finetuning"), all_agents):
        assert text.splitlines()[-1] == recorded.splitlines()[-1] and calls == recorded.count(">>")


@requires_data
def test_sdk_errors_carry_the_reason():
    def ask(url):
        out = []
        try:
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Who are you?"}]
            )
        except openai.BadRequestError as exc:
            out.append(str(exc))
        try:
            anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(
                model="m", max_tokens=10, messages=[{"role": "user", "content": "Who are you?"}]
            )
        except anthropic.BadRequestError as exc:
            out.append(str(exc))
        models = openai.OpenAI(base_url=url + "/v1", api_key="k").models.list()
        out.append([m.id for m in models])
        return out

    chat_error, messages_error, models = in_thread(replay_model(), ask)
    assert "unknown question" in chat_error and "unknown question" in messages_error
    assert models == ["replay:175b_verification"]
