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
from hypothesis.stateful import rule

from lowwater._native import DTYPES, BufferFull, FetchBuffer, ShardView

from ._tables import FETCH_KEYS, INPUT_KINDS, MACHINE_SETTINGS, NP_DTYPE, SIZE_KINDS, Held, TableMachine, as_input

IDS = ["a", "b", "c", "d"]
UNKNOWN = ["zz", ""]


@dataclass
class Entry:
    token: int  # identity of one stored payload
    data: bytes
    dtype: str
    shape: tuple[int, ...]
    owner: str


class FetchBufferMachine(TableMachine):
    table_class = FetchBuffer
    stats_keys = FETCH_KEYS
    probe_keys = IDS + UNKNOWN

    def __init__(self):
        super().__init__()
        self.c = dict.fromkeys(FETCH_KEYS, 0)

    # ---------------------------------------------------------------- helpers

    def array_of(self, view, entry: Entry) -> np.ndarray:
        return np.frombuffer(view, NP_DTYPE[entry.dtype]).reshape(entry.shape)

    def check_view(self, v: ShardView, shard_id: str, e: Entry) -> None:
        assert isinstance(v, ShardView)
        assert (v.shard_id, v.dtype, v.shape, v.owner) == (shard_id, e.dtype, e.shape, e.owner)
        assert v.nbytes == len(v) == len(e.data)
        assert bytes(v) == e.data
        a = np.frombuffer(v, NP_DTYPE[e.dtype]).reshape(e.shape)
        assert a.tobytes() == e.data and not a.flags.writeable

    def check_stats(self, got: dict[str, int]) -> None:
        assert got["peak_bytes"] >= got["bytes"]
        assert got["inserts"] - got["removals"] == got["entries"]
        if self.capacity is not None:
            assert got["bytes"] <= self.capacity

    def check_held(self, h: Held) -> None:
        assert h.obj.shape == h.entry.shape
        if isinstance(h.obj, ShardView):
            assert h.obj.shard_id == h.key

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
        data = self.next_payload(n)
        src = as_input(data, dtype, shape, input_kind)
        before = self.held_bytes
        old = self.model.get(shard_id)
        replacing = len(old.data) if old else 0
        if self.capacity is not None and before + n - replacing > self.capacity:
            with pytest.raises(BufferFull):
                self.t.put(shard_id, src, dtype=dtype, shape=shape, owner=owner)
            self.c["rejected"] += 1
            return
        self.t.put(shard_id, src, dtype=dtype, shape=shape, owner=owner)
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
            self.t.put(shard_id, data, dtype=dtype, shape=shape)

    @rule(shard_id=st.sampled_from(IDS + UNKNOWN), keep=st.sampled_from([True, True, False]), as_array=st.booleans())
    def get(self, shard_id, keep, as_array):
        v = self.t.get(shard_id)
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
        v = self.t.pop(shard_id)
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
        assert self.t.clear(arg) == expected
        self.c["removals"] += expected

    @rule()
    def clear_all(self):
        assert self.t.clear() == len(self.model)
        self.c["removals"] += len(self.model)
        self.model.clear()

    @rule()
    def clear_str_refused(self):
        with pytest.raises(TypeError):
            self.t.clear("abc")


FetchBufferMachine.TestCase.settings = MACHINE_SETTINGS
TestFetchBufferStateful = FetchBufferMachine.TestCase
