"""What the tests of the two tables (``FetchBuffer``, ``InterceptTable``) share.

The stats keys each documents, the payloads and buffer kinds they are fed, and
:class:`TableMachine`: the half of a Hypothesis state machine that is the same
for both (the table built from a sampled threshold and capacity, the model of
held entries, views held across removals and dropped again, live-byte
accounting, and the stats / membership / held-view invariants).  Each table's
machine adds its own rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lowwater._native import DTYPES

FETCH_KEYS = {"entries", "bytes", "peak_bytes", "live_bytes", "inserts", "hits", "misses", "removals", "rejected"}
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
#: numpy has no bfloat16: its items are read as uint16.
NP_DTYPE = {name: ("uint16" if name == "bfloat16" else name) for name in DTYPES}
SIZE_KINDS = ["zero", "small", "below", "at", "above"]
INPUT_KINDS = ["bytes", "bytearray", "memoryview", "numpy", "strided"]
MAX_VIEWS = 8
MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def payload_bytes(serial: int, n: int) -> bytes:
    """``n`` bytes that differ from one put to the next."""
    if n == 0:
        return b""
    rng = np.random.default_rng(serial)
    head = rng.bytes(min(n, 64))
    return (head * (n // len(head) + 1))[:n]


def as_input(data: bytes, dtype: str, shape: tuple[int, ...], kind: str):
    """``data`` as one of :data:`INPUT_KINDS` of buffer exporter."""
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    arr = np.frombuffer(data, NP_DTYPE[dtype]).reshape(shape)
    if kind == "numpy":
        return arr
    # strided: the same items, every other one of a twice-as-long array, from
    # its second item on (a view whose start is not its base's)
    flat = arr.reshape(-1)
    big = np.zeros(flat.size * 2, dtype=flat.dtype)
    big[1::2] = flat
    out = big[1::2]
    if flat.size > 1:
        assert not out.flags.c_contiguous
    return out.reshape(shape)


@dataclass
class Held:
    obj: object  # a view, or a numpy array made from one (which keeps it alive)
    key: str
    entry: Any  # the model's entry: has .token (identity of one stored payload) and .data


class TableMachine(RuleBasedStateMachine):
    """The shared half of a table's state machine; a subclass sets
    ``table_class``, ``stats_keys`` and ``probe_keys`` (ids checked with ``in``)
    and counts its events in ``self.c``."""

    table_class: type
    stats_keys: set[str]
    probe_keys: list[str]

    def __init__(self):
        super().__init__()
        self.t: Any = None
        self.model: dict[str, Any] = {}
        self.held: list[Held] = []
        self.serial = 0
        self.c: dict[str, int] = {}

    # ---------------------------------------------------------------- setup

    @initialize(
        threshold=st.sampled_from([4096, 4096, 1 << 20]),
        capacity=st.sampled_from(["none", "none", "tiny", "two_large"]),
    )
    def setup(self, threshold, capacity):
        self.threshold = threshold
        self.capacity = {"none": None, "tiny": 200, "two_large": 2 * threshold + 300}[capacity]
        if threshold == 1 << 20 and self.capacity is None:
            self.t = self.table_class()  # the defaults
        else:
            self.t = self.table_class(capacity_bytes=self.capacity, mmap_threshold=threshold)
        assert self.t.mmap_threshold == threshold and self.t.capacity_bytes == self.capacity

    # ---------------------------------------------------------------- helpers

    def nbytes_for(self, kind: str, jitter: int) -> int:
        """A payload size of ``kind`` (one of :data:`SIZE_KINDS`) around the mmap threshold."""
        t = self.threshold
        return {
            "zero": 0,
            "small": 1 + jitter % 64,
            "below": t - 1 - jitter % 16,
            "at": t,
            "above": t + 1 + jitter % 3000,
        }[kind]

    def next_payload(self, n: int) -> bytes:
        """``n`` fresh bytes; their entry's token is ``self.serial``."""
        self.serial += 1
        return payload_bytes(self.serial, n)

    @property
    def held_bytes(self) -> int:
        return sum(len(e.data) for e in self.model.values())

    def expected_live(self) -> int:
        alive = {e.token: len(e.data) for e in self.model.values()}
        alive.update((h.entry.token, len(h.entry.data)) for h in self.held)
        return sum(alive.values())

    def array_of(self, view, entry) -> np.ndarray:
        """A numpy array over ``view`` (it keeps the view alive)."""
        return np.frombuffer(view, np.uint8)

    def keep(self, view, key: str, entry, as_array: bool) -> None:
        """Hold ``view`` (or an array over it) across later steps; at most :data:`MAX_VIEWS`."""
        if len(self.held) >= MAX_VIEWS:
            self.held.pop(0)
        self.held.append(Held(self.array_of(view, entry) if as_array else view, key, entry))

    def expected_stats(self) -> dict[str, int]:
        """The model's stats: the counted ones and those the model implies."""
        return {**self.c, "entries": len(self.model), "bytes": self.held_bytes, "live_bytes": self.expected_live()}

    def check_stats(self, got: dict[str, int]) -> None:
        """The table's own relations between its counters."""

    def check_held(self, h: Held) -> None:
        """What a held view or array says besides its bytes (ids, shape)."""

    # ---------------------------------------------------------------- rules

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
        assert set(got) == self.stats_keys
        assert got == self.expected_stats()
        self.check_stats(got)

    @invariant()
    def membership_matches_model(self):
        if self.t is None:
            return
        assert len(self.t) == len(self.model)
        keys = self.t.keys()
        assert len(keys) == len(set(keys)) and set(keys) == set(self.model)
        for k in self.probe_keys:
            assert (k in self.t) == (k in self.model)

    @invariant()
    def held_views_unchanged(self):
        for h in self.held:
            if isinstance(h.obj, np.ndarray):
                assert h.obj.tobytes() == h.entry.data
            else:
                assert bytes(h.obj) == h.entry.data
            self.check_held(h)
