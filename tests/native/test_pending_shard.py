"""FetchBuffer.reserve: a put written in place, then committed or abandoned."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from lowwater import BufferFull, FetchBuffer


@pytest.mark.parametrize("threshold", [0, 1 << 30])  # mapped and heap payloads
def test_reserve_fill_commit(threshold):
    buf = FetchBuffer(mmap_threshold=threshold)
    pending = buf.reserve("a", dtype="float32", shape=(2, 3), owner="me")
    assert pending.shard_id == "a" and pending.nbytes == len(pending) == 24
    assert buf.stats()["bytes"] == 24 and "a" not in buf  # reserved, not visible
    np.frombuffer(pending, np.float32)[:] = np.arange(6, dtype=np.float32)
    gc.collect()
    pending.commit()
    view = buf.get("a")
    assert view.shape == (2, 3) and view.owner == "me"
    assert np.frombuffer(view, np.float32).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="already committed"):
        pending.commit()


def test_commit_refuses_while_a_view_is_held_so_no_view_outlives_the_payload():
    buf = FetchBuffer()
    pending = buf.reserve("a", dtype="uint8", shape=(4,))
    mv = memoryview(pending)
    mv[:] = b"abcd"
    with pytest.raises(BufferError, match="still held"):
        pending.commit()
    with pytest.raises(BufferError):
        pending.abandon()
    mv.release()
    pending.commit()
    assert bytes(memoryview(buf.get("a"))) == b"abcd"
    with pytest.raises(BufferError, match="already committed"):
        memoryview(pending)


def test_abandon_and_drop_give_the_reservation_back():
    buf = FetchBuffer(capacity_bytes=100)
    pending = buf.reserve("a", dtype="uint8", shape=(80,))
    with pytest.raises(BufferFull):
        buf.reserve("b", dtype="uint8", shape=(40,))
    pending.abandon()
    pending.abandon()  # idempotent
    dropped = buf.reserve("c", dtype="uint8", shape=(90,))
    del dropped
    gc.collect()
    assert buf.stats()["bytes"] == 0 and buf.stats()["live_bytes"] == 0 and len(buf) == 0


def test_reserve_validates_like_put():
    buf = FetchBuffer()
    with pytest.raises(ValueError):
        buf.reserve("a", dtype="nope", shape=(1,))
    with pytest.raises(ValueError):
        buf.reserve("a", dtype="uint8", shape=(-1,))
