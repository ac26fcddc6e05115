"""Calls released without the ack: a call whose answer needs no verdict gets
its last bytes once the data plane has queued its record, and every reader
still finds its turn (``Trajectory.turns``, unregister, the admin routes,
the server's stop); a call that needs the control plane (an answer that is
not JSON, an ``intercept_response`` hook) still waits for it."""

from __future__ import annotations

import pytest
import trio

from lowwater.hookspecs import hookimpl

from ._harness import KINDS, body, harness, run
from .test_interceptors import _interceptors


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_turn_is_there_once_its_agent_has_the_answer(kind, stream):
    async def fn(h):
        slot, trajectory = h.open("r")
        history: list = []
        for i in range(12):
            sent = body(kind, f"question {i}", history=history, stream=stream)
            r = await h.call(slot, kind, sent)
            assert r.status_code == 200
            await r.aread()
            # No checkpoint since the answer arrived: only the read's flush can have applied it.
            turns = trajectory.turns
            assert len(turns) == i + 1 and turns[-1].error is None, (i, [t.error for t in turns])
            assert turns[-1].request_delta[-1]["content"] == f"question {i}"
            history = [*sent.get("messages", sent.get("input", [])), {"role": "assistant", "content": "ok"}]
        stats = h.server.stats()["plane"]
        assert stats["released"] == 12 and stats["awaiting_ack"] == 0
        await h.assert_clean()

    run(fn)


def test_the_record_loop_applies_released_records_without_a_reader():
    """Nobody reads the turns: the plane's batched wakeup still brings them in."""

    async def fn(h):
        slot, trajectory = h.open("r")
        for i in range(3):
            assert (await h.call(slot, "chat", body("chat", f"q{i}"))).status_code == 200
        with trio.fail_after(10):  # a guard, not a timing assertion
            while len(trajectory._turns) < 3:  # the list itself: no flush
                await trio.sleep(0.001)
        assert h.server.stats()["plane"]["queued"] == 0

    run(fn)


def test_unregister_right_after_the_answer_keeps_the_turn():
    async def fn(h):
        for i in range(20):
            slot, trajectory = h.open(f"r{i}")
            assert (await h.call(slot, "messages", body("messages", "hi"))).status_code == 200
            h.server.unregister(slot.rollout_id)
            assert len(trajectory._turns) == 1, i  # applied by unregister, not by this read
            assert len(trajectory.turns) == 1  # detached: a read no longer drains
        await h.assert_clean()

    run(fn)


def test_a_stopping_server_applies_what_was_answered():
    async def main():
        async with harness() as h:
            slot, trajectory = h.open("r")
            assert (await h.call(slot, "chat", body("chat", "hi"))).status_code == 200
            h.server.plane.stats()  # still running
        # The server stopped (its nursery cancelled) right after the answer.
        assert len(trajectory._turns) == 1
        assert trajectory.turns[0].error is None

    trio.run(main)


def test_an_answer_that_is_not_json_still_waits_for_the_verdict():
    async def fn(h):
        slot, trajectory = h.open("r")
        h.upstream.malformed = True
        r = await h.call(slot, "chat", body("chat"))
        assert r.status_code == 502 and "not a valid response object" in r.text
        assert trajectory.turns[0].error.startswith("upstream answer malformed")
        assert h.server.stats()["plane"]["released"] == 0

    run(fn)


class Stamp:
    def __init__(self):
        self.turns_seen = []

    @hookimpl
    async def intercept_response(self, call, response):
        await trio.sleep(0.05)  # the agent must still be waiting
        self.turns_seen.append(response.completion is not None)


def test_a_response_hook_runs_before_the_agent_has_the_answer():
    stamp = Stamp()

    async def fn(h):
        h.server.interceptors = _interceptors(stamp)
        slot, _ = h.open("r")
        for kind in KINDS:
            before = len(stamp.turns_seen)
            assert (await h.call(slot, kind, body(kind))).status_code == 200
            assert len(stamp.turns_seen) == before + 1, kind
        assert h.server.stats()["plane"]["released"] == 0

    run(fn)
