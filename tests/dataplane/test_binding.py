"""The Rust data plane through its binding (``lowwater._native.DataPlane``) and
its Trio control-plane loop (``lowwater.interception.dataplane``).

The scripted upstream of the interception tests serves on Trio in this
thread; the plane serves the agent's calls on its own tokio threads and
hands records to :func:`serve_records`, which must keep running for any
answer to complete (the plane holds each call's last bytes until its record
is acked).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import openai
import orjson
import pytest
import trio
import trio.testing

from interception.upstream import Upstream
from lowwater._native import (
    DataPlane,
    DataPlaneClosed,
    DataPlaneConfigError,
    DuplicateRollout,
    DuplicateSecret,
    InterceptTable,
    LowwaterError,
    TurnRecord,
)
from lowwater.http import serve
from lowwater.interception.dataplane import serve_records, turn_of
from lowwater.trajectory import Trajectory

# A guard against a hang, not a timing assertion.
GUARD_S = 20
CHAT = "/chat/completions"


def plane_threads() -> int:
    """The data plane's own threads in this process (tokio names them; comm is cut at 15 chars)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().startswith("lowwater-datapl")
        except FileNotFoundError:
            pass  # the thread exited meanwhile
    return n


def plane_threads_back_to(before: int) -> int:
    """``plane_threads()`` once it has fallen to ``before`` (or after a guard).

    ``close()`` has joined the threads when it returns, but the kernel clears
    a thread's tid (what the join waits for) a moment before its
    ``/proc/self/task`` entry goes away.
    """
    for _ in range(GUARD_S * 100):
        if (n := plane_threads()) <= before:
            return n
        time.sleep(0.01)
    return plane_threads()


@attrs.define
class Rig:
    plane: DataPlane
    upstream: Upstream
    http: httpx.AsyncClient
    trajectories: dict[str, Trajectory]
    records: list[TurnRecord]

    @property
    def base_url(self) -> str:
        return f"http://{self.plane.address}/v1"

    def open(self, rollout_id: str, secret: str) -> Trajectory:
        trajectory = Trajectory(rollout_id)
        self.trajectories[rollout_id] = trajectory
        self.plane.register(rollout_id, secret)
        return trajectory

    def close(self, rollout_id: str) -> int:
        cancelled = self.plane.unregister(rollout_id)
        del self.trajectories[rollout_id]  # later records of it are acked, not recorded
        return cancelled

    async def chat(self, secret: str, messages: list[Any], **extra: Any) -> httpx.Response:
        body = {"model": "m", "messages": messages, **extra}
        return await self.http.post(self.base_url + CHAT, json=body, headers={"authorization": f"Bearer {secret}"})

    async def settled(self) -> dict[str, int]:
        """The plane's stats once no call is running (calls end on its threads,
        a moment after the client has its answer)."""
        while True:
            await trio.testing.wait_all_tasks_blocked()
            stats = self.plane.stats()
            if stats["active_calls"] == 0 and stats["queued"] == 0:
                return stats
            await trio.sleep(0.01)


@asynccontextmanager
async def rig(**options: Any) -> AsyncIterator[Rig]:
    upstream = Upstream()
    trajectories: dict[str, Trajectory] = {}
    records: list[TurnRecord] = []

    def on_record(record: TurnRecord) -> None:
        # Each call has its own id (the key its body was held under).
        assert record.request_id and all(r.request_id != record.request_id for r in records)
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
            try:
                async with httpx.AsyncClient(timeout=GUARD_S) as http:
                    with trio.fail_after(GUARD_S):
                        yield Rig(plane, upstream, http, trajectories, records)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        # Once the loop has exited: close() closes the fd it waits on.
        if plane is not None:
            plane.close()


def run(fn: Any, **options: Any) -> None:
    async def main() -> None:
        async with rig(**options) as r:
            await fn(r)

    trio.run(main)


def sse_text(raw: bytes) -> tuple[str, list[bytes]]:
    """The streamed chat answer's text and its raw events."""
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    text = ""
    for event in events:
        data = event.removeprefix(b"data: ")
        if data != b"[DONE]":
            for choice in orjson.loads(data)["choices"]:
                text += choice["delta"].get("content") or ""
    return text, events


