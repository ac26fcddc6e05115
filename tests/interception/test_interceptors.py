"""Interceptor hooks: intercept_request changes what goes upstream and what the
turn records, Reject refuses with the protocol's error body, hooks run in
registration order one at a time, intercept_response sees the answer read-only,
and a server without interceptors never enters the path."""

from __future__ import annotations

import orjson
import pytest
import trio
import trio.lowlevel

from lowwater.hookspecs import hookimpl
from lowwater.interception import Reject
from lowwater.plugins import Plugins, load

from ._harness import KINDS, body, read_sse, run


class Redact:
    @hookimpl
    async def intercept_request(self, call):
        call.state["order"] = ["redact"]
        # chat and anthropic: "messages"; responses: "input" (a list of messages here).
        for message in call.body.get("messages") or call.body.get("input") or []:
            if isinstance(message.get("content"), str):
                message["content"] = message["content"].replace("secret-42", "<redacted>")


class Refuse:
    @hookimpl
    async def intercept_request(self, call):
        call.state["order"].append("refuse")
        await trio.lowlevel.checkpoint()  # the next hook still waits for this one
        if "forbidden" in orjson.dumps(call.body).decode():
            raise Reject(403, "this agent may not ask that")


class Meter:
    def __init__(self):
        self.seen = []

    @hookimpl
    async def intercept_response(self, call, response):
        self.seen.append((call.rollout_id, call.protocol, call.state["order"], response))


def _interceptors(*plugins):
    return load(disabled=_all_entry_points(), extra=[(f"p{i}", p) for i, p in enumerate(plugins)]).interceptors()


def _all_entry_points():
    import importlib.metadata

    return {ep.name for ep in importlib.metadata.entry_points(group="lowwater")}


def test_none_when_no_plugin_implements_them():
    assert load(disabled=_all_entry_points()).interceptors() is None


