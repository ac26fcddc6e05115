"""serve-model over HTTP with httpx on Trio: every protocol, streamed and not, scripted and replay."""

from __future__ import annotations

import re

import orjson
import pytest
import trio

from lowwater.envs.arithmetic import problem
from lowwater.http import serve
from lowwater.serve_model import ScriptedModel, build_app, tokens
from lowwater.serve_model.replay import annotation_matches

from ._client import (
    PATHS,
    PROTOCOLS,
    gsm8k_rows,
    replay_model,
    request,
    requires_data,
    run_with_server,
    several_step_row,
    start,
    walk,
)


def _key(turn):
    return (turn.text, turn.finish, turn.call_id, turn.expression, turn.arguments, turn.usage)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_scripted_walk_every_protocol(protocol):
    p = problem(11, 4)

    async def body(url, client):
        plain = await walk(client, url, protocol, p.question)
        streamed = await walk(client, url, protocol, p.question, stream=True)
        return plain, streamed

    plain, streamed = run_with_server(ScriptedModel(), body)
    assert [_key(t) for t in plain] == [_key(t) for t in streamed]
    assert [t.expression for t in plain[:-1]] == list(p.steps)
    assert all(t.finish == "tool" for t in plain[:-1]) and plain[-1].finish == "stop"
    assert plain[-1].text.splitlines()[-1] == f"A: {p.answer}"
    prefix = {"chat": "call_", "responses": "call_", "messages": "toolu_"}[protocol]
    assert all(t.call_id.startswith(prefix) for t in plain[:-1])


@requires_data
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_replay_walk_over_a_gsm8k_row_every_protocol(protocol):
    row = several_step_row()
    recorded = row["175b_verification"]["solution"]

    async def body(url, client):
        plain = await walk(client, url, protocol, row["question"])
        streamed = await walk(client, url, protocol, row["question"], stream=True)
        return plain, streamed

    plain, streamed = run_with_server(replay_model(), body)
    assert [_key(t) for t in plain] == [_key(t) for t in streamed]
    marks = annotation_matches(recorded)
    assert len(plain) == len(marks) + 1
    assert [t.expression for t in plain[:-1]] == [m.group(1).split("=", 1)[0] for m in marks]
    # The served text is the recording without its annotation markup, ending in the recorded answer.
    assert "".join(t.text for t in plain) == re.sub(r"<<.*?>>", "", recorded, flags=re.DOTALL)
    assert plain[-1].text.splitlines()[-1] == recorded.splitlines()[-1]
    assert re.fullmatch(r"A: -?[\d.,]+", plain[-1].text.splitlines()[-1])
    # Prompt usage grows with the conversation; completion usage counts text and arguments.
    prompts = [t.usage["prompt"] for t in plain]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1]
    for t in plain:
        assert t.usage["completion"] == tokens.count(t.text) + (tokens.count(t.arguments) if t.arguments else 0)


@requires_data
def test_many_concurrent_conversations_share_one_stateless_server():
    rows = gsm8k_rows()[:40]

    async def body(url, client):
        results = {}

        async def one(i, row):
            protocol = PROTOCOLS[i % 3]
            turns = await walk(client, url, protocol, row["question"], stream=bool(i % 2))
            results[i] = turns[-1].text.splitlines()[-1]

        async with trio.open_nursery() as nursery:
            for i, row in enumerate(rows):
                nursery.start_soon(one, i, row)
        return results

    results = run_with_server(replay_model(), body)
    assert results == {i: r["175b_verification"]["solution"].splitlines()[-1] for i, r in enumerate(rows)}