def test_chat_calls_become_turns_with_message_deltas() -> None:
    async def fn(r: Rig) -> None:
        trajectory = r.open("r0", "s0")
        first = [{"role": "user", "content": "what is 2 plus 2"}]
        answer = await r.chat("s0", first)
        assert answer.status_code == 200, answer.text
        reply = answer.json()["choices"][0]["message"]
        assert reply["content"] == "echo: what is 2 plus 2"

        second = [*first, reply, {"role": "user", "content": "and 3 plus 3"}]
        async with r.http.stream(
            "POST",
            r.base_url + CHAT,
            json={"model": "m", "messages": second, "stream": True},
            headers={"authorization": "Bearer s0"},
        ) as streamed:
            assert streamed.status_code == 200
            raw = b"".join([chunk async for chunk in streamed.aiter_bytes()])
        text, events = sse_text(raw)
        assert text == "echo: and 3 plus 3"
        assert events[-1] == b"data: [DONE]"

        rewritten = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert (await r.chat("s0", rewritten)).status_code == 200

        stats = await r.settled()
        assert [t.request_delta for t in trajectory.turns] == [first, second[1:], rewritten]
        assert [t.request_delta_start for t in trajectory.turns] == [0, 1, 0]
        assert [t.streamed for t in trajectory.turns] == [False, True, False]
        assert {t.protocol for t in trajectory.turns} == {"openai.chat"}
        assert all(t.model == "m" and t.error is None and t.duration_s >= 0 for t in trajectory.turns)
        # The answer's fields, read from the record's bytes by the protocol, as the Python server reads them.
        assert trajectory.turns[0].completion == reply
        assert trajectory.turns[1].completion == {"role": "assistant", "content": "echo: and 3 plus 3"}
        assert all(t.finish_reason is not None for t in trajectory.turns)
        assert trajectory.turns[0].usage == answer.json().get("usage")
        assert [(rec.kept, rec.previous, rec.status) for rec in r.records] == [(0, 0, 200), (1, 1, 200), (0, 3, 200)]
        assert r.records[1].response.rstrip().endswith(b"data: [DONE]")
        assert orjson.loads(r.records[0].response)["choices"][0]["message"] == reply
        # The upstream got the plane's key, not the rollout's secret.
        assert {h["authorization"] for _, h, _ in r.upstream.received} == {"Bearer upstream-key"}
        assert stats["ok"] == 3 and stats["awaiting_ack"] == 0

    run(fn)


def test_repeated_tools_are_one_object_per_trajectory() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def fn(r: Rig) -> None:
        trajectory = r.open("r0", "s0")
        first = [{"role": "user", "content": "add 2 and 2"}]
        assert (await r.chat("s0", first, tools=tools)).status_code == 200
        assert (await r.chat("s0", [*first, {"role": "user", "content": "again"}], tools=tools)).status_code == 200
        assert (await r.chat("s0", first)).status_code == 200
        await r.settled()
        one, two, none = trajectory.turns
        assert one.tools == tools
        assert two.tools is one.tools, "an equal list is the earlier turn's object, as the Python server records it"
        assert none.tools is None
        assert [rec.tools is None for rec in r.records] == [False, False, True]

    run(fn)