def test_order_is_registration_order_after_tryfirst_and_before_trylast():
    def plugin(mark):
        class P:
            @hookimpl(**mark)
            async def intercept_request(self, call):
                pass

        return P()

    marks = [{"trylast": True}, {}, {"tryfirst": True}, {}, {"tryfirst": True}]
    interceptors = _interceptors(*(plugin(m) for m in marks))
    assert [name for name, _, _ in interceptors.requests] == ["p2", "p4", "p1", "p3", "p0"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_redact_forwards_and_records_the_changed_body(kind, stream):
    meter = Meter()

    async def fn(h):
        h.server.interceptors = _interceptors(Redact(), Refuse(), meter)
        slot, trajectory = h.open("r1")
        r = await h.call(slot, kind, body(kind, "my key is secret-42", stream=stream))
        assert r.status_code == 200
        if stream:
            await read_sse(r)
        _path, _headers, sent = h.upstream.received[-1]
        sent = orjson.dumps(sent)
        assert b"secret-42" not in sent and b"<redacted>" in sent
        (turn,) = trajectory.turns
        assert "secret-42" not in orjson.dumps(turn.request_delta).decode()
        await h.assert_clean()
        ((rollout_id, protocol, order, response),) = meter.seen
        assert rollout_id == "r1" and protocol == turn.protocol and order == ["redact", "refuse"]
        assert response.usage is not None and response.completion == turn.completion
        with pytest.raises(TypeError):
            response.usage["input_tokens"] = 0  # read-only

    run(fn)


class SeeHeaders:
    def __init__(self):
        self.seen = []

    @hookimpl
    async def intercept_request(self, call):
        self.seen.append(call.headers)

    @hookimpl
    async def intercept_response(self, call, response):
        self.seen.append(call.headers)


@pytest.mark.parametrize("auth", ["bearer", "x-api-key"])
def test_hooks_see_the_agents_headers_but_never_its_secret(auth):
    see = SeeHeaders()
    secrets = []

    async def fn(h):
        h.server.interceptors = _interceptors(see)
        slot, _trajectory = h.open("r1")
        secrets.append(slot.secret)
        key = {"authorization": f"Bearer {slot.secret}"} if auth == "bearer" else {"x-api-key": slot.secret}
        headers = [*key.items(), ("user-agent", "agent/1.0"), ("x-trace", "a"), ("x-trace", "b")]
        r = await h.http.post(slot.base_url + "/chat/completions", json=body("chat"), headers=headers)
        assert r.status_code == 200
        await h.assert_clean()

    run(fn)
    request_headers, response_headers = see.seen
    assert response_headers is request_headers, "intercept_response gets the same call"
    assert request_headers["user-agent"] == "agent/1.0"
    assert request_headers["x-trace"] == "a, b", "repeated values joined in order"
    assert request_headers["content-type"] == "application/json"
    assert "authorization" not in request_headers and "x-api-key" not in request_headers
    assert not any(secrets[0] in v for v in request_headers.values())
    with pytest.raises(TypeError):
        request_headers["x-trace"] = "c"  # read-only


@pytest.mark.parametrize("kind", KINDS)
def test_reject_answers_with_the_protocols_error_body(kind):
    async def fn(h):
        h.server.interceptors = _interceptors(Redact(), Refuse())
        slot, trajectory = h.open("r1")
        sent_before = len(h.upstream.received)
        r = await h.call(slot, kind, body(kind, "something forbidden"))
        assert r.status_code == 403
        error = r.json()
        if kind == "messages":
            assert error["type"] == "error" and error["error"]["message"] == "this agent may not ask that"
        else:
            assert error["error"]["message"] == "this agent may not ask that"
        assert len(h.upstream.received) == sent_before  # nothing went upstream
        assert trajectory.turns == []
        await h.assert_clean()

    run(fn)


def test_a_failing_interceptor_fails_closed_naming_the_plugin():
    class Broken:
        @hookimpl
        async def intercept_request(self, call):
            raise RuntimeError("boom")

    async def fn(h):
        h.server.interceptors = _interceptors(Broken())
        slot, _ = h.open("r1")
        r = await h.call(slot, "chat", body("chat", "hello"))
        assert r.status_code == 500 and "interceptor 'p0' failed: RuntimeError: boom" in r.text
        await h.assert_clean()

    run(fn)


def test_ordered_hooks_are_not_fired_as_lifecycle_hooks():
    from lowwater.plugins import PluginError

    plugins = Plugins()
    with pytest.raises(PluginError, match="not a lifecycle hook"):
        trio.run(lambda: plugins.fire_hooks("intercept_request", call=None))


def test_reject_status_is_checked():
    with pytest.raises(ValueError):
        Reject(200, "ok")


class Listen:
    """Only a response hook: no request hook hands it the call first."""

    def __init__(self):
        self.seen = []

    @hookimpl
    async def intercept_response(self, call, response):
        self.seen.append((call.rollout_id, call.protocol, call.body, response.completion))


@pytest.mark.parametrize("kind", KINDS)
def test_a_plugin_with_only_a_response_hook_sees_every_recorded_call(kind):
    listen = Listen()

    async def fn(h):
        h.server.interceptors = _interceptors(listen)
        slot, trajectory = h.open("only")
        sent = body(kind, "hello there")
        assert (await h.call(slot, kind, sent)).status_code == 200
        assert (await h.call(slot, kind, body(kind, "again"))).status_code == 200
        assert len(trajectory.turns) == 2
        assert [(r, body_) for r, _p, body_, _c in listen.seen][0] == ("only", sent)
        assert len(listen.seen) == 2 and all(c is not None for *_, c in listen.seen)
        assert h.upstream.received[0][2] == sent  # forwarded as sent: no hook rewrote it
        h.server.unregister("only")
        await h.assert_clean()
        assert h.server._intercepted == {}

    run(fn)


def test_the_call_state_kept_for_response_hooks_is_dropped_on_every_path():
    """The ``InterceptedCall`` a call's request hooks saw is kept for its
    ``intercept_response`` (by request id) until its record: answered,
    failed upstream and unregistered mid-call all leave none behind."""
    meter = Meter()

    async def fn(h):
        h.server.interceptors = _interceptors(Redact(), Refuse(), meter)
        slot, trajectory = h.open("ok")
        assert (await h.call(slot, "chat", body("chat"))).status_code == 200
        h.upstream.statuses.extend([500])  # one failure, no retry: an error turn
        assert (await h.call(slot, "chat", body("chat", "again"))).status_code == 502
        assert [t.error for t in trajectory.turns] == [None, "upstream answered 500"]
        h.upstream.hang = True
        waiting, _ = h.open("closed")

        async def call():
            assert (await h.call(waiting, "chat", body("chat"))).status_code == 410

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            with trio.fail_after(20):  # a guard, not a timing assertion
                while h.server.stats()["waiting_handlers"] == 0:
                    await trio.sleep(0.01)
            assert len(h.server._intercepted) == 1  # the waiting call's
            h.server.unregister("closed")
        await h.assert_clean()
        assert h.server._intercepted == {}
        assert len(meter.seen) == 2  # both recorded calls reached intercept_response

    run(fn, client={"retries": 0})
