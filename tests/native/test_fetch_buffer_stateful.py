"""FetchBuffer against a model dict (Hypothesis state machine).

Ids come from a small alphabet so puts, gets, pops and clears collide;
payload sizes are 0, small, at the mmap threshold's edge or above it (tables
use a 4 KiB threshold so "above" stays cheap, and some the 1 MiB default);
views are held across pop / replace / clear and dropped again.  After every
step every stats key is compared with the model, and so are len / keys /
``in`` and the bytes of every held view.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lowwater._native import DTYPES, BufferFull, FetchBuffer, ShardView

IDS = ["a", "b", "c", "d"]
UNKNOWN = ["zz", ""]
FETCH_KEYS = {"entries", "bytes", "peak_bytes", "live_bytes", "inserts", "hits", "misses", "removals", "rejected"}
NP_DTYPE = {name: ("uint16" if name == "bfloat16" else name) for name in DTYPES}
MAX_VIEWS = 8
SIZE_KINDS = ["zero", "small", "below", "at", "above"]
INPUT_KINDS = ["bytes", "bytearray", "memoryview", "numpy", "strided"]


@dataclass
class Entry:
    token: int  # identity of one stored payload
    data: bytes
    dtype: str
    shape: tuple[int, ...]
    owner: str


@dataclass
class Held:
    obj: object  # a ShardView, or a numpy array made from one (which keeps it alive)
    shard_id: str
    entry: Entry


def payload_bytes(serial: int, n: int) -> bytes:
    """``n`` bytes that differ from one put to the next."""
    if n == 0:
        return b""
    rng = np.random.default_rng(serial)
    head = rng.bytes(min(n, 64))
    return (head * (n // len(head) + 1))[:n]


def as_input(data: bytes, dtype: str, shape: tuple[int, ...], kind: str):
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    arr = np.frombuffer(data, NP_DTYPE[dtype]).reshape(shape)
    if kind == "numpy":
        return arr
    # strided: the same items, every other one of a twice-as-long array
    flat = arr.reshape(-1)
    big = np.empty(flat.size * 2, dtype=flat.dtype)
    big[::2] = flat
    out = big[::2]
    if flat.size > 1:
        assert not out.flags.c_contiguous
    return out.reshape(shape)


class FetchBufferMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.fb: FetchBuffer | None = None
        self.model: dict[str, Entry] = {}
        self.held: list[Held] = []
        self.serial = 0
        self.c = dict.fromkeys(FETCH_KEYS, 0)

    # ---------------------------------------------------------------- setup

    @initialize(
        threshold=st.sampled_from([4096, 4096, 1 << 20]),
        capacity=st.sampled_from(["none", "none", "tiny", "two_large"]),
    )
    def setup(self, threshold, capacity):
        self.threshold = threshold
        self.capacity = {"none": None, "tiny": 200, "two_large": 2 * threshold + 300}[capacity]
        if threshold == 1 << 20 and self.capacity is None:
            self.fb = FetchBuffer()  # the defaults
        else:
            self.fb = FetchBuffer(capacity_bytes=self.capacity, mmap_threshold=threshold)
        assert self.fb.mmap_threshold == threshold and self.fb.capacity_bytes == self.capacity

    # ---------------------------------------------------------------- helpers

    def nbytes_for(self, kind: str, jitter: int) -> int:
        t = self.threshold
        return {
            "zero": 0,
            "small": 1 + jitter % 64,
            "below": t - 1 - jitter % 16,
            "at": t,
            "above": t + 1 + jitter % 3000,
        }[kind]

    @property
    def held_bytes(self) -> int:
        return sum(len(e.data) for e in self.model.values())

    def expected_live(self) -> int:
        alive = {e.token: len(e.data) for e in self.model.values()}
        alive.update((h.entry.token, len(h.entry.data)) for h in self.held)
        return sum(alive.values())

    def keep(self, obj: ShardView, shard_id: str, entry: Entry, as_array: bool) -> None:
        if len(self.held) >= MAX_VIEWS:
            self.held.pop(0)
        if as_array:
            obj = np.frombuffer(obj, NP_DTYPE[entry.dtype]).reshape(entry.shape)
        self.held.append(Held(obj, shard_id, entry))

    def check_view(self, v: ShardView, shard_id: str, e: Entry) -> None:
        assert isinstance(v, ShardView)
        assert (v.shard_id, v.dtype, v.shape, v.owner) == (shard_id, e.dtype, e.shape, e.owner)
        assert v.nbytes == len(v) == len(e.data)
        assert bytes(v) == e.data
        a = np.frombuffer(v, NP_DTYPE[e.dtype]).reshape(e.shape)
        assert a.tobytes() == e.data and not a.flags.writeable

    # ---------------------------------------------------------------- rules

    @rule(
        shard_id=st.sampled_from(IDS),
        size_kind=st.sampled_from(SIZE_KINDS),
        jitter=st.integers(0, 1 << 16),
        dtype=st.sampled_from(sorted(DTYPES)),
        input_kind=st.sampled_from(INPUT_KINDS),
        layout=st.sampled_from(["flat", "row", "col"]),
        owner=st.sampled_from(["", "host-1:8000"]),
    )
    def put(self, shard_id, size_kind, jitter, dtype, input_kind, layout, owner):
        item = DTYPES[dtype]
        items = self.nbytes_for(size_kind, jitter) // item
        n = items * item
        shape = {"flat": (items,), "row": (1, items), "col": (items, 1)}[layout]
        self.serial += 1
        data = payload_bytes(self.serial, n)
        src = as_input(data, dtype, shape, input_kind)
        before = self.held_bytes
        old = self.model.get(shard_id)
        replacing = len(old.data) if old else 0
        if self.capacity is not None and before + n - replacing > self.capacity:
            with pytest.raises(BufferFull):
                self.fb.put(shard_id, src, dtype=dtype, shape=shape, owner=owner)
            self.c["rejected"] += 1
            return
        self.fb.put(shard_id, src, dtype=dtype, shape=shape, owner=owner)
        self.model[shard_id] = Entry(self.serial, data, dtype, shape, owner)
        self.c["inserts"] += 1
        if old is not None:
            self.c["removals"] += 1
        # The peak is taken once the put has released what it replaced.
        self.c["peak_bytes"] = max(self.c["peak_bytes"], before + n - replacing)

    @rule(
        shard_id=st.sampled_from(IDS),
        mistake=st.sampled_from(["short", "long", "dtype", "negative", "not_buffer", "str_shape"]),
    )
    def put_invalid(self, shard_id, mistake):
        data, dtype, shape, exc = b"\x01" * 8, "float32", (2,), ValueError
        if mistake == "short":
            data = data[:7]
        elif mistake == "long":
            shape = (1,)
        elif mistake == "dtype":
            dtype = "float128"
        elif mistake == "negative":
            shape = (-2,)
        elif mistake == "not_buffer":
            data, exc = "x" * 8, TypeError
        elif mistake == "str_shape":
            shape, exc = "2", TypeError
        with pytest.raises(exc):
            self.fb.put(shard_id, data, dtype=dtype, shape=shape)

    @rule(shard_id=st.sampled_from(IDS + UNKNOWN), keep=st.sampled_from([True, True, False]), as_array=st.booleans())
    def get(self, shard_id, keep, as_array):
        v = self.fb.get(shard_id)
        e = self.model.get(shard_id)
        if e is None:
            assert v is None
            self.c["misses"] += 1
            return
        self.c["hits"] += 1
        self.check_view(v, shard_id, e)
        if keep:
            self.keep(v, shard_id, e, as_array)

    @rule(shard_id=st.sampled_from(IDS + UNKNOWN), keep=st.sampled_from([True, True, False]), as_array=st.booleans())
    def pop(self, shard_id, keep, as_array):
        v = self.fb.pop(shard_id)
        e = self.model.pop(shard_id, None)
        if e is None:
            assert v is None
            self.c["misses"] += 1
            return
        self.c["hits"] += 1
        self.c["removals"] += 1
        self.check_view(v, shard_id, e)
        if keep:
            self.keep(v, shard_id, e, as_array)

    @rule(
        ids=st.lists(st.sampled_from(IDS + UNKNOWN), max_size=6),
        container=st.sampled_from(["list", "tuple", "set", "gen"]),
    )
    def clear_some(self, ids, container):
        arg = {"list": list, "tuple": tuple, "set": set, "gen": iter}[container](ids)
        expected = sum(1 for k in set(ids) if self.model.pop(k, None) is not None)
        assert self.fb.clear(arg) == expected
        self.c["removals"] += expected

    @rule()
    def clear_all(self):
        assert self.fb.clear() == len(self.model)
        self.c["removals"] += len(self.model)
        self.model.clear()

    @rule()
    def clear_str_refused(self):
        with pytest.raises(TypeError):
            self.fb.clear("abc")

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def drop_some_views(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        live_before = self.fb.stats()["live_bytes"]
        gone = self.held.pop(i)
        freed = 0
        still = {h.entry.token for h in self.held} | {e.token for e in self.model.values()}
        if gone.entry.token not in still:
            freed = len(gone.entry.data)
        del gone
        assert self.fb.stats()["live_bytes"] == live_before - freed

    @precondition(lambda self: self.held)
    @rule()
    def drop_all_views(self):
        self.held.clear()
        st_ = self.fb.stats()
        assert st_["live_bytes"] == st_["bytes"] == self.held_bytes

    # ---------------------------------------------------------------- invariants

    @invariant()
    def stats_match_model(self):
        if self.fb is None:
            return
        got = self.fb.stats()
        assert set(got) == FETCH_KEYS
        want = dict(self.c)
        want["entries"] = len(self.model)
        want["bytes"] = self.held_bytes
        want["live_bytes"] = self.expected_live()
        assert got == want
        assert got["peak_bytes"] >= got["bytes"]
        assert got["inserts"] - got["removals"] == got["entries"]
        if self.capacity is not None:
            assert got["bytes"] <= self.capacity

    @invariant()
    def membership_matches_model(self):
        if self.fb is None:
            return
        assert len(self.fb) == len(self.model)
        keys = self.fb.keys()
        assert len(keys) == len(set(keys)) and set(keys) == set(self.model)
        for k in IDS + UNKNOWN:
            assert (k in self.fb) == (k in self.model)

    @invariant()
    def held_views_unchanged(self):
        for h in self.held:
            if isinstance(h.obj, ShardView):
                assert bytes(h.obj) == h.entry.data
                assert h.obj.shard_id == h.shard_id and h.obj.shape == h.entry.shape
            else:
                assert h.obj.tobytes() == h.entry.data and h.obj.shape == h.entry.shape


FetchBufferMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFetchBufferStateful = FetchBufferMachine.TestCase
