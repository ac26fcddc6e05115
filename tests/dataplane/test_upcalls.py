"""Upcalls of the Rust data plane served by :mod:`lowwater.interception.upcalls`:
interceptor hooks that rewrite or refuse a call before it is forwarded, and
Python routes served by an ASGI app through the shim.  After each, no upcall
is left pending (``stats()["pending_upcalls"] == 0``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from dataplane.test_binding import CHAT, GUARD_S, Rig
from interception.upstream import Upstream
from lowwater._native import DataPlane, DataPlaneClosed, DataPlaneConfigError, InterceptTable, TurnRecord, Upcall
from lowwater.http import HTTPError, Router, read_body, send_json, serve
from lowwater.interception.dataplane import serve_records, turn_of
from lowwater.interception.hooks import InterceptedCall, Interceptors, Reject
from lowwater.interception.upcalls import Intercept, run_interceptors, serve_upcalls
from lowwater.trajectory import Trajectory


@asynccontextmanager
async def rig(*, app: Any = None, hook: Intercept | None = None, **options: Any) -> AsyncIterator[Rig]:
    """The plane (``options``) against the scripted upstream, with records and
    upcalls (``app``, ``hook``) served."""
    upstream = Upstream()
    trajectories: dict[str, Trajectory] = {}
    records: list[TurnRecord] = []

    def on_record(record: TurnRecord) -> None:
        records.append(record)
        trajectory = trajectories.get(record.rollout_id)
        if trajectory is not None:
            trajectory.add_turn(turn_of(record, trajectory))

    plane: DataPlane | None = None
    try:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, upstream)
            plane = DataPlane(f"http://{address}/v1", api_key="upstream-key", **options)
            nursery.start_soon(serve_records, plane, on_record)
            nursery.start_soon(lambda: serve_upcalls(plane, app=app, intercept=hook))
            try:
                async with httpx.AsyncClient(timeout=GUARD_S) as http:
                    with trio.fail_after(GUARD_S):
                        yield Rig(plane, upstream, http, trajectories, records)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if plane is not None:
            plane.close()


def run(fn: Any, **options: Any) -> None:
    async def main() -> None:
        async with rig(**options) as r:
            await fn(r)

    trio.run(main)


async def settled(r: Rig) -> dict[str, int]:
    stats = await r.settled()
    assert stats["pending_upcalls"] == 0, stats
    assert stats["in_flight"] == 0, stats
    return stats


def hooks(fn: Any) -> Intercept:
    """An intercept callback running one ``intercept_request`` implementation."""
    return run_interceptors(Interceptors([("test-plugin", fn, ("call",))], []))


async def redact(call: InterceptedCall) -> None:
    for message in call.body["messages"]:
        message["content"] = message["content"].replace("ann@example.com", "<email>")


def test_a_hook_rewrites_the_body_the_upstream_and_the_turn_see() -> None:
    async def fn(r: Rig) -> None:
        trajectory = r.open("r0", "s0")
        answer = await r.chat("s0", [{"role": "user", "content": "mail ann@example.com"}])
        assert answer.status_code == 200, answer.text
        _, _, sent = r.upstream.received[-1]
        assert sent["messages"] == [{"role": "user", "content": "mail <email>"}]
        # The next call appends to what was sent, not to what the agent wrote.
        history = [
            {"role": "user", "content": "mail ann@example.com"},
            answer.json()["choices"][0]["message"],
            {"role": "user", "content": "thanks ann@example.com"},
        ]
        assert (await r.chat("s0", history)).status_code == 200
        stats = await settled(r)
        assert (stats["upcalls"], stats["ok"]) == (2, 2)
        first, second = trajectory.turns
        assert first.request_delta == [{"role": "user", "content": "mail <email>"}]
        assert second.request_delta_start == 1, "the forwarded first message is kept: no rewrite"
        assert second.request_delta[-1] == {"role": "user", "content": "thanks <email>"}

    run(fn, hook=hooks(redact), intercept=True)


def test_a_hook_rewrites_a_body_read_into_the_tables_memory() -> None:
    # Over the table's mmap threshold the body is read into the table's own
    # memory and handed to the hook from there; the rewrite is what is held
    # and forwarded, and nothing of either is left after the call.
    table = InterceptTable()
    filler = "z" * (2 << 20)

    async def fn(r: Rig) -> None:
        trajectory = r.open("r0", "s0")
        answer = await r.chat("s0", [{"role": "user", "content": f"mail ann@example.com {filler}"}])
        assert answer.status_code == 200, answer.text
        _, _, sent = r.upstream.received[-1]
        assert sent["messages"] == [{"role": "user", "content": f"mail <email> {filler}"}]
        stats = await settled(r)
        assert (stats["upcalls"], stats["ok"]) == (1, 1)
        (turn,) = trajectory.turns
        assert turn.request_delta == [{"role": "user", "content": f"mail <email> {filler}"}]
        assert (len(table), table.stats()["live_bytes"]) == (0, 0)

    run(fn, hook=hooks(redact), intercept=True, table=table)


def test_reject_gives_the_protocols_error_body_and_records_nothing() -> None:
    async def refuse(call: InterceptedCall) -> None:
        if call.body.get("model") == "boom":
            raise RuntimeError("kaput")
        raise Reject(403, f"no calls for {call.protocol}")

    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        refused = await r.chat("s0", [{"role": "user", "content": "hi"}])
        assert refused.status_code == 403
        assert refused.json()["error"]["message"] == "no calls for openai.chat"
        anthropic = await r.http.post(
            r.base_url + "/messages",
            json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "s0"},
        )
        assert anthropic.status_code == 403
        body = anthropic.json()
        assert (body["type"], body["error"]["message"]) == ("error", "no calls for anthropic.messages")
        broken = await r.http.post(
            r.base_url + CHAT,
            json={"model": "boom", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer s0"},
        )
        assert broken.status_code == 500
        assert "test-plugin" in broken.json()["error"]["message"]
        stats = await settled(r)
        assert (stats["refused"], stats["ok"], stats["upcalls"]) == (3, 0, 3)
        assert r.records == [] and r.upstream.received == []

    run(fn, hook=hooks(refuse), intercept=True)


def test_a_broken_rewrite_is_a_400_naming_it() -> None:
    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        answer = await r.chat("s0", [{"role": "user", "content": "hi"}])
        assert answer.status_code == 400
        assert "model" in answer.json()["error"]["message"]
        await settled(r)
        assert r.records == [] and r.upstream.received == []

    async def break_it(upcall: Upcall) -> bytes:
        return orjson.dumps({"model": 3, "messages": []})

    run(fn, hook=break_it, intercept=["openai.chat"])


def admin_app() -> Router:
    router = Router()

    async def stats(scope: Any, receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        if headers.get(b"x-admin-key") != b"k":
            raise HTTPError(401, "admin key required")
        await send_json(send, 200, {"path": scope["path"], "query": scope["query_string"].decode()})

    async def open_rollout(scope: Any, receive: Any, send: Any) -> None:
        body = orjson.loads(await read_body(scope, receive, 1 << 20))
        await send_json(send, 201, {"opened": scope["path_params"]["rid"], "body": body}, [("x-lowwater", "yes")])

    router.add("GET", "/lowwater/stats", stats)
    router.add("POST", "/lowwater/rollouts/{rid}", open_rollout)
    return router


def test_python_routes_are_served_by_an_asgi_app_through_the_shim() -> None:
    async def fn(r: Rig) -> None:
        base = f"http://{r.plane.address}"
        got = await r.http.get(base + "/lowwater/stats?x=1", headers={"x-admin-key": "k"})
        assert got.status_code == 200, got.text
        assert got.json() == {"path": "/lowwater/stats", "query": "x=1"}
        assert (await r.http.get(base + "/lowwater/stats")).status_code == 401
        opened = await r.http.post(base + "/lowwater/rollouts/a%20b", json={"n": 1})
        assert opened.status_code == 201
        assert opened.json() == {"opened": "a b", "body": {"n": 1}}
        assert opened.headers["x-lowwater"] == "yes"
        # The app's own 404 under the prefix; the plane's outside it.
        assert (await r.http.get(base + "/lowwater/nothing")).status_code == 404
        outside = await r.http.get(base + "/elsewhere")
        assert outside.status_code == 404 and "no route" in outside.json()["error"]["message"]
        stats = await settled(r)
        assert stats["upcalls"] == 4

    run(fn, app=admin_app(), python_routes=["/lowwater/"])


def test_unregister_during_a_pending_upcall_is_410_and_leaves_nothing() -> None:
    entered = trio.Event()
    release = trio.Event()

    async def slow(upcall: Upcall) -> None:
        entered.set()
        await release.wait()

    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        answers: list[httpx.Response] = []

        async def call() -> None:
            answers.append(await r.chat("s0", [{"role": "user", "content": "hi"}]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await entered.wait()
            assert r.plane.stats()["pending_upcalls"] == 1
            assert r.close("r0") == 1
            assert r.plane.stats()["pending_upcalls"] == 0
        assert answers[0].status_code == 410
        assert "closed" in answers[0].json()["error"]["message"]
        release.set()  # the hook finishes: its resume is a no-op
        await trio.testing.wait_all_tasks_blocked()
        stats = await settled(r)
        assert (stats["closed"], stats["queued"], stats["open_rollouts"]) == (1, 0, 0)
        assert r.records == [] and r.upstream.received == []

    run(fn, hook=slow, intercept=True)


def test_a_client_that_leaves_during_a_pending_upcall_leaves_nothing() -> None:
    entered = trio.Event()

    async def never(upcall: Upcall) -> None:
        entered.set()
        await trio.sleep_forever()

    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(r.chat, "s0", [{"role": "user", "content": "leave"}])
            await entered.wait()
            assert r.plane.stats()["pending_upcalls"] == 1
            nursery.cancel_scope.cancel()  # the agent gives up
        while r.plane.stats()["pending_upcalls"]:
            await trio.sleep(0.01)
        await settled(r)
        assert r.records == [] and r.upstream.received == []

    run(fn, hook=never, intercept=True)


def test_stopping_the_control_plane_answers_its_upcalls_503() -> None:
    async def main() -> None:
        entered = trio.Event()

        async def never(upcall: Upcall) -> None:
            entered.set()
            await trio.sleep_forever()

        with DataPlane("http://127.0.0.1:9/v1", intercept=True, hold_for_ack=False) as plane:
            plane.register("r0", "s0")
            async with httpx.AsyncClient(timeout=GUARD_S) as http, trio.open_nursery() as nursery:
                upcalls = trio.CancelScope()
                nursery.start_soon(_until, upcalls, lambda: serve_upcalls(plane, intercept=never))
                answer = None

                async def call() -> None:
                    nonlocal answer
                    answer = await http.post(
                        f"http://{plane.address}/v1{CHAT}",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"authorization": "Bearer s0"},
                    )

                nursery.start_soon(call)
                with trio.fail_after(GUARD_S):
                    await entered.wait()
                    upcalls.cancel()
                while answer is None:
                    await trio.sleep(0.01)
                assert answer.status_code == 503
                assert "control plane stopped" in answer.json()["error"]["message"]
            assert plane.stats()["pending_upcalls"] == 0

    trio.run(main)


async def _until(scope: trio.CancelScope, fn: Any) -> None:
    with scope:
        await fn()


def test_closing_the_plane_answers_a_pending_upcall() -> None:
    async def main() -> None:
        plane = DataPlane("http://127.0.0.1:9/v1", intercept=True, hold_for_ack=False)
        plane.register("r0", "s0")
        outcome: list[Any] = []
        async with httpx.AsyncClient(timeout=GUARD_S) as http, trio.open_nursery() as nursery:

            async def call() -> None:
                try:
                    outcome.append(
                        await http.post(
                            f"http://{plane.address}/v1{CHAT}",
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                            headers={"authorization": "Bearer s0"},
                        )
                    )
                except httpx.TransportError as exc:  # the runtime stopped before the 503 was written
                    outcome.append(exc)

            nursery.start_soon(call)
            with trio.fail_after(GUARD_S):
                while plane.stats()["pending_upcalls"] == 0:
                    await trio.sleep(0.01)
                await trio.to_thread.run_sync(plane.close)
        (got,) = outcome
        assert isinstance(got, httpx.TransportError) or got.status_code == 503
        with pytest.raises(DataPlaneClosed):
            plane.stats()
        with pytest.raises(DataPlaneClosed):
            plane.resume(0)

    trio.run(main)


def test_option_errors() -> None:
    with pytest.raises(DataPlaneConfigError, match="nope"):
        DataPlane("http://127.0.0.1:9/v1", intercept=["nope"])
    with pytest.raises(DataPlaneConfigError, match="start with"):
        DataPlane("http://127.0.0.1:9/v1", python_routes=["lowwater"])
    with pytest.raises(TypeError):
        DataPlane("http://127.0.0.1:9/v1", intercept="openai.chat")  # a str is not a list of names
    with DataPlane("http://127.0.0.1:9/v1", intercept=["openai.chat"], python_routes=["/"]) as plane:
        assert plane.drain_upcalls() == []
        assert plane.resume(12) is False
        with pytest.raises(ValueError, match="400-599|not allowed"):
            plane.reject(12, 200, "x")
        with pytest.raises(ValueError, match="not allowed"):
            plane.respond(12, 100, [])
        assert plane.stats()["pending_upcalls"] == 0


def test_unusable_answers_are_500s_and_the_loop_goes_on() -> None:
    async def text(upcall: Upcall) -> Any:
        return "not bytes"

    async def informational(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 101, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        for _ in range(2):  # the second proves serve_upcalls survived the first
            answer = await r.chat("s0", [{"role": "user", "content": "hi"}])
            assert answer.status_code == 500 and "unusably" in answer.json()["error"]["message"]
            routed = await r.http.get(f"http://{r.plane.address}/lowwater/x")
            assert routed.status_code == 500 and "unusable" in routed.json()["error"]
        await settled(r)

    run(fn, hook=text, app=informational, intercept=True, python_routes=["/lowwater"])