@pytest.mark.parametrize("stream", [False, True])
def test_official_openai_sdk(stream: bool) -> None:
    def agent(base_url: str) -> str:
        # The SDK's sync client, in a worker thread: the upstream runs on this Trio loop.
        client = openai.OpenAI(base_url=base_url, api_key="sdk-secret", max_retries=0, timeout=GUARD_S)
        messages: Any = [{"role": "user", "content": "what is six times seven"}]
        if not stream:
            return client.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""
        chunks = client.chat.completions.create(model="m", messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async def fn(r: Rig) -> None:
        trajectory = r.open("sdk", "sdk-secret")
        assert await trio.to_thread.run_sync(agent, r.base_url) == "echo: what is six times seven"
        await r.settled()
        (turn,) = trajectory.turns
        assert turn.request_delta == [{"role": "user", "content": "what is six times seven"}]
        assert turn.streamed is stream

    run(fn)


def test_wrong_secret_is_401_and_not_recorded() -> None:
    async def fn(r: Rig) -> None:
        trajectory = r.open("r0", "s0")
        answer = await r.chat("not-s0", [{"role": "user", "content": "hi"}])
        assert answer.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            await trio.to_thread.run_sync(
                lambda: openai.OpenAI(base_url=r.base_url, api_key="nope", max_retries=0).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
            )
        stats = await r.settled()
        assert stats["refused"] == 2 and stats["calls"] == 2
        assert trajectory.turns == [] and r.records == []
        assert r.upstream.received == []

    run(fn)


def test_unregister_cancels_a_waiting_call_with_410_and_leaves_nothing() -> None:
    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        r.open("r1", "s1")
        r.upstream.hang = True
        answers: dict[str, httpx.Response] = {}

        async def call() -> None:
            answers["r0"] = await r.chat("s0", [{"role": "user", "content": "hi"}])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await r.upstream.entered.wait()
            assert r.plane.stats()["in_flight"] == 1
            assert r.close("r0") == 1
        assert answers["r0"].status_code == 410
        # A closed rollout's secret is unknown from now on.
        assert (await r.chat("s0", [{"role": "user", "content": "again"}])).status_code == 401
        r.upstream.hang = False
        assert (await r.chat("s1", [{"role": "user", "content": "still here"}])).status_code == 200
        assert r.close("r1") == 0

        stats = await r.settled()
        r.plane.drain()  # the loop drained already; nothing is left either way
        assert {k: stats[k] for k in ("open_rollouts", "secrets", "in_flight", "queued", "awaiting_ack")} == {
            "open_rollouts": 0,
            "secrets": 0,
            "in_flight": 0,
            "queued": 0,
            "awaiting_ack": 0,
        }
        assert (stats["closed"], stats["ok"], stats["refused"]) == (1, 1, 1)
        assert [rec.rollout_id for rec in r.records] == ["r1"]
        # The bodies: both held for their call, none left, both rollouts closed in the table.
        table = r.plane.table.stats()
        assert (stats["intercepts"], stats["intercept_bytes"]) == (0, 0)
        assert {k: table[k] for k in ("entries", "bytes", "open_rollouts", "inserts")} == {
            "entries": 0,
            "bytes": 0,
            "open_rollouts": 0,
            "inserts": 2,
        }

    run(fn)


def test_a_large_body_is_held_as_sent_in_the_tables_own_mapping() -> None:
    # Over the table's mmap threshold (1 MiB) the plane reads the body straight
    # into the memory the table holds, frame by frame: the bytes must be the
    # agent's, whole, and gone with the call.
    table = InterceptTable()
    messages = [{"role": "user", "content": "y" * (3 << 20) + "the end"}]

    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        r.upstream.hang = True

        async def call() -> None:
            await r.chat("s0", messages)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await r.upstream.entered.wait()
            (request_id,) = table.rollout_requests("r0")
            view = table.get(request_id)
            assert view is not None
            held = bytes(memoryview(view))
            del view
            assert orjson.loads(held)["messages"] == messages
            assert table.stats()["bytes"] == len(held) > 3 << 20
            r.close("r0")
        stats = await r.settled()
        assert (stats["intercepts"], len(table), table.stats()["live_bytes"]) == (0, 0, 0)

    run(fn, table=table)


def test_a_given_table_holds_each_body_for_its_call() -> None:
    table = InterceptTable(capacity_bytes=1 << 20)

    async def fn(r: Rig) -> None:
        assert r.plane.table is table
        r.open("r0", "s0")
        assert table.is_open("r0")
        r.upstream.hang = True

        async def call() -> None:
            await r.chat("s0", [{"role": "user", "content": "hi"}])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await r.upstream.entered.wait()
            (request_id,) = table.rollout_requests("r0")
            view = table.get(request_id)
            assert view is not None and view.rollout_id == "r0" and view.protocol == "openai.chat"
            assert orjson.loads(bytes(memoryview(view)))["messages"] == [{"role": "user", "content": "hi"}]
            del view
            assert r.plane.stats()["intercepts"] == 1
            r.close("r0")
        stats = await r.settled()
        assert (stats["intercepts"], len(table), table.stats()["live_bytes"]) == (0, 0, 0)
        assert not table.is_open("r0")

    run(fn, table=table)


def test_a_full_table_is_503_with_retry_after_and_holds_nothing() -> None:
    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        answer = await r.chat("s0", [{"role": "user", "content": "too big for 16 bytes"}])
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert "intercept table is full" in answer.json()["error"]["message"]
        stats = await r.settled()
        assert (stats["in_flight"], stats["intercepts"], r.plane.table.stats()["rejected"]) == (0, 0, 1)
        assert r.records == []

    run(fn, table=InterceptTable(capacity_bytes=16))


def test_records_of_closed_rollouts_are_acked() -> None:
    """A record whose rollout its owner closed meanwhile is still acked, so the answer is delivered."""

    async def fn(r: Rig) -> None:
        r.plane.register("gone", "g")  # no trajectory: on_record drops its records
        answer = await r.chat("g", [{"role": "user", "content": "hi"}])
        assert answer.status_code == 200
        stats = await r.settled()
        assert stats["awaiting_ack"] == 0 and [rec.rollout_id for rec in r.records] == ["gone"]
        assert r.plane.unregister("gone") == 0

    run(fn)


def test_a_failing_callback_still_acks_its_batch() -> None:
    async def main() -> None:
        upstream = Upstream()
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, upstream)
            plane = DataPlane(f"http://{address}/v1")
            plane.register("r0", "s0")

            def on_record(record: TurnRecord) -> None:
                raise RuntimeError("the control plane broke")

            async def loop() -> None:
                with pytest.raises(RuntimeError, match="control plane broke"):
                    await serve_records(plane, on_record)

            nursery.start_soon(loop)
            async with httpx.AsyncClient(timeout=GUARD_S) as http:
                with trio.fail_after(GUARD_S):
                    answer = await http.post(
                        f"http://{plane.address}/v1{CHAT}",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"authorization": "Bearer s0"},
                    )
            assert answer.status_code == 200
            nursery.cancel_scope.cancel()
        plane.close()

    trio.run(main)


