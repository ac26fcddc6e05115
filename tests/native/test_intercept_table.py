"""InterceptTable: API contract of ``lowwater._native`` (example-based tests).

The model-based checks live in ``test_intercept_table_stateful.py``; what both
tables do alike (construction, the fresh stats) in ``test_tables.py``.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import lowwater
from lowwater._native import BufferFull, InterceptTable, InterceptView, RolloutClosed

from ._tables import INTERCEPT_KEYS

PAGE = 4096


def data_ptr(obj) -> int:
    return np.frombuffer(obj, np.uint8).__array_interface__["data"][0]


# Construction and the fresh stats: test_tables.py (both tables alike).


@pytest.mark.parametrize("threshold", [PAGE, 1 << 20])
def test_insert_get_view_zero_copy(threshold):
    t = InterceptTable(mmap_threshold=threshold)
    t.open_rollout("r")
    body = np.random.default_rng(3).bytes(10_000)
    t.insert("q", "r", body, protocol="openai-chat", stream=True)
    v = t.get("q")
    assert isinstance(v, InterceptView)
    assert (v.request_id, v.rollout_id, v.protocol, v.stream) == ("q", "r", "openai-chat", True)
    assert v.nbytes == len(v) == len(body) and bytes(v) == body
    assert 0.0 <= v.age_s < 60
    a, b = np.frombuffer(v, np.uint8), np.frombuffer(v, np.uint8)
    assert np.shares_memory(a, b)
    assert data_ptr(v) == data_ptr(t.get("q"))  # every get hands out the one payload
    m = memoryview(v)
    assert m.readonly
    with pytest.raises(TypeError):
        m[0] = 0
    with pytest.raises(ValueError):
        a[0] = 0
    if threshold == PAGE:
        assert data_ptr(v) % PAGE == 0  # its own mapping
    assert repr(v).startswith('InterceptView(request_id="q", rollout_id="r"')


def test_body_kinds_and_non_contiguous():
    t = InterceptTable()
    t.open_rollout("r")
    base = np.arange(1000, dtype=np.int32)
    t.insert("strided", "r", base[::7], protocol="p", stream=False)
    t.insert("empty", "r", b"", protocol="p", stream=False)
    t.insert("bytearray", "r", bytearray(b"xyz"), protocol="p", stream=False)
    t.insert("mv", "r", memoryview(b"0123456789")[1::3], protocol="", stream=False)
    assert bytes(t.get("strided")) == base[::7].tobytes()
    assert bytes(t.get("empty")) == b"" and len(t.get("empty")) == 0
    assert bytes(t.get("bytearray")) == b"xyz"
    assert bytes(t.get("mv")) == b"147"
    with pytest.raises(TypeError):
        t.insert("s", "r", "not bytes", protocol="p", stream=False)
    with pytest.raises(TypeError):
        t.insert("s", "r", 123, protocol="p", stream=False)
    with pytest.raises(TypeError):  # protocol and stream are keyword-only and required
        t.insert("s", "r", b"x", "p", False)
    with pytest.raises(TypeError):
        t.insert("s", "r", b"x", protocol="p")
    assert "s" not in t
    st = t.stats()
    assert (st["entries"], st["bytes"], st["inserts"], st["rejected"]) == (4, base[::7].nbytes + 0 + 3 + 3, 4, 0)


def test_rollout_lifecycle():
    t = InterceptTable()
    assert not t.is_open("r")
    with pytest.raises(RolloutClosed):  # never opened
        t.insert("q0", "r", b"x", protocol="p", stream=False)
    with pytest.raises(lowwater.LowwaterError):
        t.insert("q0", "r", b"x", protocol="p", stream=False)
    t.open_rollout("r")
    t.open_rollout("r")  # idempotent
    assert t.is_open("r") and t.stats()["open_rollouts"] == 1
    t.insert("q1", "r", b"one", protocol="p", stream=False)
    t.insert("q2", "r", b"two", protocol="p", stream=False)
    # Re-opening an open rollout keeps its intercepts.
    t.open_rollout("r")
    assert sorted(t.rollout_requests("r")) == ["q1", "q2"]
    with pytest.raises(KeyError):  # duplicate request id
        t.insert("q1", "r", b"again", protocol="p", stream=False)
    t.open_rollout("other")
    with pytest.raises(KeyError):  # duplicate across rollouts too
        t.insert("q1", "other", b"again", protocol="p", stream=False)
    assert bytes(t.get("q1")) == b"one"
    assert t.discard("q2") is True
    assert t.discard("q2") is False  # double discard
    t.insert("q3", "r", b"three", protocol="p", stream=True)
    t.insert("o1", "other", b"o", protocol="p", stream=True)
    held = t.get("q1")
    assert sorted(t.close_rollout("r")) == ["q1", "q3"]  # exactly the pending ids
    assert not t.is_open("r") and t.is_open("other")
    assert t.close_rollout("r") == []  # closing again: nothing
    assert t.close_rollout("never") == []
    assert t.rollout_requests("r") == []
    assert t.keys() == ["o1"] and "q1" not in t and t.get("q1") is None
    assert bytes(held) == b"one"
    with pytest.raises(RolloutClosed):  # closed
        t.insert("q4", "r", b"x", protocol="p", stream=False)
    st = t.stats()
    assert st == {
        "entries": 1,
        "bytes": 1,
        "peak_bytes": 3 + 5 + 1,
        "live_bytes": 1 + 3,
        "open_rollouts": 1,
        "inserts": 4,
        "discards": 1,
        "swept": 2,
        "rejected": 0,
    }
    del held
    assert t.stats()["live_bytes"] == 1
    # Re-open after close: a fresh rollout, and the old request ids are free again.
    t.open_rollout("r")
    t.insert("q1", "r", b"new", protocol="p", stream=False)
    assert t.rollout_requests("r") == ["q1"] and bytes(t.get("q1")) == b"new"
    assert t.close_rollout("r") == ["q1"]
    assert t.discard("o1") is True
    assert t.close_rollout("other") == []
    st = t.stats()
    assert (st["entries"], st["bytes"], st["live_bytes"], st["open_rollouts"]) == (0, 0, 0, 0)
    assert (st["inserts"], st["discards"], st["swept"]) == (5, 2, 3)


def test_discard_unknown_and_get_unknown():
    t = InterceptTable()
    assert t.discard("nope") is False
    assert t.get("nope") is None
    assert 5 not in t and None not in t
    assert t.stats() == dict.fromkeys(INTERCEPT_KEYS, 0)


def test_error_precedence():
    t = InterceptTable(capacity_bytes=4)
    # Not a buffer is checked first, then the rollout, then duplicates, then capacity.
    with pytest.raises(TypeError):
        t.insert("q", "r", "x", protocol="p", stream=False)
    with pytest.raises(RolloutClosed):
        t.insert("q", "r", b"too long", protocol="p", stream=False)
    t.open_rollout("r")
    t.insert("q", "r", b"abcd", protocol="p", stream=False)
    with pytest.raises(KeyError):
        t.insert("q", "r", b"too long", protocol="p", stream=False)
    assert t.stats()["rejected"] == 0
    with pytest.raises(BufferFull):
        t.insert("q2", "r", b"x", protocol="p", stream=False)
    st = t.stats()
    assert (st["rejected"], st["entries"], st["bytes"], st["inserts"]) == (1, 1, 4, 1)


def test_capacity_rejects_without_evicting():
    t = InterceptTable(capacity_bytes=100)
    t.open_rollout("r")
    t.insert("a", "r", b"a" * 70, protocol="p", stream=False)
    with pytest.raises(BufferFull):
        t.insert("b", "r", b"b" * 31, protocol="p", stream=False)
    assert "b" not in t and bytes(t.get("a")) == b"a" * 70
    assert t.rollout_requests("r") == ["a"]
    t.insert("b", "r", b"b" * 30, protocol="p", stream=False)
    t.insert("c", "r", b"", protocol="p", stream=False)
    v = t.get("a")
    assert t.discard("a")
    t.insert("d", "r", b"d" * 70, protocol="p", stream=False)  # a held view does not count
    st = t.stats()
    assert (st["entries"], st["bytes"], st["live_bytes"], st["rejected"], st["peak_bytes"]) == (3, 100, 170, 1, 100)
    assert bytes(v) == b"a" * 70


def test_stale():
    t = InterceptTable()
    t.open_rollout("r")
    t.insert("old", "r", b"x", protocol="p", stream=False)
    time.sleep(0.05)
    t.insert("new", "r", b"y", protocol="p", stream=False)
    # No assertion depends on how long the lines below take (a loaded CI host
    # may stall between any two of them): ages only grow, so "old" is past any
    # threshold of 0.05 s or less, and whatever is stale includes every older entry.
    assert "old" in t.stale(0.049)
    assert sorted(t.stale(0.0)) == ["new", "old"]
    assert t.stale(3600.0) == []
    new_age = t.get("new").age_s  # read first: "old" read later is older still
    assert t.get("old").age_s >= max(0.05, new_age)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            t.stale(bad)


def test_view_held_after_close_stays_readable_then_releases():
    t = InterceptTable(mmap_threshold=PAGE)
    t.open_rollout("r")
    body = np.random.default_rng(5).bytes(300_000)
    t.insert("q", "r", body, protocol="p", stream=False)
    v = t.get("q")
    arr = np.frombuffer(t.get("q"), np.uint8)
    assert t.close_rollout("r") == ["q"]
    st = t.stats()
    assert (st["entries"], st["bytes"], st["live_bytes"]) == (0, 0, len(body))
    gc.collect()
    assert bytes(v) == body and arr.tobytes() == body
    del v
    assert t.stats()["live_bytes"] == len(body)
    del arr
    assert t.stats()["live_bytes"] == 0
