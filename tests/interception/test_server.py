"""The interception server end to end over HTTP: every protocol, streamed and not.

Each test checks what the agent received, the turn recorded, and that the
intercept table is empty and no handler waits once the calls are done.
"""

from __future__ import annotations

import base64
import gzip

import orjson
import pytest
import trio

from lowwater import InterceptTable
from lowwater.interception import InterceptionServer, Protocol, builtin_protocols

from ._harness import KINDS, PATHS, body, read_sse, run

TERMINAL = {"chat": b"data: [DONE]", "responses": b"event: response.completed", "messages": b"event: message_stop"}
PROTOCOL = {"chat": "openai.chat", "responses": "openai.responses", "messages": "anthropic.messages"}


def completion_text(kind: str, completion) -> str:
    if kind == "chat":
        return completion["content"]
    if kind == "messages":
        return completion[0]["text"]
    return completion[0]["content"][0]["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_call_is_relayed_recorded_and_discarded(kind, stream):
    async def fn(h):
        slot, trajectory = h.open("r1")
        assert slot.base_url == h.server.url + "/v1" and slot.rollout_id == "r1"
        r = await h.call(slot, kind, body(kind, "add two and three", stream=stream))
        assert r.status_code == 200
        if stream:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await read_sse(r)
            assert events[-1].startswith(TERMINAL[kind])
            assert b"echo: add two and three".split()[-1] in b"".join(events)
        else:
            assert (
                completion_text(
                    kind,
                    {
                        "chat": lambda j: j["choices"][0]["message"],
                        "messages": lambda j: j["content"],
                        "responses": lambda j: j["output"],
                    }[kind](r.json()),
                )
                == "echo: add two and three"
            )
        (turn,) = trajectory.turns
        assert turn.protocol == PROTOCOL[kind] and turn.model == "m" and turn.streamed is stream
        assert turn.error is None and turn.index == 0
        assert turn.request_delta == [{"role": "user", "content": "add two and three"}]
        assert completion_text(kind, turn.completion) == "echo: add two and three"
        assert turn.finish_reason in ("stop", "end_turn", "completed")
        assert turn.usage and turn.duration_s >= 0 and turn.started_s > 0
        # The upstream got the agent's bytes, with the upstream's key, not the rollout's secret.
        path, headers, sent = h.upstream.received[-1]
        assert path == PATHS[kind] and sent == body(kind, "add two and three", stream=stream)
        assert slot.secret not in headers.values()
        await h.assert_clean()
        assert h.server.table.stats()["inserts"] == 1 and h.server.table.stats()["discards"] == 1

    run(fn)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_turns_keep_the_message_delta_not_the_history(kind, stream):
    image = base64.b64encode(bytes(range(256)) * 256).decode()  # a 87 KB "screenshot"

    async def fn(h):
        slot, trajectory = h.open()
        history: list = []
        for i in range(4):
            content = [{"type": "text", "text": f"step {i}"}, {"type": "image", "data": image}]
            request = body(kind, "x", stream=stream, history=history)
            request[("input" if kind == "responses" else "messages")][-1]["content"] = content
            r = await h.call(slot, kind, request)
            assert r.status_code == 200
            await r.aread()
            history = [*history, {"role": "user", "content": content}, {"role": "assistant", "content": f"done {i}"}]
        assert [len(t.request_delta) for t in trajectory.turns] == [1, 2, 2, 2]
        assert [t.request_delta_start for t in trajectory.turns] == [0, 1, 3, 5]
        # Each image is held once across the trajectory (one object per turn that sent it new).
        images = [
            part["data"]
            for t in trajectory.turns
            for m in t.request_delta
            if isinstance(m["content"], list)
            for part in m["content"]
            if part["type"] == "image"
        ]
        assert len(images) == 4
        assert len(orjson.dumps([t.to_json() for t in trajectory.turns])) < 4 * len(image) + 8000
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_token_ids_and_logprobs_are_captured_when_asked(kind, stream):
    async def fn(h):
        slot, trajectory = h.open()
        r = await h.call(slot, kind, body(kind, "one two three", stream=stream))
        await r.aread()
        (turn,) = trajectory.turns
        assert turn.logprobs == [-0.5, -1.0, -1.5, -2.0]
        if kind == "chat":
            assert turn.token_ids == [1000, 1001, 1002, 1003]
            assert h.upstream.received[-1][2]["return_token_ids"] is True
        else:
            assert h.upstream.received[-1][2]["include"] == ["message.output_text.logprobs"]

    run(fn, request_logprobs=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_tool_calls_are_recorded(kind, stream):
    async def fn(h):
        h.upstream.tool_call = True
        slot, trajectory = h.open()
        r = await h.call(slot, kind, body(kind, stream=stream))
        await r.aread()
        (turn,) = trajectory.turns
        if kind == "chat":
            (tc,) = turn.completion["tool_calls"]
            assert (
                tc["function"] == {"name": "calculator", "arguments": '{"expression": "1+1"}'} and tc["id"] == "call_1"
            )
            assert turn.finish_reason == "tool_calls"
        elif kind == "messages":
            assert turn.completion[1]["input"] == {"expression": "1+1"} and turn.finish_reason == "tool_use"
        else:
            assert turn.completion[1]["type"] == "function_call"

    run(fn)


def test_model_override_and_upstream_key():
    async def fn(h):
        h.model.model = "served-model"
        slot, trajectory = h.open()
        r = await h.call(slot, "chat", body("chat", model="whatever-the-agent-says"))
        assert r.status_code == 200
        _, headers, sent = h.upstream.received[-1]
        assert sent["model"] == "served-model" and trajectory.turns[0].model == "whatever-the-agent-says"
        assert headers["authorization"] == "Bearer upstream-key" and headers["x-api-key"] == "upstream-key"
        models = await h.http.get(slot.base_url + "/models", headers={"x-api-key": slot.secret})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "served-model"

    run(fn, client={"api_key": "upstream-key"})


def test_anthropic_headers_are_forwarded():
    async def fn(h):
        slot, _ = h.open()
        r = await h.http.post(
            slot.anthropic_base_url + "/v1/messages",
            json=body("messages"),
            headers={"x-api-key": slot.secret, "anthropic-version": "2023-06-01", "x-other": "1"},
        )
        assert r.status_code == 200
        headers = h.upstream.received[-1][1]
        assert headers["anthropic-version"] == "2023-06-01" and "x-other" not in headers

    run(fn)


def test_secrets_authenticate_and_isolate_rollouts():
    async def fn(h):
        a, ta = h.open("a")
        b, tb = h.open("b")
        assert a.secret != b.secret
        url = a.base_url + "/chat/completions"
        for headers in (
            {},
            {"authorization": "Bearer nope"},
            {"x-api-key": "nope"},
            {"authorization": a.secret},
            {"authorization": f"Basic {a.secret}"},
            {"authorization": f"Bearer {a.secret}", "x-api-key": b.secret},
        ):
            r = await h.http.post(url, json=body("chat"), headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
        r = await h.http.post(a.base_url + "/messages", json=body("messages"), headers={"x-api-key": "nope"})
        assert (
            r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"
        )
        # One server serves every rollout: the secret, not the URL, picks the trajectory.
        assert (await h.call(b, "chat", body("chat"), auth="x-api-key")).status_code == 200
        assert (await h.call(a, "messages", body("messages"))).status_code == 200
        assert [t.protocol for t in ta.turns] == ["anthropic.messages"]
        assert [t.protocol for t in tb.turns] == ["openai.chat"]
        r = await h.http.get(a.base_url + "/models")
        assert r.status_code == 401
        h.server.unregister("a")
        assert (await h.call(a, "chat", body("chat"))).status_code == 401
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_requests_are_400_with_a_reason(kind):
    bad_bodies = [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (orjson.dumps({**body(kind), "model": 3}), "'model' must be a string"),
        (orjson.dumps({k: v for k, v in body(kind).items() if k != "model"}), "missing field 'model'"),
        (orjson.dumps({**body(kind), "stream": "yes"}), "'stream' must be a boolean"),
    ]
    key = "input" if kind == "responses" else "messages"
    bad_bodies += [
        (orjson.dumps({k: v for k, v in body(kind).items() if k != key}), f"missing field '{key}'"),
        (orjson.dumps({**body(kind), key: []}), key),
        (orjson.dumps({**body(kind), key: [3]}), f"{key}[0] must be an object"),
    ]
    if kind != "responses":
        bad_bodies.append(
            (orjson.dumps({**body(kind), "messages": [{"role": "robot", "content": "hi"}]}), "messages[0].role")
        )
    if kind == "messages":
        bad_bodies += [
            (orjson.dumps({k: v for k, v in body(kind).items() if k != "max_tokens"}), "missing field 'max_tokens'"),
            (orjson.dumps({**body(kind), "max_tokens": "many"}), "'max_tokens' must be a positive integer"),
            (orjson.dumps({**body(kind), "max_tokens": True}), "'max_tokens' must be a positive integer"),
        ]

    async def fn(h):
        slot, trajectory = h.open()
        for raw, reason in bad_bodies:
            r = await h.http.post(
                slot.base_url + PATHS[kind].removeprefix("/v1"),
                content=raw,
                headers={"authorization": f"Bearer {slot.secret}"},
            )
            assert r.status_code == 400, (raw, r.text)
            err = r.json()["error"]
            assert reason in err["message"], (reason, err)
            assert err["type"] == "invalid_request_error"
            if kind == "messages":
                assert r.json()["type"] == "error"
        assert trajectory.turns == [] and h.upstream.received == []
        assert h.server.table.stats()["inserts"] == 0
        await h.assert_clean()

    run(fn)


def test_routes_methods_and_body_limit():
    async def fn(h):
        slot, _ = h.open()
        auth = {"authorization": f"Bearer {slot.secret}"}
        assert (await h.http.post(slot.base_url + "/completions", json={}, headers=auth)).status_code == 404
        assert (await h.http.get(slot.base_url + "/chat/completions", headers=auth)).status_code == 405
        assert (await h.http.post(slot.base_url + "/models", headers=auth)).status_code == 405
        big = body("chat", "x" * 5000)
        r = await h.http.post(slot.base_url + "/chat/completions", json=big, headers=auth)
        assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"]
        # A trailing slash is the same route.
        r = await h.http.post(slot.base_url + "/chat/completions/", json=body("chat"), headers=auth)
        assert r.status_code == 200
        assert h.upstream.received[-1][2] == body("chat") and len(h.upstream.received) == 1
        await h.assert_clean()

    run(fn, max_body_bytes=4096)


@pytest.mark.parametrize("kind", KINDS)
def test_a_compressed_body_is_415_naming_its_coding(kind):
    async def fn(h):
        slot, trajectory = h.open()
        url = slot.base_url + PATHS[kind].removeprefix("/v1")
        raw = gzip.compress(orjson.dumps(body(kind)))
        for coding in ("gzip", "identity, gzip", "BR"):
            r = await h.http.post(
                url,
                content=raw,
                headers={"authorization": f"Bearer {slot.secret}", "content-encoding": coding},
            )
            assert r.status_code == 415, r.text
            assert r.headers["accept-encoding"] == "identity"
            named = coding.rpartition(",")[2].strip()
            assert f"content-encoding {named} is not supported" in r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        # identity is no coding at all: the call goes through.
        plain = orjson.dumps(body(kind))
        r = await h.http.post(
            url, content=plain, headers={"authorization": f"Bearer {slot.secret}", "content-encoding": "identity"}
        )
        assert r.status_code == 200, r.text
        assert len(trajectory.turns) == 1 and len(h.upstream.received) == 1
        assert h.server.table.stats()["inserts"] == 1
        await h.assert_clean()

    run(fn)


def test_oversize_streamed_body_gets_413_not_a_reset():
    async def fn(h):
        slot, _ = h.open()

        async def chunks():
            for _ in range(64):
                yield b" " * 65536

        r = await h.http.post(
            slot.base_url + "/chat/completions",
            content=chunks(),
            headers={"authorization": f"Bearer {slot.secret}", "content-type": "application/json"},
        )
        assert r.status_code == 413
        await h.assert_clean()

    run(fn, max_body_bytes=1 << 20)


def test_concurrent_calls_of_many_rollouts():
    async def fn(h):
        h.upstream.latency_s = 0.01
        slots = [h.open(f"r{i}") for i in range(20)]

        async def agent(slot, kind, stream):
            for turn in range(3):
                r = await h.call(slot, kind, body(kind, f"turn {turn}", stream=stream))
                assert r.status_code == 200
                await r.aread()

        async with trio.open_nursery() as nursery:
            for i, (slot, _) in enumerate(slots):
                nursery.start_soon(agent, slot, KINDS[i % 3], i % 2 == 0)
        for i, (slot, trajectory) in enumerate(slots):
            assert len(trajectory.turns) == 3 and all(t.error is None for t in trajectory.turns)
            assert {t.protocol for t in trajectory.turns} == {PROTOCOL[KINDS[i % 3]]}
        await h.assert_clean()
        assert h.server.stats()["calls"]["ok"] == 60
        for slot, _ in slots:
            assert h.server.unregister(slot.rollout_id) == 0
        stats = h.server.stats()
        assert stats["open_rollouts"] == 0 and stats["intercepts"]["open_rollouts"] == 0

    run(fn)


def test_register_and_unregister_contract():
    async def fn(h):
        slot, trajectory = h.open("x")
        with pytest.raises(KeyError):
            h.server.register(trajectory)
        assert h.server.table.is_open("x")
        assert h.server.unregister("x") == 0 and h.server.unregister("x") == 0
        assert not h.server.table.is_open("x")
        again = h.server.register(trajectory)  # a retried rollout may reuse its id
        assert again.secret != slot.secret
        assert h.server.stats()["open_rollouts"] == 1

    run(fn)


def test_server_refuses_protocol_clashes_and_needs_to_run():
    class Twin(Protocol):
        name = "openai.chat"
        path = "/v1/other"

    with pytest.raises(ValueError):
        InterceptionServer(protocols=[*builtin_protocols(), Twin()])
    server = InterceptionServer(table=InterceptTable())
    from lowwater.trajectory import Trajectory

    with pytest.raises(RuntimeError):
        server.register(Trajectory("r"))


def test_table_capacity_gives_503_and_retry_after():
    async def fn(h):
        slot, trajectory = h.open()
        r = await h.call(slot, "chat", body("chat", "x" * 600))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert h.server.table.stats()["rejected"] == 1
        assert (await h.call(slot, "chat", body("chat"))).status_code == 200
        assert len(trajectory.turns) == 1  # the refused call is not a turn; its messages are in the next delta
        await h.assert_clean()

    run(fn, table=InterceptTable(capacity_bytes=512))


def test_plugin_registers_the_builtin_protocols():
    from lowwater.interception import plugin

    got = []
    plugin.register_protocols(got.append)
    assert [(p.name, p.path) for p in got] == [
        ("openai.chat", "/v1/chat/completions"),
        ("openai.responses", "/v1/responses"),
        ("anthropic.messages", "/v1/messages"),
    ]


def test_a_third_party_protocol_is_routed():
    from lowwater.interception import OpenAIChat

    class Legacy(OpenAIChat):
        name = "legacy.chat"
        path = "/v1/legacy/chat"

    async def fn(h):
        slot, trajectory = h.open()
        r = await h.http.post(
            slot.base_url + "/legacy/chat", json=body("chat"), headers={"authorization": f"Bearer {slot.secret}"}
        )
        # The scripted upstream has no such route: its 404 passes through as the upstream's.
        assert r.status_code == 404
        assert trajectory.turns[0].protocol == "legacy.chat" and trajectory.turns[0].error == "upstream answered 404"
        await h.assert_clean()

    run(fn, protocols=[*builtin_protocols(), Legacy()])