def test_a_stalled_body_is_408_and_not_recorded() -> None:
    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        host, _, port = r.plane.address.rpartition(":")
        sock = await trio.open_tcp_stream(host, int(port))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: s0\r\ncontent-length: 100\r\n\r\n"
        await sock.send_all(head + b'{"model":"m",')
        answer = b""
        while chunk := await sock.receive_some():  # the plane closes the connection after its answer
            answer += chunk
        head_out, _, body = answer.partition(b"\r\n\r\n")
        assert head_out.startswith(b"HTTP/1.1 408"), answer
        assert orjson.loads(body)["error"]["code"] == 408
        stats = await r.settled()
        assert (stats["refused"], stats["in_flight"], stats["queued"]) == (1, 0, 0)
        assert r.records == [] and r.trajectories["r0"].turns == []

    run(fn, body_read_timeout_s=0.2)


def test_control_api_errors() -> None:
    with pytest.raises(DataPlaneConfigError):
        DataPlane("ftp://example.com/v1")
    DataPlane("https://example.com/v1").close()  # the wheel is built with TLS (tests/dataplane/test_tls.py)
    with pytest.raises(DataPlaneConfigError):
        DataPlane("http://127.0.0.1:9/v1", worker_threads=0)
    with pytest.raises(ValueError):
        DataPlane("http://127.0.0.1:9/v1", backoff_s=-1.0)
    with pytest.raises(DataPlaneConfigError):
        DataPlane("http://127.0.0.1:9/v1", body_read_timeout_s=0.0)
    with DataPlane("http://127.0.0.1:9/v1") as plane:
        host, _, port = plane.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        with pytest.raises(OSError):
            DataPlane("http://127.0.0.1:9/v1", port=int(port))  # taken
        plane.register("r0", "s0")
        with pytest.raises(DuplicateRollout):
            plane.register("r0", "s1")
        with pytest.raises(DuplicateSecret):
            plane.register("r1", "s0")
        with pytest.raises(ValueError):
            plane.register("", "s2")
        with pytest.raises(KeyError):
            plane.unregister("r9")
        assert plane.ack(12345) is False
        assert plane.release_all() == 0
        assert plane.drain() == []
        assert plane.unregister("r0") == 0
    assert plane.closed
    for method, args in [("stats", ()), ("register", ("a", "b")), ("drain", ()), ("wakeup_fd", ()), ("ack", (0,))]:
        with pytest.raises(DataPlaneClosed):
            getattr(plane, method)(*args)
    assert issubclass(DataPlaneClosed, LowwaterError)


