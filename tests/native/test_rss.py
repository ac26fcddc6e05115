"""Removal gives memory back to the OS: current RSS (never a peak counter).

512 MiB goes in as 4 MiB payloads (the default 1 MiB mmap threshold, so each
payload is its own mapping), RSS must rise by most of it while held, and fall
back to within SLACK of the baseline once the entries are removed and no view
holds them.  Several cycles: a later cycle must not settle higher.
"""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest

from lowwater._native import FetchBuffer, InterceptTable

pytestmark = pytest.mark.memory

MiB = 1 << 20
SHARD = 4 * MiB
TOTAL = 512 * MiB
COUNT = TOTAL // SHARD
SLACK = 64 * MiB
MIN_RISE = TOTAL * 3 // 4  # the payloads really were resident while held


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.fixture(scope="module")
def source():
    # Allocated and touched before any baseline is taken.
    a = np.arange(SHARD // 8, dtype=np.uint64)
    a[:] = a * 2654435761
    return a


def warm_buffer(source) -> tuple[FetchBuffer, int]:
    """A FetchBuffer that has held and cleared one shard, and the RSS baseline
    taken after: the code paths (and any lazily allocated state) are warm."""
    fb = FetchBuffer()
    fb.put("warm", source, dtype="uint64", shape=source.shape)
    fb.clear()
    return fb, rss()


def test_fetch_buffer_rss_returns_after_clear(source):
    fb, base = warm_buffer(source)
    for cycle in range(2):
        for k in range(COUNT):
            fb.put(f"s{k}", source, dtype="uint64", shape=(SHARD // 8,), owner="o")
        st = fb.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"]) == (COUNT, TOTAL, TOTAL)
        held = rss()
        assert held - base >= MIN_RISE, (
            f"cycle {cycle}: RSS rose by only {(held - base) / MiB:.0f} MiB while holding 512 MiB"
        )
        v = fb.get("s0")
        assert np.array_equal(np.frombuffer(v, np.uint64), source)
        del v
        assert fb.clear() == COUNT
        st = fb.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"]) == (0, 0, 0)
        after = rss()
        assert after - base <= SLACK, (
            f"cycle {cycle}: RSS {after / MiB:.0f} MiB after clear, baseline {base / MiB:.0f} MiB, "
            f"held {held / MiB:.0f} MiB"
        )


def test_fetch_buffer_rss_returns_after_pop_and_replace(source):
    fb, base = warm_buffer(source)
    for k in range(COUNT):
        fb.put(f"s{k % (COUNT // 2)}", source, dtype="uint64", shape=(SHARD // 8,))  # second half replaces
    assert fb.stats()["removals"] == 1 + COUNT // 2  # the warm-up clear, then the replacements
    assert rss() - base >= MIN_RISE // 2
    for k in range(COUNT // 2):
        assert fb.pop(f"s{k}") is not None  # the view dies at once
    assert fb.stats()["live_bytes"] == 0
    assert rss() - base <= SLACK


def test_fetch_buffer_view_held_over_clear(source):
    fb, base = warm_buffer(source)
    for k in range(COUNT):
        fb.put(f"s{k}", source, dtype="uint64", shape=(SHARD // 8,))
    kept = [fb.get(f"s{k}") for k in range(0, COUNT, 16)]  # 8 views, 32 MiB
    arr = np.frombuffer(fb.get("s1"), np.uint64)  # a numpy array holds its payload too
    fb.clear()
    st = fb.stats()
    assert (st["entries"], st["bytes"]) == (0, 0)
    assert st["live_bytes"] == (len(kept) + 1) * SHARD
    after = rss()
    assert after - base <= SLACK + (len(kept) + 1) * SHARD
    for v in kept:
        assert np.array_equal(np.frombuffer(v, np.uint64), source)
    assert np.array_equal(arr, source)
    del kept, v
    assert fb.stats()["live_bytes"] == SHARD
    del arr
    assert fb.stats()["live_bytes"] == 0
    assert rss() - base <= SLACK


def test_intercept_table_rss_returns_after_close_and_discard(source):
    t = InterceptTable()
    body = memoryview(source).cast("B")
    t.open_rollout("warm")
    t.insert("w", "warm", body, protocol="p", stream=False)
    t.close_rollout("warm")
    base = rss()
    for cycle in range(2):
        t.open_rollout("a")
        t.open_rollout("b")
        for k in range(COUNT):
            t.insert(f"q{k}", "ab"[k % 2], body, protocol="p", stream=bool(k % 3))
        st = t.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"]) == (COUNT, TOTAL, TOTAL)
        held = rss()
        assert held - base >= MIN_RISE, f"cycle {cycle}: RSS rose by only {(held - base) / MiB:.0f} MiB"
        kept = t.get("q0")
        # Half go by discard (delivered), half by the close sweep.
        assert all(t.discard(f"q{k}") for k in range(0, COUNT, 2))
        assert sorted(t.close_rollout("b")) == sorted(f"q{k}" for k in range(1, COUNT, 2))
        assert t.close_rollout("a") == []
        st = t.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"]) == (0, 0, SHARD)
        assert bytes(kept) == body.tobytes()
        del kept
        assert t.stats()["live_bytes"] == 0
        after = rss()
        assert after - base <= SLACK, (
            f"cycle {cycle}: RSS {after / MiB:.0f} MiB after drain, baseline {base / MiB:.0f} MiB"
        )


def test_open_rollout_costs_bytes_not_kilobytes():
    """An open rollout is a flag and a short id list, not a map of its own.

    Each rollout used to own a papaya map, and so a seize collector: 18 KB of
    RSS per open rollout, over half of the 32 KB budget for one rollout held
    open at the proxy (issue "Interception"; benches/interception.py).  Now
    about 180 bytes; the bound is generous so allocator noise cannot fail it.
    """
    n = 16384
    t = InterceptTable()
    t.open_rollout("warm")
    t.close_rollout("warm")
    ids = [f"rollout-{i:06d}" for i in range(n)]  # allocated before the baseline
    base = rss()
    for rid in ids:
        t.open_rollout(rid)
    grown = rss() - base
    assert t.stats()["open_rollouts"] == n
    assert grown / n <= 2048, f"{grown / n:.0f} bytes of RSS per open rollout"
    for rid in ids:
        assert t.close_rollout(rid) == []
    assert t.stats()["open_rollouts"] == 0
