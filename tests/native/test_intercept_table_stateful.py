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
import pytest
from hypothesis.stateful import invariant, rule

from lowwater._native import BufferFull, InterceptTable, InterceptView, RolloutClosed

from ._tables import INPUT_KINDS, INTERCEPT_KEYS, MACHINE_SETTINGS, SIZE_KINDS, Held, TableMachine, as_input

REQS = ["q0", "q1", "q2", "q3", "q4"]
ROLLOUTS = ["r0", "r1", "r2"]


@dataclass
class Entry:
    token: int
    rollout: str
    data: bytes
    protocol: str
    stream: bool


class InterceptTableMachine(TableMachine):
    table_class = InterceptTable
    stats_keys = INTERCEPT_KEYS
    probe_keys = REQS + ["zz"]

    def __init__(self):
        super().__init__()
        self.open: set[str] = set()
        self.c = dict.fromkeys(["peak_bytes", "inserts", "discards", "swept", "rejected"], 0)

    # ---------------------------------------------------------------- helpers

    def check_view(self, v, request_id: str, e: Entry) -> None:
        assert isinstance(v, InterceptView)
        assert (v.request_id, v.rollout_id, v.protocol, v.stream) == (request_id, e.rollout, e.protocol, e.stream)
        assert v.nbytes == len(v) == len(e.data)
        assert bytes(v) == e.data
        assert v.age_s >= 0.0

    def expected_stats(self) -> dict[str, int]:
        return {**super().expected_stats(), "open_rollouts": len(self.open)}

    def check_stats(self, got: dict[str, int]) -> None:
        assert got["inserts"] - got["discards"] - got["swept"] == got["entries"]
        if self.capacity is not None:
            assert got["peak_bytes"] <= self.capacity

    def check_held(self, h: Held) -> None:
        if isinstance(h.obj, InterceptView):
            assert h.obj.request_id == h.key

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
        size_kind=st.sampled_from(SIZE_KINDS),
        jitter=st.integers(0, 1 << 16),
        kind=st.sampled_from(INPUT_KINDS),
        protocol=st.sampled_from(["openai-chat", "anthropic", ""]),
        stream=st.booleans(),
    )
    def insert(self, request_id, rollout, size_kind, jitter, kind, protocol, stream):
        n = self.nbytes_for(size_kind, jitter)
        data = self.next_payload(n)
        body = as_input(data, "uint8", (n,), kind)
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
            self.keep(v, request_id, e, as_array)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def rollouts_match_model(self):
        if self.t is None:
            return
        for r in ROLLOUTS + ["never"]:
            assert self.t.is_open(r) == (r in self.open)
            got = self.t.rollout_requests(r)
            assert len(got) == len(set(got))
            assert set(got) == {q for q, e in self.model.items() if e.rollout == r}
        assert self.t.stale(3600.0) == []
        assert set(self.t.stale(0.0)) <= set(self.model)


InterceptTableMachine.TestCase.settings = MACHINE_SETTINGS
TestInterceptTableStateful = InterceptTableMachine.TestCase
