"""Whatever ``lowwater proxy`` accepts it can write; one rollout that cannot be
written is reported, and the others are written.

orjson parses 1,024 levels of nesting but writes at most 254.  A request
nesting 300 levels was accepted: then its ``DELETE`` answered 500 and the
trajectory was dropped unwritten, an export answered 500 after removing every
session it named, the proxy exited 1 at shutdown without writing the rollouts
still open, and with ``--model`` the call itself was a bare 500.  Now such a
request is refused at intake (400 naming the limit), an answer nesting too
deep is recorded as an error, and each write is on its own.
"""

from __future__ import annotations

import functools

import orjson
import pytest
import trio

from lowwater.http import MAX_JSON_DEPTH, lifespan, send_bytes
from lowwater.interception import server as server_module

from ._harness import body
from ._proxy import with_proxy


def nested(levels: int) -> bytes:
    """A JSON array nesting ``levels`` levels (as bytes: orjson cannot write it past 254)."""
    return b"[" * levels + b"]" * levels


def chat_nesting(levels: int) -> bytes:
    """A chat request whose whole document nests ``levels`` levels (body, messages, message, then arrays)."""
    return b'{"model": "m", "messages": [{"role": "user", "content": "hi", "x": %s}]}' % nested(levels - 3)


async def _open(http, url, rollout_id):
    r = await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": rollout_id})
    assert r.status_code == 200, r.text
    return r.json()


async def _post(http, opened, content: bytes, path="/chat/completions"):
    return await http.post(
        opened["base_url"] + path,
        content=content,
        headers={"authorization": f"Bearer {opened['api_key']}", "content-type": "application/json"},
    )


def lines(tmp_path) -> dict[str, dict]:
    path = tmp_path / "trajectories.jsonl"
    return {line["rollout_id"]: line for line in map(orjson.loads, path.read_bytes().splitlines())}


@pytest.mark.parametrize("model", [None, "renamed"], ids=["raw", "model-override"])
def test_a_request_nesting_past_the_limit_is_refused_and_the_rollout_written(tmp_path, model):
    async def fn(url, http):
        opened = await _open(http, url, "r")
        assert (await _post(http, opened, chat_nesting(MAX_JSON_DEPTH))).status_code == 200
        for levels in (MAX_JSON_DEPTH + 1, 300, 1000):
            r = await _post(http, opened, chat_nesting(levels))
            assert r.status_code == 400, r.text
            assert f"nests deeper than {MAX_JSON_DEPTH} levels" in r.json()["error"]["message"]
        r = await http.delete(f"{url}/lowwater/rollouts/r")
        assert r.status_code == 200 and r.json()["turns"] == 1
        assert (await http.post(f"{url}/lowwater/sessions/r/reward", json={"reward": 1})).status_code == 200
        r = await http.post(f"{url}/lowwater/export", json={"session_ids": ["r"]})
        assert r.status_code == 200 and len(r.json()["records"]) == 1 and r.json()["failed"] == {}

    trio.run(functools.partial(with_proxy, tmp_path, fn, model=model))
    assert len(lines(tmp_path)["r"]["turns"]) == 1


def test_an_answer_nesting_past_the_limit_is_recorded_as_an_error(tmp_path):
    deep_answer = (
        b'{"id": "c", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", '
        b'"message": {"role": "assistant", "content": "hi", "x": %s}}]}' % nested(300)
    )

    async def upstream(scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        elif scope["type"] == "http":
            while (await receive()).get("more_body"):
                pass
            await send_bytes(send, 200, deep_answer, "application/json")

    async def fn(url, http):
        opened = await _open(http, url, "r")
        r = await _post(http, opened, orjson.dumps(body("chat")))
        assert r.status_code == 200  # the agent gets the answer as the upstream sent it
        assert (await http.delete(f"{url}/lowwater/rollouts/r")).status_code == 200

    trio.run(with_proxy, tmp_path, fn, upstream)
    (turn,) = lines(tmp_path)["r"]["turns"]
    assert turn["completion"] is None and f"nests deeper than {MAX_JSON_DEPTH}" in turn["error"]


def test_each_write_is_on_its_own(tmp_path, monkeypatch):
    # Past intake (as a bug or a protocol plugin might let it: the data plane
    # refuses such a request, so the turn is made deep after it): the write
    # steps must still isolate the one bad rollout and session.
    read_record = server_module.read_record

    def deep_for_bad(record, trajectory, protocols=None):
        turn, verdict = read_record(record, trajectory, protocols)
        if record.rollout_id.startswith("bad"):
            turn.request_delta = orjson.loads(chat_nesting(300))["messages"]
        return turn, verdict

    monkeypatch.setattr(server_module, "read_record", deep_for_bad)
    results = {}

    async def fn(url, http):
        opened = {rid: await _open(http, url, rid) for rid in ("a", "bad", "b", "bad-open", "c")}
        for rid, o in opened.items():
            content = orjson.dumps(body("chat", f"hi {rid}"))
            assert (await _post(http, o, content)).status_code == 200
        r = await http.delete(f"{url}/lowwater/rollouts/bad")
        assert r.status_code == 500 and "rollout bad" in r.json()["error"], r.text
        assert (await http.delete(f"{url}/lowwater/rollouts/a")).status_code == 200
        for rid in ("a", "bad"):
            assert (await http.post(f"{url}/lowwater/sessions/{rid}/reward", json={"reward": 1})).status_code == 200
        r = await http.post(f"{url}/lowwater/export", json={"session_ids": ["a", "bad"]})
        assert r.status_code == 200, r.text
        results["export"] = r.json()
        sessions = (await http.get(f"{url}/lowwater/sessions")).json()
        results["ready"] = sessions["ready_ids"]
        # "b", "bad-open" and "c" are still open: shutdown writes each.

    trio.run(with_proxy, tmp_path, fn)
    assert [rec["session_id"] for rec in results["export"]["records"]] == ["a"]
    assert list(results["export"]["failed"]) == ["bad"] and results["ready"] == ["bad"]
    written = lines(tmp_path)
    assert sorted(written) == ["a", "b", "bad", "bad-open", "c"]
    for rid in ("bad", "bad-open"):
        assert written[rid]["turns"] is None and "could not be encoded" in written[rid]["error"]
    for rid in ("a", "b", "c"):
        assert written[rid]["turns"][0]["request_delta"][0]["content"] == f"hi {rid}"
