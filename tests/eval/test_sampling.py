"""Sampling arguments reach every model call: ``apply`` unit cases (the agent's
own keys win; ``max_tokens`` is renamed per protocol) and the interception
server forwarding them upstream for each protocol."""

from __future__ import annotations

import pytest

from interception._harness import KINDS, body, run
from lowwater.interception.sampling import apply


def test_run_values_fill_only_what_the_agent_left_unset():
    payload = {"model": "m", "messages": [], "temperature": 0.2}
    out = apply("openai.chat", payload, {"temperature": 1.0, "top_p": 0.9, "seed": 3})
    assert out == {"model": "m", "messages": [], "temperature": 0.2, "top_p": 0.9, "seed": 3}
    assert apply("openai.chat", payload, {"temperature": 1.0}) is None  # nothing to add: forwarded as sent


def test_max_tokens_is_spelled_per_protocol_and_any_spelling_counts_as_set():
    assert apply("openai.responses", {"input": []}, {"max_tokens": 5}) == {"input": [], "max_output_tokens": 5}
    assert apply("openai.chat", {"messages": []}, {"max_tokens": 5}) == {"messages": [], "max_tokens": 5}
    assert apply("openai.chat", {"max_completion_tokens": 9}, {"max_tokens": 5}) is None
    assert apply("anthropic.messages", {"max_tokens": 64}, {"max_tokens": 5}) is None


@pytest.mark.parametrize("kind", KINDS)
def test_the_interception_server_forwards_sampling_to_every_call(kind):
    async def check(h):
        h.server.sampling = {"temperature": 0.0, "top_p": 0.5, "max_tokens": 7}
        slot, _ = h.open()
        for _ in range(2):
            response = await h.call(slot, kind, body(kind))
            assert response.status_code == 200, response.text
            sent = h.upstream.received[-1][2]
            assert sent["temperature"] == 0.0 and sent["top_p"] == 0.5
            max_key = {"chat": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}[kind]
            # anthropic bodies carry their own max_tokens (64): the agent's value wins
            assert sent[max_key] == (64 if kind == "messages" else 7)
        await h.assert_clean()

    run(check)
