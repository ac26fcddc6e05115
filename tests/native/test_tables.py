"""What both tables (``FetchBuffer``, ``InterceptTable``) do alike: construction
and its argument checks, and the fresh stats.

The binding emits these methods for both from one macro (rust/py/src/table.rs),
so they are tested once, for each table.
"""

from __future__ import annotations

import pytest

from lowwater._native import FetchBuffer, InterceptTable

from ._tables import FETCH_KEYS, INTERCEPT_KEYS

PAGE = 4096
TABLES = pytest.mark.parametrize(
    ("table_class", "stats_keys"),
    [(FetchBuffer, FETCH_KEYS), (InterceptTable, INTERCEPT_KEYS)],
    ids=["FetchBuffer", "InterceptTable"],
)


@TABLES
def test_constructor_defaults_and_validation(table_class, stats_keys):
    t = table_class()
    assert t.capacity_bytes is None and t.mmap_threshold == 1 << 20
    t = table_class(capacity_bytes=0, mmap_threshold=0)
    assert t.capacity_bytes == 0 and t.mmap_threshold == 0
    t = table_class(capacity_bytes=10, mmap_threshold=PAGE)
    assert t.capacity_bytes == 10 and t.mmap_threshold == PAGE
    for bad in (-1, -5):
        with pytest.raises(ValueError):
            table_class(capacity_bytes=bad)
        with pytest.raises(ValueError):
            table_class(mmap_threshold=bad)


@TABLES
def test_fresh_stats_keys_are_exactly_documented(table_class, stats_keys):
    t = table_class()
    st = t.stats()
    assert set(st) == stats_keys
    assert all(type(v) is int and v == 0 for v in st.values())
    assert len(t) == 0 and t.keys() == []
    # A fresh dict each call (callers may keep one as a snapshot).
    st["entries"] = 99
    assert t.stats()["entries"] == 0