def test_chat_logprobs_and_token_ids():
    p = problem(2, 2)

    async def body(url, client):
        out = []
        for stream in (False, True):
            extra = {
                "stream": stream,
                "logprobs": True,
                "top_logprobs": 2,
                "return_tokens_as_token_ids": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True} if stream else None,
            }
            out.append(await request(client, url, "chat", start("chat", p.question, **extra)))
        return out

    plain, streamed = run_with_server(ScriptedModel(), body)
    for turn in (plain, streamed):
        pieces = tokens.split(turn.text)
        assert [e["token"] for e in turn.logprobs] == [f"token_id:{tokens.token_id(x)}" for x in pieces]
        assert [e["logprob"] for e in turn.logprobs] == [tokens.logprob(x) for x in pieces]
        assert all(len(e["top_logprobs"]) == 2 for e in turn.logprobs)
        assert b"".join(bytes(e["bytes"]) for e in turn.logprobs).decode() == turn.text
        assert turn.usage["completion"] == len(pieces) + tokens.count(turn.arguments)
    choice = plain.raw["choices"][0]
    assert choice["token_ids"] == tokens.ids(plain.text) + tokens.ids(plain.arguments)
    assert len(plain.raw["prompt_token_ids"]) == tokens.count(
        "".join(m["content"] for m in start("chat", p.question)["messages"])
    )
    streamed_ids = [i for c in streamed.raw for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert streamed_ids == choice["token_ids"]
    assert streamed.raw[0]["prompt_token_ids"] == plain.raw["prompt_token_ids"]


def test_responses_logprobs():
    async def body(url, client):
        extra = {"include": ["message.output_text.logprobs"]}
        return [
            await request(client, url, "responses", start("responses", "Hi there", stream=s, **extra))
            for s in (False, True)
        ]

    plain, streamed = run_with_server(ScriptedModel(completion_tokens=5), body)
    for turn in (plain, streamed):
        assert [e["token"] for e in turn.logprobs] == tokens.split(turn.text) and len(turn.logprobs) == 5
    deltas = [d for d in streamed.raw if d["type"] == "response.output_text.delta"]
    assert [d["logprobs"][0]["token"] for d in deltas] == [d["delta"] for d in deltas]


@pytest.mark.parametrize("stream", [False, True])
def test_payload_bytes_in_every_protocol(stream):
    async def body(url, client):
        return [await request(client, url, pr, start(pr, "Say something.", stream=stream)) for pr in PROTOCOLS]

    turns = run_with_server(ScriptedModel(payload_bytes=150_000), body)
    for turn in turns:
        assert len(turn.payload) == 150_000 and turn.payload.isascii()
    assert len({t.payload for t in turns}) == 1
    assert all(t.payload is None for t in run_with_server(ScriptedModel(latency_s=0.001), body))


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_cuts_the_turn(stream):
    p = problem(5, 0)
    keys = {"chat": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}

    async def body(url, client):
        return [
            await request(client, url, pr, start(pr, p.question, stream=stream, **{keys[pr]: 3})) for pr in PROTOCOLS
        ]

    full = ScriptedModel().reply(p.question, 0).text
    for turn in run_with_server(ScriptedModel(), body):
        assert turn.finish == "length" and turn.call_id is None
        assert turn.text == "".join(tokens.split(full)[:3]) and turn.usage["completion"] == 3


@requires_data
def test_without_a_calculator_tool_the_recording_comes_whole():
    row = several_step_row()
    recorded = row["175b_verification"]["solution"]

    async def body(url, client):
        out = [await request(client, url, pr, start(pr, row["question"], tools=False)) for pr in PROTOCOLS]
        chat = start("chat", row["question"], tool_choice="none")
        out.append(await request(client, url, "chat", chat))
        return out

    for turn in run_with_server(replay_model(), body):
        assert turn.finish == "stop" and turn.text == recorded


def _error(protocol, response):
    body = response.json()
    if protocol == "messages":
        assert body["type"] == "error"
    return body["error"]["message"]


BAD = [
    ("chat", b"{not json", "malformed JSON"),
    ("chat", b"[1]", "body must be a JSON object"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}]}', "missing field model"),
    ("chat", b'{"model": "m", "messages": []}', "messages must not be empty"),
    ("chat", b'{"model": "m", "messages": "hi"}', "field messages must be an array"),
    ("chat", b'{"model": "m", "messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role"),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}', "content[0].text"),
    ("chat", b'{"model": "m", "messages": [{"role": "system", "content": "x"}]}', "no user message with text"),
    (
        "chat",
        b'{"model": "m", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}',
        "stream must be a boolean",
    ),
    (
        "chat",
        b'{"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}',
        "max_tokens must be >= 1",
    ),
    (
        "chat",
        b'{"model": "m", "max_tokens": true, "messages": [{"role": "user", "content": "x"}]}',
        "max_tokens must be an integer",
    ),
    ("chat", b'{"model": "m", "top_logprobs": 99, "messages": [{"role": "user", "content": "x"}]}', "top_logprobs"),
    ("chat", b'{"model": "m", "tools": [3], "messages": [{"role": "user", "content": "x"}]}', "tools[0]"),
    ("responses", b'{"model": "m"}', "missing field input"),
    ("responses", b'{"model": "m", "input": 3}', "input must be a string or an array"),
    ("responses", b'{"model": "m", "input": [{"role": "user", "content": [{"text": "x"}]}]}', "input[0].content[0]"),
    ("responses", b'{"model": "m", "input": ["x"]}', "input[0] must be an object"),
    ("responses", b'{"model": "m", "input": "   "}', "no user message with text"),
    ("messages", b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', "missing field max_tokens"),
    (
        "messages",
        b'{"model": "m", "max_tokens": 9, "messages": [{"role": "system", "content": "x"}]}',
        "role must be user or assistant",
    ),
    (
        "messages",
        b'{"model": "m", "max_tokens": 9, "system": 3, "messages": [{"role": "user", "content": "x"}]}',
        "field system",
    ),
    (
        "messages",
        b'{"model": 1, "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}',
        "model must be a string",
    ),
]


