"""The official ``openai`` and ``anthropic`` SDKs pointed at the interception server.

The SDKs run on asyncio/anyio, so their sync clients run in a worker thread
(``trio.to_thread.run_sync``) while the proxy and the upstream run on Trio.
Their streaming helpers assemble the events themselves, which checks that
the relayed streams are well formed; errors the proxy makes must surface as
the SDKs' own exceptions.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
import trio

from ._harness import run

QUESTION = "what is six times seven"
ANSWER = "echo: what is six times seven"


def openai_client(slot) -> openai.OpenAI:
    return openai.OpenAI(base_url=slot.base_url, api_key=slot.secret, max_retries=0, timeout=20)


def anthropic_client(slot) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=slot.anthropic_base_url, api_key=slot.secret, max_retries=0, timeout=20)


def chat(slot, mode: str) -> str:
    client = openai_client(slot)
    messages = [{"role": "user", "content": QUESTION}]
    if mode == "whole":
        return client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    if mode == "stream":
        chunks = client.chat.completions.create(model="m", messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with client.chat.completions.stream(model="m", messages=messages) as s:
        return s.get_final_completion().choices[0].message.content


def responses(slot, mode: str) -> str:
    client = openai_client(slot)
    if mode == "whole":
        return client.responses.create(model="m", input=QUESTION).output_text
    if mode == "stream":
        events = client.responses.create(model="m", input=QUESTION, stream=True)
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    with client.responses.stream(model="m", input=[{"role": "user", "content": QUESTION}]) as s:
        return s.get_final_response().output_text


def messages(slot, mode: str) -> str:
    client = anthropic_client(slot)
    request = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}]}
    if mode == "whole":
        return client.messages.create(**request).content[0].text
    if mode == "stream":
        events = client.messages.create(**request, stream=True)
        return "".join(e.delta.text for e in events if e.type == "content_block_delta")
    with client.messages.stream(**request) as s:
        return s.get_final_message().content[0].text


AGENTS = {"chat": chat, "responses": responses, "messages": messages}


@pytest.mark.parametrize("mode", ["whole", "stream", "helper"])
@pytest.mark.parametrize("kind", list(AGENTS))
def test_official_sdk_round_trip(kind, mode):
    async def fn(h):
        slot, trajectory = h.open()
        text = await trio.to_thread.run_sync(AGENTS[kind], slot, mode)
        assert text == ANSWER
        (turn,) = trajectory.turns
        assert turn.error is None and turn.streamed is (mode != "whole")
        await h.assert_clean()

    run(fn)


def test_openai_sdk_models_list():
    async def fn(h):
        slot, _ = h.open()
        models = await trio.to_thread.run_sync(lambda: [m.id for m in openai_client(slot).models.list()])
        assert models == ["lowwater-upstream"]

    run(fn)


@pytest.mark.parametrize("kind", list(AGENTS))
def test_sdk_raises_on_a_cut_stream(kind):
    async def fn(h):
        h.upstream.cut_after = 3
        slot, trajectory = h.open()
        errors = (openai.APIError, anthropic.APIError, anthropic.APIConnectionError)
        with pytest.raises(errors) as info:
            await trio.to_thread.run_sync(AGENTS[kind], slot, "helper")
        assert "upstream stream cut" in str(info.value)
        assert trajectory.turns[0].error.startswith("upstream stream cut")
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("kind", list(AGENTS))
def test_sdk_sees_unregister_as_an_error(kind):
    async def fn(h):
        h.upstream.hang = True
        slot, _ = h.open("gone")
        outcome = {}

        def agent():
            try:
                AGENTS[kind](slot, "whole")
            except (openai.APIStatusError, anthropic.APIStatusError) as exc:
                outcome["status"] = exc.status_code

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, agent)
            await h.upstream.entered.wait()
            h.server.unregister("gone")
        assert outcome == {"status": 410}
        await h.assert_clean()

    run(fn)


def test_sdk_with_a_wrong_key_is_refused():
    async def fn(h):
        slot, _ = h.open()
        slot_copy = type(slot)(slot.rollout_id, slot.base_url, "lw-wrong", None, None)
        with pytest.raises(openai.AuthenticationError):
            await trio.to_thread.run_sync(chat, slot_copy, "whole")
        with pytest.raises(anthropic.AuthenticationError):
            await trio.to_thread.run_sync(messages, slot_copy, "stream")

    run(fn)