def test_close_is_idempotent_and_joins_the_threads() -> None:
    # Every plane of the earlier tests is closed; one's threads may still be leaving /proc.
    before = plane_threads_back_to(0)
    plane = DataPlane("http://127.0.0.1:9/v1", worker_threads=3)
    # Not counted here: a new thread names itself once it runs, so the count
    # rises to 3 a moment after the constructor returns.
    plane.register("r0", "s0")
    plane.close()
    assert plane_threads_back_to(before) == before
    plane.close()
    assert plane.closed and plane_threads_back_to(before) == before

    # With calls served and a rollout still open.
    async def main() -> None:
        async with rig() as r:
            r.open("r0", "s0")
            assert (await r.chat("s0", [{"role": "user", "content": "hi"}])).status_code == 200
            await r.settled()

    trio.run(main)
    assert plane_threads_back_to(before) == before


def test_an_upstream_error_and_a_client_that_leaves_leave_nothing() -> None:
    # The error and cancellation paths of a call, then the rollout's end:
    # every per-rollout structure of the plane is empty, as after success.
    async def fn(r: Rig) -> None:
        trajectory = r.open("r0", "s0")
        r.upstream.statuses.extend([500] * 8)  # past the plane's retries: a 502
        failed = await r.chat("s0", [{"role": "user", "content": "fail"}])
        assert failed.status_code == 502, failed.text

        r.upstream.statuses.clear()
        r.upstream.hang = True
        r.upstream.entered = trio.Event()
        with trio.move_on_after(GUARD_S) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(r.chat, "s0", [{"role": "user", "content": "leave"}])
                await r.upstream.entered.wait()
                assert r.plane.stats()["in_flight"] == 1
                nursery.cancel_scope.cancel()  # the agent gives up mid-call
        assert not scope.cancelled_caught
        r.upstream.hang = False
        r.close("r0")

        stats = await r.settled()
        assert {k: stats[k] for k in ("open_rollouts", "secrets", "in_flight", "queued", "awaiting_ack")} == {
            "open_rollouts": 0,
            "secrets": 0,
            "in_flight": 0,
            "queued": 0,
            "awaiting_ack": 0,
        }
        assert trajectory.turns and trajectory.turns[0].error is not None

    run(fn)


@pytest.mark.parametrize("trim_when_idle", [True, False])
def test_plane_trims_once_quiet_only_when_asked(trim_when_idle: bool) -> None:
    """A call, then quiet: the plane gives free heap pages back on its trim
    thread (counted in ``trims``), and never with ``trim_when_idle=False``."""

    async def fn(r: Rig) -> None:
        r.open("r0", "s0")
        assert (await r.chat("s0", [{"role": "user", "content": "hi"}])).status_code == 200
        await r.settled()
        if trim_when_idle:
            while r.plane.stats()["trims"] == 0:  # the GUARD_S deadline bounds this
                await trio.sleep(0.1)
        else:
            await trio.sleep(2.5)  # past the quiet second, twice
            assert r.plane.stats()["trims"] == 0

    run(fn, trim_when_idle=trim_when_idle)
