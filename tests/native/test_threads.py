"""Both tables under threads (threading.Barrier start, 8 threads).

Payloads are at least 64 KiB where concurrency matters: below that the binding
copies with the GIL held, so on a GIL build only large puts / inserts, clears
and closes actually run in parallel with other calls.  Every payload is one
8-byte tag repeated, so a torn or mixed payload is detected.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import numpy as np
import pytest

from lowwater._native import BufferFull, FetchBuffer, InterceptTable, RolloutClosed

THREADS = 8
BIG = 64 * 1024  # the binding releases the GIL for copies of at least this size


def tagged(tag: int, n: int = BIG) -> bytes:
    assert n % 8 == 0
    return np.full(n // 8, tag, dtype=np.uint64).tobytes()


def tag_of(view) -> int:
    """The tag of a whole (untorn) tagged payload."""
    a = np.frombuffer(view, dtype=np.uint64)
    assert a.size > 0 and (a == a[0]).all(), "torn payload"
    return int(a[0])


def make_tag(thread: int, serial: int) -> int:
    return (thread + 1) << 32 | serial


def run_threads(target, n: int = THREADS, timeout: float = 60.0) -> list:
    """Run ``target(i, barrier)`` in ``n`` threads; re-raise the first failure."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def body(i):
        try:
            results[i] = target(i, barrier)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "thread hung"
    if errors:
        raise errors[0]
    return results


# =========================================================================== FetchBuffer