def test_malformed_requests_are_400_with_a_reason():
    async def body(url, client):
        for protocol, raw, reason in BAD:
            r = await client.post(url + PATHS[protocol], content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (protocol, raw, r.text)
            assert reason in _error(protocol, r), (protocol, raw, r.text)

    run_with_server(ScriptedModel(), body)


@requires_data
def test_replay_refusals_are_400():
    question = several_step_row()["question"]
    steps = len(annotation_matches(several_step_row()["175b_verification"]["solution"]))

    async def body(url, client):
        for protocol in PROTOCOLS:
            r = await client.post(url + PATHS[protocol], json=start(protocol, "What is the capital of Mars?"))
            assert r.status_code == 400 and "unknown question" in _error(protocol, r)
        too_many = start("chat", question)
        too_many["messages"] += [{"role": "tool", "tool_call_id": "x", "content": "1"}] * (steps + 1)
        r = await client.post(url + PATHS["chat"], json=too_many)
        assert r.status_code == 400 and "calculator steps" in _error("chat", r)

    run_with_server(replay_model(), body)


def test_routes_methods_and_body_limit():
    async def main():
        import httpx

        async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
            address = await nursery.start(serve, build_app(ScriptedModel(name="tiny"), max_body_bytes=1000))
            url = f"http://{address}"
            r = await client.get(url + "/v1/models")
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
            r = await client.post(url + "/v1/models")
            assert r.status_code == 405 and r.headers["allow"] == "GET"
            r = await client.get(url + "/v1/messages")
            assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["type"] == "error"
            r = await client.post(url + "/v2/chat", json={})
            assert r.status_code == 404 and "no endpoint POST /v2/chat" in r.json()["error"]["message"]
            big = start("messages", "x" * 2000)
            r = await client.post(url + "/v1/messages", json=big)
            assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
            r = await client.post(url + "/v1/chat/completions/", json=start("chat", "hi"))
            assert r.status_code == 200 and orjson.loads(r.content)["model"] == "m"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_leaving_mid_stream_stops_the_stream(monkeypatch):
    from lowwater.serve_model import app as app_module

    rendered, finished = [0], trio.Event()
    original = app_module.PROTOCOLS["/v1/chat/completions"]

    def counting(r):
        try:
            for data in original[3](r):
                rendered[0] += 1
                yield data
        finally:
            finished.set()

    monkeypatch.setitem(app_module.PROTOCOLS, "/v1/chat/completions", (*original[:3], counting))
    total = 200_000

    async def body(url, client):
        # A raw socket: httpx's nested async generators warn when a stream is abandoned on Trio.
        host, port = url.removeprefix("http://").rsplit(":", 1)
        payload = orjson.dumps(start("chat", "hi", stream=True))
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await stream.aclose()
        with trio.fail_after(30):
            await finished.wait()
        # The server still answers afterwards.
        return await request(client, url, "chat", start("chat", "hi"))

    after = run_with_server(ScriptedModel(completion_tokens=total), body)
    assert rendered[0] < total / 2 and tokens.count(after.text) == total
