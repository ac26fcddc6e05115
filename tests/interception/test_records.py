"""``Records``, the control plane's side of the data plane's record queue,
against a stand-in plane: every drained record is acked exactly once on
every path (a callback that raises, an awaitable left to ``serve``, a
flush from a reader, the owner stopping), in call order."""

from __future__ import annotations

import os

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from lowwater.interception.dataplane import Fail, Records


@attrs.define
class Record:
    seq: int


class FakePlane:
    """What ``Records`` uses of a ``DataPlane``: its wakeup fd, drain, ack, fail."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.queue: list[Record] = []
        self.released: list[tuple[int, str]] = []

    def wakeup_fd(self) -> int:
        return self.fd

    def push(self, *seqs: int) -> None:
        self.queue += [Record(s) for s in seqs]
        os.eventfd_write(self.fd, 1)

    def drain(self) -> list[Record]:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        out, self.queue = self.queue, []
        return out

    def ack(self, seq: int) -> bool:
        self.released.append((seq, "ack"))
        return True

    def fail(self, seq: int, status: int, reason: str) -> bool:
        self.released.append((seq, f"fail {status}"))
        return True

    def close(self) -> None:
        os.close(self.fd)


pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the stand-in plane uses an eventfd")


def test_a_callback_that_raises_leaves_no_record_unacked():
    plane = FakePlane()
    hooks_ran = []

    async def hook():
        hooks_ran.append(1)

    def on_record(record):
        if record.seq == 1:
            return hook()  # awaited by serve(), after the batch
        if record.seq == 2:
            raise RuntimeError("boom")
        return None

    async def main():
        plane.push(0, 1, 2, 3)
        with pytest.raises(RuntimeError, match="boom"):
            await Records(plane, on_record).serve()

    trio.run(main)
    assert sorted(plane.released) == [(0, "ack"), (1, "ack"), (2, "ack"), (3, "ack")]
    assert hooks_ran == []  # the loop is gone: the hook's coroutine was closed, not awaited
    plane.close()


def test_a_flush_applies_in_order_and_leaves_awaitables_to_serve():
    plane = FakePlane()
    seen: list[int] = []

    async def hook(seq):
        await trio.lowlevel.checkpoint()
        seen.append(-seq)
        return Fail(502, "no") if seq == 2 else None

    def on_record(record):
        seen.append(record.seq)
        return hook(record.seq) if record.seq in (2, 4) else None

    async def main():
        records = Records(plane, on_record)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(records.serve)
            await trio.testing.wait_all_tasks_blocked()
            plane.queue += [Record(s) for s in (1, 2, 3, 4)]  # queued, no wakeup yet
            records.flush()  # a reader: applies now, in order
            assert seen == [1, 2, 3, 4]
            assert plane.released == [(1, "ack"), (3, "ack")]  # the hooked ones wait for serve()
            with trio.fail_after(5):
                while len(plane.released) < 4:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert seen == [1, 2, 3, 4, -2, -4]
        assert plane.released == [(1, "ack"), (3, "ack"), (2, "fail 502"), (4, "ack")]

    trio.run(main)
    plane.close()


def test_a_flush_from_inside_the_callback_returns_at_once():
    plane = FakePlane()
    records: Records

    def on_record(record):
        records.flush()  # a reader inside the callback (turn_of reads trajectory.turns)
        return None

    records = Records(plane, on_record)
    plane.push(1, 2)
    records.flush()
    assert plane.released == [(1, "ack"), (2, "ack")]
    plane.close()


def test_an_error_in_a_readers_flush_is_raised_by_serve():
    plane = FakePlane()

    def on_record(record):
        raise ValueError(f"bad record {record.seq}")

    async def main():
        records = Records(plane, on_record)
        plane.queue.append(Record(7))
        records.flush()  # the reader is not the one to get it
        assert plane.released == [(7, "ack")]
        with pytest.raises(ValueError, match="bad record 7"):
            await records.serve()  # woken by the flush

    trio.run(main)
    plane.close()


def test_stop_applies_what_is_queued_and_acks_what_is_left():
    plane = FakePlane()
    applied = []

    async def hook():
        raise AssertionError("not awaited after stop")

    def on_record(record):
        applied.append(record.seq)
        return hook() if record.seq == 2 else None

    records = Records(plane, on_record)
    plane.push(1, 2, 3)
    records.stop()
    assert applied == [1, 2, 3]
    assert sorted(plane.released) == [(1, "ack"), (2, "ack"), (3, "ack")]
    plane.close()