@pytest.mark.parametrize("threshold", [4096, 1 << 20])
def test_fetch_disjoint_keys(threshold):
    fb = FetchBuffer(mmap_threshold=threshold)
    keys_per_thread = 40

    def work(i, barrier):
        rng = random.Random(i)
        mine = [f"t{i}-k{k}" for k in range(keys_per_thread)]
        sizes = {k: rng.choice([8, 1024, BIG, 2 * BIG]) for k in mine}
        barrier.wait()
        for s, k in enumerate(mine):
            fb.put(k, tagged(make_tag(i, s), sizes[k]), dtype="uint64", shape=(sizes[k] // 8,), owner=f"o{i}")
        barrier.wait()
        # Everyone has put: all keys of all threads are visible.
        assert len(fb) == THREADS * keys_per_thread
        barrier.wait()
        gets = 0
        for s, k in enumerate(mine):
            v = fb.get(k)
            gets += 1
            assert tag_of(v) == make_tag(i, s) and v.owner == f"o{i}" and v.nbytes == sizes[k]
        # Replace every 4th, pop half, clear the rest.
        replaced = 0
        for s, k in enumerate(mine[::4]):
            fb.put(k, tagged(make_tag(i, 1000 + s), sizes[k]), dtype="uint64", shape=(sizes[k] // 8,))
            replaced += 1
        held = []
        pops = 0
        for k in mine[: keys_per_thread // 2]:
            v = fb.pop(k)
            pops += 1
            assert v is not None
            held.append(v)
        assert fb.clear(mine) == keys_per_thread - keys_per_thread // 2
        for v in held:
            tag_of(v)
        return gets, pops, replaced, sum(sizes.values())

    results = run_threads(work)
    st = fb.stats()
    gets = sum(r[0] for r in results)
    pops = sum(r[1] for r in results)
    replaced = sum(r[2] for r in results)
    total_first = sum(r[3] for r in results)
    n = THREADS * keys_per_thread
    assert st["entries"] == 0 and st["bytes"] == 0 and len(fb) == 0 and fb.keys() == []
    assert st["inserts"] == n + replaced
    assert st["removals"] == st["inserts"]
    assert st["hits"] == gets + pops and st["misses"] == 0
    assert st["rejected"] == 0
    assert st["live_bytes"] == 0  # the views died with the threads' frames
    assert total_first <= st["peak_bytes"]


def test_fetch_shared_keys_one_winner_per_pop():
    fb = FetchBuffer(mmap_threshold=4096)
    ids = [f"s{k}" for k in range(16)]
    rounds = 15
    for rnd in range(rounds):

        def work(i, barrier):
            rng = random.Random(rnd * 100 + i)
            order = ids[:]
            rng.shuffle(order)
            barrier.wait()
            for k in order:  # every thread puts every id: replacements race
                fb.put(k, tagged(make_tag(i, rnd)), dtype="uint64", shape=(BIG // 8,))
            barrier.wait()
            rng.shuffle(order)
            won = {}
            for k in order:
                v = fb.pop(k)
                if v is not None:
                    won[k] = tag_of(v)
            return won

        results = run_threads(work)
        winners = Counter(k for r in results for k in r)
        assert winners == Counter(ids), "each id must be popped by exactly one thread"
        for r in results:
            for tag in r.values():
                assert tag >> 32 in range(1, THREADS + 1) and tag & 0xFFFFFFFF == rnd
        del results
        st = fb.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"]) == (0, 0, 0)
        assert st["inserts"] == (rnd + 1) * THREADS * len(ids)
        assert st["removals"] == st["inserts"]  # replaced or popped, each exactly once
        assert st["hits"] == (rnd + 1) * len(ids)
        assert st["misses"] == (rnd + 1) * (THREADS - 1) * len(ids)
        assert st["peak_bytes"] <= 2 * THREADS * BIG * len(ids)


@pytest.mark.parametrize("capacity", [None, 6 * BIG])
def test_fetch_mixed_ops_counters_consistent(capacity):
    fb = FetchBuffer(capacity_bytes=capacity, mmap_threshold=4096)
    ids = [f"s{k}" for k in range(8)]
    ops_per_thread = 400

    def work(i, barrier):
        rng = random.Random(i)
        c = Counter()
        views = []
        barrier.wait()
        for s in range(ops_per_thread):
            k = rng.choice(ids)
            op = rng.random()
            if op < 0.45:
                n = rng.choice([BIG, 2 * BIG, 16])
                try:
                    fb.put(k, tagged(make_tag(i, s), n), dtype="uint64", shape=(n // 8,))
                    c["puts"] += 1
                except BufferFull:
                    c["full"] += 1
            elif op < 0.7:
                v = fb.get(k)
                c["lookups"] += 1
                if v is not None:
                    c["hits"] += 1
                    tag_of(v)
                    if rng.random() < 0.2:
                        views.append(v)
            elif op < 0.9:
                v = fb.pop(k)
                c["lookups"] += 1
                if v is not None:
                    c["hits"] += 1
                    c["popped"] += 1
                    tag_of(v)
            else:
                c["cleared"] += fb.clear(rng.sample(ids, 3))
            if len(views) > 4:
                views.pop(0)
            if capacity is not None and s % 50 == 0:
                # bytes may include in-flight reservations, never more than capacity
                assert fb.stats()["bytes"] <= capacity + 2 * BIG * THREADS
        for v in views:
            tag_of(v)
        return c

    total = sum(run_threads(work), Counter())
    st = fb.stats()
    remaining = {k: fb.get(k) for k in fb.keys()}
    assert set(remaining) == set(fb.keys()) and len(remaining) == st["entries"] == len(fb)
    assert st["bytes"] == sum(v.nbytes for v in remaining.values())
    assert all(tag_of(v) for v in remaining.values())  # (a for-loop variable would keep a view alive)
    assert st["inserts"] == total["puts"]
    assert st["rejected"] == total["full"]
    assert st["hits"] == total["hits"]
    assert st["misses"] == total["lookups"] - total["hits"]
    assert st["inserts"] - st["removals"] == st["entries"]
    # removals = replacements + pops + cleared; replacements are the rest
    replacements = st["removals"] - total["popped"] - total["cleared"]
    assert 0 <= replacements <= total["puts"]
    if capacity is not None:
        assert st["bytes"] <= capacity
    del remaining
    assert st["peak_bytes"] >= st["bytes"]
    assert fb.stats()["live_bytes"] == st["bytes"]  # all views dropped
    fb.clear()
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["live_bytes"]) == (0, 0, 0)


def test_fetch_capacity_never_exceeded_under_replace_and_pop():
    """A bounded buffer must never hold more than capacity_bytes once callers return.

    Replacing puts, pops and fresh puts race on a few ids (payloads >= 64 KiB,
    so the puts run without the GIL); after every round the held bytes are
    compared with the capacity.
    """
    cap = 2 * BIG
    ids = ["a", "b", "c"]
    rounds = 60
    fb = FetchBuffer(capacity_bytes=cap, mmap_threshold=4096)
    over = []
    for rnd in range(rounds):

        def work(i, barrier):
            rng = random.Random(rnd * 31 + i)
            barrier.wait()
            for s in range(30):
                k = rng.choice(ids)
                if rng.random() < 0.6:
                    try:
                        fb.put(k, tagged(make_tag(i, s)), dtype="uint64", shape=(BIG // 8,))
                    except BufferFull:
                        pass
                else:
                    fb.pop(k)

        run_threads(work)
        st = fb.stats()
        assert st["bytes"] == BIG * st["entries"] == BIG * len(fb)
        if st["bytes"] > cap:
            over.append((rnd, st))
        fb.clear()
    assert not over, f"held bytes exceeded capacity_bytes={cap} after {len(over)} of {rounds} rounds: {over[:3]}"


# =========================================================================== InterceptTable


def test_intercept_disjoint_and_one_winner_per_discard():
    t = InterceptTable(mmap_threshold=4096)
    rollouts = [f"r{k}" for k in range(4)]
    per_thread = 30
    for r in rollouts:
        t.open_rollout(r)

    def fill(i, barrier):
        barrier.wait()
        mine = []
        for s in range(per_thread):
            q = f"t{i}-q{s}"
            n = BIG if s % 2 else 64
            t.insert(q, rollouts[(i + s) % len(rollouts)], tagged(make_tag(i, s), n), protocol="p", stream=bool(s % 3))
            mine.append(q)
        # Duplicates across threads race too: exactly one insert of "shared-s" wins.
        won = []
        for s in range(10):
            try:
                t.insert(f"shared-{s}", rollouts[0], tagged(make_tag(i, s)), protocol="p", stream=False)
                won.append(f"shared-{s}")
            except KeyError:
                pass
        return mine, won

    results = run_threads(fill)
    all_ids = [q for mine, won in results for q in mine + won]
    assert Counter(q for _, won in results for q in won) == Counter(f"shared-{s}" for s in range(10))
    st = t.stats()
    assert st["entries"] == len(t) == len(all_ids) == THREADS * per_thread + 10
    assert st["inserts"] == st["entries"]
    assert set(t.keys()) == set(all_ids)
    assert sorted(q for r in rollouts for q in t.rollout_requests(r)) == sorted(all_ids)
    assert st["bytes"] == sum(t.get(q).nbytes for q in all_ids)
    held = [t.get(q) for q in all_ids[::7]]

    def discard_all(i, barrier):
        order = all_ids[:]
        random.Random(i).shuffle(order)
        barrier.wait()
        return [q for q in order if t.discard(q)]

    results = run_threads(discard_all)
    assert Counter(q for r in results for q in r) == Counter(all_ids), "exactly one True per discarded id"
    st = t.stats()
    assert (st["entries"], st["bytes"], st["discards"], st["swept"]) == (0, 0, len(all_ids), 0)
    assert st["live_bytes"] == sum(v.nbytes for v in held)
    assert all(tag_of(v) for v in held)
    del held
    assert t.stats()["live_bytes"] == 0
    for r in rollouts:
        assert t.rollout_requests(r) == [] and t.close_rollout(r) == []
    assert t.stats()["open_rollouts"] == 0


def test_intercept_discard_races_close():
    """Every intercept is removed exactly once: by one discard, or by the close."""
    t = InterceptTable()
    rounds = 20
    per_round = 64
    for rnd in range(rounds):
        r = f"r{rnd}"
        t.open_rollout(r)
        ids = [f"{r}-q{k}" for k in range(per_round)]
        for k, q in enumerate(ids):
            t.insert(q, r, tagged(k, BIG if k % 2 else 8), protocol="p", stream=False)
        closed: list[list[str]] = []

        def work(i, barrier):
            barrier.wait()
            if i == 0:
                time.sleep(random.random() * 0.0005)
                closed.append(t.close_rollout(r))
                return []
            order = ids[:]
            random.Random(i * rounds + rnd).shuffle(order)
            return [q for q in order if t.discard(q)]

        results = run_threads(work)
        (swept,) = closed
        removed = Counter(q for res in results for q in res) + Counter(swept)
        assert removed == Counter(ids)
        assert len(t) == 0 and not t.is_open(r)
    st = t.stats()
    assert st["discards"] + st["swept"] == st["inserts"] == rounds * per_round
    assert (st["entries"], st["bytes"], st["live_bytes"], st["open_rollouts"]) == (0, 0, 0, 0)


@pytest.mark.parametrize("threshold", [4096, 1 << 20])
def test_intercept_insert_races_close(threshold):
    """Many threads insert into a rollout while another closes it, repeatedly.

    Afterwards the table is empty; every insert that returned is either in the
    list close_rollout returned or was discarded by its inserter; every other
    insert raised RolloutClosed; the close returned only ids that were inserted.
    """
    t = InterceptTable(mmap_threshold=threshold)
    rounds = 80
    inserters = THREADS - 1
    stats_before = t.stats()
    for rnd in range(rounds):
        r = f"r{rnd}"
        t.open_rollout(r)
        closed: list[list[str]] = []

        def work(i, barrier):
            out = {"ok": [], "closed": [], "discarded": [], "other": []}
            if i == 0:
                barrier.wait()
                time.sleep(random.Random(rnd).random() * 0.002)
                closed.append(t.close_rollout(r))
                return out
            rng = random.Random(rnd * 100 + i)
            barrier.wait()
            deadline = time.monotonic() + 10.0
            s = 0
            while True:
                q = f"{r}-t{i}-{s}"
                s += 1
                try:
                    t.insert(q, r, tagged(make_tag(i, s), rng.choice([BIG, BIG, 8])), protocol="p", stream=False)
                except RolloutClosed:
                    out["closed"].append(q)
                    break
                except Exception as e:
                    out["other"].append((q, repr(e)))
                    break
                out["ok"].append(q)
                if rng.random() < 0.3:
                    if t.discard(q):
                        out["discarded"].append(q)
                if s > 200:
                    time.sleep(0.0005)  # a starved closer: let it run (and bound the memory held)
                if time.monotonic() > deadline:
                    break
            return out

        results = run_threads(work)
        (swept,) = closed
        ok = {q for res in results for q in res["ok"]}
        discarded = {q for res in results for q in res["discarded"]}
        refused = {q for res in results for q in res["closed"]}
        assert [e for res in results for e in res["other"]] == []
        assert len(swept) == len(set(swept))
        # Nothing outlives the close.
        assert len(t) == 0 and t.keys() == [], f"round {rnd}: {t.keys()[:5]} outlived the close"
        assert t.rollout_requests(r) == [] and not t.is_open(r)
        # Every successful insert is accounted for exactly once.
        assert ok <= set(swept) | discarded
        assert not (set(swept) & discarded)
        # The close only returned ids someone tried to insert; any it returned that
        # did not succeed must have been refused with RolloutClosed.
        assert set(swept) <= ok | refused
        # Each inserter stopped at its first refusal (after the close).
        assert len(refused) == inserters
        st = t.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"], st["open_rollouts"]) == (0, 0, 0, 0)
        assert st["inserts"] == st["discards"] + st["swept"]
    st = t.stats()
    assert st["discards"] - stats_before["discards"] > 0
    assert st["rejected"] == 0
