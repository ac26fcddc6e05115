"""Calculator agents on the official ``openai`` and ``anthropic`` SDKs (sync),
one per protocol, shared by the serve-model tests (the SDKs against
``serve-model``) and the interception tests (the SDKs through the proxy).

The SDKs' streaming helpers accumulate the events themselves, so an agent
that finishes checks that the events are in each protocol's real format.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import openai

from lowwater.envs.calculator import CalculatorError, evaluate, format_result

CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "parameters": {"type": "object"}}]
MESSAGES_TOOLS = [{"name": "calculator", "input_schema": {"type": "object"}}]
#: Model calls an agent makes at most before it fails ("no final answer").
MAX_CALLS = 50

Calculator = Callable[[str], str]


def calculate(expression: str) -> str:
    """The calculator tool's result for ``expression``, or ``error: ...`` (as an agent reports it)."""
    try:
        return format_result(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"


def openai_chat(base_url: str, api_key: str, question: str, stream: bool, calculator: Calculator = calculate):
    """Answer ``question`` with the Chat Completions API at ``base_url`` (ending in ``/v1``),
    calling the calculator until the model stops.  Returns ``(final text, tool calls made)``."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": question}]
    for calls in range(MAX_CALLS):
        if stream:
            with client.chat.completions.stream(model="m", messages=messages, tools=CHAT_TOOLS) as s:
                completion = s.get_final_completion()
        else:
            completion = client.chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS)
        message = completion.choices[0].message
        if completion.choices[0].finish_reason != "tool_calls":
            assert not message.tool_calls, completion  # a call comes with finish_reason "tool_calls"
            return message.content, calls
        (call,) = message.tool_calls
        messages.append(message.model_dump(exclude_none=True))
        result = calculator(json.loads(call.function.arguments)["expression"])
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise AssertionError("no final answer")


def openai_responses(base_url: str, api_key: str, question: str, stream: bool, calculator: Calculator = calculate):
    """As :func:`openai_chat`, with the Responses API."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    items: list = [{"role": "user", "content": question}]
    for calls in range(MAX_CALLS):
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
                "output": calculator(json.loads(call.arguments)["expression"]),
            }
        )
    raise AssertionError("no final answer")


def anthropic_messages(base_url: str, api_key: str, question: str, stream: bool, calculator: Calculator = calculate):
    """As :func:`openai_chat`, with the Anthropic Messages API at ``base_url`` (without ``/v1``)."""
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": question}]
    for calls in range(MAX_CALLS):
        request = {"model": "m", "max_tokens": 1024, "messages": messages, "tools": MESSAGES_TOOLS}
        if stream:
            with client.messages.stream(**request) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**request)
        if message.stop_reason != "tool_use":
            return "".join(b.text for b in message.content if b.type == "text"), calls
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        (use,) = [b for b in message.content if b.type == "tool_use"]
        result = calculator(use.input["expression"])
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}
        )
    raise AssertionError("no final answer")


#: Protocol name -> agent.
AGENTS = {"chat": openai_chat, "responses": openai_responses, "messages": anthropic_messages}
