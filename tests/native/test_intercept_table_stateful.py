"""InterceptTable against a model (Hypothesis state machine).

Request and rollout ids come from small alphabets so inserts collide
(duplicates, inserts into unopened / closed rollouts, re-opens); bodies are
0 bytes, small, at the mmap threshold's edge or above it; views are held
across discard and close and dropped again.  After every step every stats
key, len / keys / ``in``, ``is_open``, ``rollout_requests`` and the bytes of
every held view are compared with the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lowwater._native import BufferFull, InterceptTable, InterceptView, RolloutClosed

REQS = ["q0", "q1", "q2", "q3", "q4"]
ROLLOUTS = ["r0", "r1", "r2"]
INTERCEPT_KEYS = {
    "entries",
    "bytes",
    "peak_bytes",
    "live_bytes",
    "open_rollouts",
    "inserts",
    "discards",
    "swept",
    "rejected",
}
MAX_VIEWS = 8


@dataclass
class Entry:
    token: int
    rollout: str
    data: bytes
    protocol: str
    stream: bool


@dataclass
class Held:
    obj: object  # an InterceptView or a numpy array made from one
    request_id: str
    entry: Entry


def body_bytes(serial: int, n: int) -> bytes:
    if n == 0:
        return b""
    head = np.random.default_rng(serial).bytes(min(n, 64))
    return (head * (n // len(head) + 1))[:n]


class InterceptTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.t: InterceptTable | None = None
        self.open: set[str] = set()
        self.model: dict[str, Entry] = {}
        self.held: list[Held] = []
        self.serial = 0
        self.c = dict.fromkeys(["peak_bytes", "inserts", "discards", "swept", "rejected"], 0)

    @initialize(
        threshold=st.sampled_from([4096, 4096, 1 << 20]),
        capacity=st.sampled_from(["none", "none", "tiny", "two_large"]),
    )
    def setup(self, threshold, capacity):
        self.threshold = threshold
        self.capacity = {"none": None, "tiny": 200, "two_large": 2 * threshold + 300}[capacity]
        if threshold == 1 << 20 and self.capacity is None:
            self.t = InterceptTable()
        else:
            self.t = InterceptTable(capacity_bytes=self.capacity, mmap_threshold=threshold)

    # ---------------------------------------------------------------- helpers

    @property
    def held_bytes(self) -> int:
        return sum(len(e.data) for e in self.model.values())

    def expected_live(self) -> int:
        alive = {e.token: len(e.data) for e in self.model.values()}
        alive.update((h.entry.token, len(h.entry.data)) for h in self.held)
        return sum(alive.values())

    def check_view(self, v, request_id: str, e: Entry) -> None:
        assert isinstance(v, InterceptView)
        assert (v.request_id, v.rollout_id, v.protocol, v.stream) == (request_id, e.rollout, e.protocol, e.stream)
        assert v.nbytes == len(v) == len(e.data)
        assert bytes(v) == e.data
        assert v.age_s >= 0.0

    # ---------------------------------------------------------------- rules

    @rule(rollout=st.sampled_from(ROLLOUTS))
    def open_rollout(self, rollout):
        self.t.open_rollout(rollout)
        self.open.add(rollout)

    @rule(rollout=st.sampled_from(ROLLOUTS + ["never"]))
    def close_rollout(self, rollout):
        got = self.t.close_rollout(rollout)
        assert isinstance(got, list) and len(got) == len(set(got))
        pending = {q for q, e in self.model.items() if e.rollout == rollout}
        if rollout not in self.open:
            assert pending == set()
            assert got == []
            return
        assert set(got) == pending
        for q in pending:
            del self.model[q]
        self.c["swept"] += len(pending)
        self.open.discard(rollout)

    @rule(
        request_id=st.sampled_from(REQS),
        rollout=st.sampled_from(ROLLOUTS),
        size_kind=st.sampled_from(["zero", "small", "below", "at", "above"]),
        jitter=st.integers(0, 1 << 16),
        kind=st.sampled_from(["bytes", "bytearray", "memoryview", "numpy", "strided"]),
        protocol=st.sampled_from(["openai-chat", "anthropic", ""]),
        stream=st.booleans(),
    )
    def insert(self, request_id, rollout, size_kind, jitter, kind, protocol, stream):
        t = self.threshold
        n = {
            "zero": 0,
            "small": 1 + jitter % 64,
            "below": t - 1 - jitter % 16,
            "at": t,
            "above": t + 1 + jitter % 3000,
        }[size_kind]
        self.serial += 1
        data = body_bytes(self.serial, n)
        if kind == "bytes":
            body = data
        elif kind == "bytearray":
            body = bytearray(data)
        elif kind == "memoryview":
            body = memoryview(data)
        elif kind == "numpy":
            body = np.frombuffer(data, np.uint8)
        else:
            big = np.zeros(2 * n, np.uint8)
            big[1::2] = np.frombuffer(data, np.uint8)
            body = big[1::2]
        before = self.held_bytes

        def call():
            self.t.insert(request_id, rollout, body, protocol=protocol, stream=stream)

        if rollout not in self.open:
            with pytest.raises(RolloutClosed):
                call()
        elif request_id in self.model:
            with pytest.raises(KeyError):
                call()
        elif self.capacity is not None and before + n > self.capacity:
            with pytest.raises(BufferFull):
                call()
            self.c["rejected"] += 1
        else:
            call()
            self.model[request_id] = Entry(self.serial, rollout, data, protocol, stream)
            self.c["inserts"] += 1
            self.c["peak_bytes"] = max(self.c["peak_bytes"], before + n)

    @rule(request_id=st.sampled_from(REQS), rollout=st.sampled_from(ROLLOUTS))
    def insert_not_a_buffer(self, request_id, rollout):
        with pytest.raises(TypeError):
            self.t.insert(request_id, rollout, "text", protocol="p", stream=False)

    @rule(request_id=st.sampled_from(REQS + ["zz"]), twice=st.booleans())
    def discard(self, request_id, twice):
        present = request_id in self.model
        assert self.t.discard(request_id) is present
        if present:
            del self.model[request_id]
            self.c["discards"] += 1
        if twice:
            assert self.t.discard(request_id) is False

    @rule(request_id=st.sampled_from(REQS + ["zz"]), keep=st.sampled_from([True, True, False]), as_array=st.booleans())
    def get(self, request_id, keep, as_array):
        v = self.t.get(request_id)
        e = self.model.get(request_id)
        if e is None:
            assert v is None
            return
        self.check_view(v, request_id, e)
        if keep:
            if len(self.held) >= MAX_VIEWS:
                self.held.pop(0)
            self.held.append(Held(np.frombuffer(v, np.uint8) if as_array else v, request_id, e))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def drop_one_view(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        live_before = self.t.stats()["live_bytes"]
        gone = self.held.pop(i)
        still = {h.entry.token for h in self.held} | {e.token for e in self.model.values()}
        freed = 0 if gone.entry.token in still else len(gone.entry.data)
        del gone
        assert self.t.stats()["live_bytes"] == live_before - freed

    @precondition(lambda self: self.held)
    @rule()
    def drop_all_views(self):
        self.held.clear()
        s = self.t.stats()
        assert s["live_bytes"] == s["bytes"] == self.held_bytes

    # ---------------------------------------------------------------- invariants

    @invariant()
    def stats_match_model(self):
        if self.t is None:
            return
        got = self.t.stats()
        assert set(got) == INTERCEPT_KEYS
        want = dict(self.c)
        want["entries"] = len(self.model)
        want["bytes"] = self.held_bytes
        want["live_bytes"] = self.expected_live()
        want["open_rollouts"] = len(self.open)
        assert got == want
        assert got["inserts"] - got["discards"] - got["swept"] == got["entries"]
        if self.capacity is not None:
            assert got["peak_bytes"] <= self.capacity

    @invariant()
    def membership_matches_model(self):
        if self.t is None:
            return
        assert len(self.t) == len(self.model)
        keys = self.t.keys()
        assert len(keys) == len(set(keys)) and set(keys) == set(self.model)
        for q in REQS + ["zz"]:
            assert (q in self.t) == (q in self.model)
        for r in ROLLOUTS + ["never"]:
            assert self.t.is_open(r) == (r in self.open)
            got = self.t.rollout_requests(r)
            assert len(got) == len(set(got))
            assert set(got) == {q for q, e in self.model.items() if e.rollout == r}
        assert self.t.stale(3600.0) == []
        assert set(self.t.stale(0.0)) <= set(self.model)

    @invariant()
    def held_views_unchanged(self):
        for h in self.held:
            if isinstance(h.obj, InterceptView):
                assert bytes(h.obj) == h.entry.data and h.obj.request_id == h.request_id
            else:
                assert h.obj.tobytes() == h.entry.data


InterceptTableMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestInterceptTableStateful = InterceptTableMachine.TestCase
