"""FetchBuffer: API contract of ``lowwater._native`` (example-based tests).

The model-based checks live in ``test_fetch_buffer_stateful.py``; the threaded
ones in ``test_threads.py``; RSS in ``test_rss.py``; what both tables do alike
(construction, the fresh stats) in ``test_tables.py``.
"""

from __future__ import annotations

import ctypes
import gc
import math

import numpy as np
import pytest

import lowwater
from lowwater import _native
from lowwater._native import BufferFull, FetchBuffer, ShardView

from ._tables import FETCH_KEYS, NP_DTYPE

PAGE = 4096


def array_of(view) -> np.ndarray:
    return np.frombuffer(view, NP_DTYPE[view.dtype]).reshape(view.shape)


def data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def mapping_of(addr: int) -> str | None:
    """The /proc/self/maps line of the mapping holding ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line
    return None


# --------------------------------------------------------------------------- errors


def test_exception_hierarchy():
    assert issubclass(lowwater.LowwaterError, Exception)
    assert not issubclass(Exception, lowwater.LowwaterError)
    for exc in (lowwater.BufferFull, lowwater.RolloutClosed, lowwater.InternalError):
        assert issubclass(exc, lowwater.LowwaterError)
        assert issubclass(exc, Exception)
    # The package re-exports the extension's classes, not copies.
    assert lowwater.BufferFull is _native.BufferFull
    assert lowwater.RolloutClosed is _native.RolloutClosed
    assert lowwater.InternalError is _native.InternalError
    assert lowwater.LowwaterError is _native.LowwaterError
    # Distinct classes: catching one does not catch another.
    assert len({lowwater.BufferFull, lowwater.RolloutClosed, lowwater.InternalError}) == 3
    assert not issubclass(lowwater.BufferFull, lowwater.RolloutClosed)


def test_dtypes_table():
    assert _native.DTYPES == {
        "bool": 1,
        "int8": 1,
        "uint8": 1,
        "int16": 2,
        "uint16": 2,
        "float16": 2,
        "bfloat16": 2,
        "int32": 4,
        "uint32": 4,
        "float32": 4,
        "int64": 8,
        "uint64": 8,
        "float64": 8,
        "complex64": 8,
        "complex128": 16,
    }
    for name, size in _native.DTYPES.items():
        assert np.dtype(NP_DTYPE[name]).itemsize == size


# --------------------------------------------------------------------------- construction


# Construction and the fresh stats: test_tables.py (both tables alike).


# --------------------------------------------------------------------------- put / get / pop


@pytest.mark.parametrize("dtype", sorted(_native.DTYPES))
@pytest.mark.parametrize("threshold", [PAGE, 1 << 20])
def test_roundtrip_every_dtype_zero_copy(dtype, threshold):
    rng = np.random.default_rng(7)
    shape = (3, 700)  # 2100 items: below 4096 bytes for 1-byte dtypes, above for wider ones
    src = np.frombuffer(rng.bytes(math.prod(shape) * _native.DTYPES[dtype]), NP_DTYPE[dtype]).reshape(shape)
    fb = FetchBuffer(mmap_threshold=threshold)
    fb.put("s", src, dtype=dtype, shape=shape, owner="host:1")
    v = fb.get("s")
    assert isinstance(v, ShardView)
    assert (v.shard_id, v.dtype, v.shape, v.owner) == ("s", dtype, shape, "host:1")
    assert v.nbytes == len(v) == src.nbytes
    a, b = array_of(v), array_of(v)
    assert a.tobytes() == src.tobytes()
    # Zero-copy: two frombuffer calls of one view, and two views of one entry, share the payload.
    assert np.shares_memory(a, b) and data_ptr(a) == data_ptr(b)
    assert data_ptr(array_of(fb.get("s"))) == data_ptr(a)
    # ... and the payload is a copy of the input, not the input itself.
    assert not np.shares_memory(a, src)


def test_view_is_read_only():
    fb = FetchBuffer()
    fb.put("s", np.arange(16, dtype=np.int32), dtype="int32", shape=(16,))
    v = fb.get("s")
    m = memoryview(v)
    assert m.readonly and m.nbytes == 64 and m.format == "B" and m.c_contiguous
    with pytest.raises(TypeError):
        m[0] = 1
    a = array_of(v)
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    with pytest.raises(ValueError):
        a.flags.writeable = True
    assert bytes(v) == np.arange(16, dtype=np.int32).tobytes()


def test_view_refuses_writable_export():
    fb = FetchBuffer()
    fb.put("s", b"abcd", dtype="uint8", shape=(4,))
    v = fb.get("s")
    with pytest.raises((BufferError, TypeError)):
        (ctypes.c_char * 4).from_buffer(v)  # requires a writable buffer


@pytest.mark.parametrize("threshold", [PAGE, 1 << 20])
def test_payloads_from_buffer_kinds(threshold):
    fb = FetchBuffer(mmap_threshold=threshold)
    raw = bytes(range(256)) * 40  # 10240 bytes
    fb.put("bytes", raw, dtype="uint8", shape=(len(raw),))
    fb.put("bytearray", bytearray(raw), dtype="uint8", shape=(len(raw),))
    fb.put("memoryview", memoryview(raw), dtype="uint8", shape=(len(raw),))
    fb.put("reshaped", np.frombuffer(raw, np.uint16).reshape(64, 80), dtype="uint16", shape=[64, 80])
    for k in ("bytes", "bytearray", "memoryview", "reshaped"):
        assert bytes(fb.get(k)) == raw


@pytest.mark.parametrize("threshold", [PAGE, 1 << 20])
def test_non_contiguous_input_is_stored_c_order(threshold):
    base = np.arange(200 * 30, dtype=np.float64).reshape(200, 30)
    fb = FetchBuffer(mmap_threshold=threshold)
    cases = {
        "rows": base[::3],  # strided rows
        "cols": base[:, 1::2],  # strided columns
        "transposed": base.T,  # Fortran order
        "reversed": base[::-1, ::-1],  # negative strides
    }
    for k, arr in cases.items():
        assert not arr.flags.c_contiguous
        fb.put(k, arr, dtype="float64", shape=arr.shape)
    for k, arr in cases.items():
        np.testing.assert_array_equal(array_of(fb.get(k)), arr)
    # A strided memoryview (not numpy) too.
    mv = memoryview(bytes(range(100)))[::2]
    fb.put("mv", mv, dtype="uint8", shape=(50,))
    assert bytes(fb.get("mv")) == bytes(range(0, 100, 2))


def test_zero_size_and_scalar_shapes():
    for threshold in (0, 1, PAGE):
        fb = FetchBuffer(mmap_threshold=threshold)
        fb.put("empty", b"", dtype="float32", shape=(0,))
        fb.put("empty2d", b"", dtype="float64", shape=(4, 0, 3))
        fb.put("scalar", np.float32(1.5).tobytes(), dtype="float32", shape=())
        assert bytes(fb.get("empty")) == b"" and len(fb.get("empty")) == 0
        assert array_of(fb.get("empty2d")).shape == (4, 0, 3)
        s = fb.get("scalar")
        assert s.shape == () and array_of(s)[()] == np.float32(1.5)
        st = fb.stats()
        assert (st["entries"], st["bytes"], st["live_bytes"]) == (3, 4, 4)


def test_many_dimensions_shape():
    # More dimensions than the binding's on-stack fast path (8), as tuple and list.
    shape = (1, 2, 1, 2, 1, 2, 1, 2, 1, 3)
    fb = FetchBuffer()
    src = np.arange(48, dtype=np.int16).reshape(shape)
    fb.put("t", src, dtype="int16", shape=shape)
    fb.put("l", src, dtype="int16", shape=list(shape))
    fb.put("g", src, dtype="int16", shape=iter(shape))
    for k in "tlg":
        v = fb.get(k)
        assert v.shape == shape
        np.testing.assert_array_equal(array_of(v), src)


def test_above_threshold_payload_is_its_own_read_only_mapping():
    fb = FetchBuffer(mmap_threshold=PAGE)
    for i, n in enumerate([PAGE, PAGE + 1, 3 * PAGE + 17, 1 << 20]):
        fb.put(f"s{i}", np.full(n, i + 1, np.uint8), dtype="uint8", shape=(n,))
        addr = data_ptr(array_of(fb.get(f"s{i}")))
        assert addr % PAGE == 0, f"{n}-byte payload not at a page boundary: not its own mapping"
        line = mapping_of(addr)
        assert line is not None and line.split()[1].startswith("r--"), line


def test_put_errors():
    fb = FetchBuffer(capacity_bytes=1 << 20)
    with pytest.raises(ValueError):  # size / shape mismatch
        fb.put("a", b"abc", dtype="uint8", shape=(4,))
    with pytest.raises(ValueError):
        fb.put("a", b"abcd", dtype="float32", shape=(4,))
    with pytest.raises(ValueError):
        fb.put("a", b"abcd", dtype="float32", shape=(0,))
    with pytest.raises(ValueError):  # unknown dtype
        fb.put("a", b"abcd", dtype="float8", shape=(4,))
    with pytest.raises(ValueError):
        fb.put("a", b"abcd", dtype="", shape=(4,))
    with pytest.raises(ValueError):  # negative dimension
        fb.put("a", b"abcd", dtype="uint8", shape=(-4,))
    with pytest.raises(ValueError):
        fb.put("a", b"", dtype="uint8", shape=(-1, 0))
    with pytest.raises(ValueError):  # overflowing shape
        fb.put("a", b"abcd", dtype="uint64", shape=(1 << 62, 8))
    with pytest.raises(TypeError):  # non-buffer data
        fb.put("a", "abcd", dtype="uint8", shape=(4,))
    with pytest.raises(TypeError):
        fb.put("a", [1, 2, 3, 4], dtype="uint8", shape=(4,))
    with pytest.raises(TypeError):
        fb.put("a", None, dtype="uint8", shape=(4,))
    with pytest.raises(TypeError):  # shape not a sequence of ints
        fb.put("a", b"abcd", dtype="uint8", shape="4")
    with pytest.raises(TypeError):
        fb.put("a", b"abcd", dtype="uint8", shape=(4.0,))
    with pytest.raises(TypeError):
        fb.put("a", b"abcd", dtype="uint8", shape=4)
    with pytest.raises(TypeError):  # dtype and shape are keyword-only and required
        fb.put("a", b"abcd", "uint8", (4,))
    with pytest.raises(TypeError):
        fb.put("a", b"abcd", shape=(4,))
    # Nothing was stored, reserved or counted by any of the refusals.
    st = fb.stats()
    assert st == dict.fromkeys(FETCH_KEYS, 0)
    assert "a" not in fb and len(fb) == 0


def test_put_error_on_existing_id_keeps_old_entry():
    fb = FetchBuffer()
    fb.put("a", b"good", dtype="uint8", shape=(4,))
    v = fb.get("a")
    with pytest.raises(ValueError):
        fb.put("a", b"bad", dtype="uint8", shape=(4,))
    with pytest.raises(TypeError):
        fb.put("a", "bad!", dtype="uint8", shape=(4,))
    assert bytes(fb.get("a")) == b"good" and bytes(v) == b"good"
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["inserts"], st["removals"]) == (1, 4, 1, 0)


def test_get_pop_unknown_count_misses():
    fb = FetchBuffer()
    assert fb.get("nope") is None
    assert fb.pop("nope") is None
    assert fb.get("") is None
    st = fb.stats()
    assert (st["hits"], st["misses"]) == (0, 3)
    fb.put("a", b"x", dtype="uint8", shape=(1,))
    assert bytes(fb.get("a")) == b"x"
    assert bytes(fb.pop("a")) == b"x"
    assert fb.pop("a") is None
    st = fb.stats()
    assert (st["hits"], st["misses"], st["removals"], st["entries"]) == (2, 4, 1, 0)


def test_contains_and_keys():
    fb = FetchBuffer()
    for k in ("a", "b", "", "é"):
        fb.put(k, b"", dtype="uint8", shape=(0,))
    assert sorted(fb.keys()) == sorted(["a", "b", "", "é"])
    assert "a" in fb and "" in fb and "é" in fb and "c" not in fb
    assert 1 not in fb and None not in fb and b"a" not in fb
    assert len(fb) == 4
    # contains / keys / len / stats never count hits or misses
    st = fb.stats()
    assert (st["hits"], st["misses"]) == (0, 0)


def test_replace_accounting():
    fb = FetchBuffer(mmap_threshold=PAGE)
    fb.put("a", b"1" * 100, dtype="uint8", shape=(100,))
    old = fb.get("a")
    fb.put("a", b"2" * 5000, dtype="uint8", shape=(5000,))
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["inserts"], st["removals"]) == (1, 5000, 2, 1)
    assert st["live_bytes"] == 5000 + 100  # the old payload is still viewed
    # The peak is taken once the put has released what it replaced.
    assert st["peak_bytes"] == 5000
    assert bytes(old) == b"1" * 100 and bytes(fb.get("a")) == b"2" * 5000
    del old
    assert fb.stats()["live_bytes"] == 5000
    fb.put("a", b"3" * 10, dtype="uint8", shape=(10,))
    st = fb.stats()
    assert (st["bytes"], st["live_bytes"], st["peak_bytes"], st["removals"]) == (10, 10, 5000, 2)


def test_clear_semantics():
    fb = FetchBuffer()
    for k in "abcde":
        fb.put(k, k.encode() * 3, dtype="uint8", shape=(3,))
    with pytest.raises(TypeError):
        fb.clear("abc")  # a bare str is refused (it would clear one-character ids)
    with pytest.raises(TypeError):
        fb.clear(["a", 1])
    with pytest.raises(TypeError):
        fb.clear(5)
    assert len(fb) == 5  # none of the refusals cleared anything...
    # ... though ids before a bad item are not removed either (all validated first).
    assert fb.clear(["a", "zz", "a", "b", ""]) == 2  # unknown and repeated ids are skipped
    assert fb.clear([]) == 0
    assert fb.clear(iter(["c"])) == 1
    assert fb.clear(x for x in ["d", "nope"]) == 1
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["removals"], st["hits"], st["misses"]) == (1, 3, 4, 0, 0)
    assert fb.keys() == ["e"]
    assert fb.clear() == 1
    assert fb.clear(None) == 0
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["live_bytes"], st["removals"]) == (0, 0, 0, 5)


# --------------------------------------------------------------------------- capacity


def test_capacity_rejects_without_evicting():
    fb = FetchBuffer(capacity_bytes=100)
    fb.put("a", b"a" * 60, dtype="uint8", shape=(60,))
    with pytest.raises(BufferFull):
        fb.put("b", b"b" * 41, dtype="uint8", shape=(41,))
    with pytest.raises(lowwater.LowwaterError):  # catchable by the base class
        fb.put("b", b"b" * 41, dtype="uint8", shape=(41,))
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["rejected"], st["inserts"], st["removals"]) == (1, 60, 2, 1, 0)
    assert st["live_bytes"] == 60 and st["peak_bytes"] == 60
    assert bytes(fb.get("a")) == b"a" * 60 and "b" not in fb
    fb.put("b", b"b" * 40, dtype="uint8", shape=(40,))  # exactly at capacity
    assert fb.stats()["bytes"] == 100
    with pytest.raises(BufferFull):
        fb.put("c", b"c", dtype="uint8", shape=(1,))
    fb.put("c", b"", dtype="uint8", shape=(0,))  # an empty payload always fits
    # Replacement: the replaced payload does not count against the bound.
    fb.put("a", b"A" * 60, dtype="uint8", shape=(60,))
    with pytest.raises(BufferFull):
        fb.put("a", b"A" * 61, dtype="uint8", shape=(61,))
    assert bytes(fb.get("a")) == b"A" * 60  # the refused replacement kept the old entry
    fb.put("a", b"A" * 10, dtype="uint8", shape=(10,))
    fb.put("d", b"d" * 50, dtype="uint8", shape=(50,))
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["rejected"]) == (4, 100, 4)


def test_capacity_zero():
    fb = FetchBuffer(capacity_bytes=0)
    fb.put("e", b"", dtype="uint8", shape=(0,))
    with pytest.raises(BufferFull):
        fb.put("x", b"x", dtype="uint8", shape=(1,))
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["rejected"], st["inserts"]) == (1, 0, 1, 1)


def test_views_do_not_count_against_capacity():
    # Capacity bounds bytes held by entries; removed-but-viewed payloads are live_bytes only.
    fb = FetchBuffer(capacity_bytes=100)
    fb.put("a", b"a" * 100, dtype="uint8", shape=(100,))
    v = fb.pop("a")
    fb.put("b", b"b" * 100, dtype="uint8", shape=(100,))
    st = fb.stats()
    assert (st["bytes"], st["live_bytes"]) == (100, 200)
    assert bytes(v) == b"a" * 100


# --------------------------------------------------------------------------- views outliving entries


@pytest.mark.parametrize("threshold", [PAGE, 1 << 20])
def test_view_held_after_clear_stays_readable_then_releases(threshold):
    fb = FetchBuffer(mmap_threshold=threshold)
    src = np.random.default_rng(1).integers(0, 2**31, size=(64, 1024), dtype=np.int32)  # 256 KiB
    fb.put("s", src, dtype="int32", shape=src.shape)
    v = fb.get("s")
    arr = array_of(fb.get("s"))  # a numpy array alone must keep the payload alive too
    mv = memoryview(fb.get("s"))
    assert fb.clear() == 1
    st = fb.stats()
    assert (st["entries"], st["bytes"], st["live_bytes"]) == (0, 0, src.nbytes)
    gc.collect()
    np.testing.assert_array_equal(array_of(v), src)
    np.testing.assert_array_equal(arr, src)
    assert mv.tobytes() == src.tobytes()
    del v
    assert fb.stats()["live_bytes"] == src.nbytes
    np.testing.assert_array_equal(arr, src)
    del arr
    assert fb.stats()["live_bytes"] == src.nbytes
    mv.release()
    del mv
    assert fb.stats()["live_bytes"] == 0


def test_view_outlives_table():
    fb = FetchBuffer(mmap_threshold=PAGE)
    fb.put("s", b"z" * 10000, dtype="uint8", shape=(10000,))
    v = fb.get("s")
    del fb
    gc.collect()
    assert bytes(v) == b"z" * 10000 and v.shard_id == "s"


def test_view_repr():
    fb = FetchBuffer()
    fb.put("s", b"\0" * 8, dtype="float32", shape=(2,), owner="o")
    assert repr(fb.get("s")) == 'ShardView(shard_id="s", dtype="float32", shape=(2,), nbytes=8, owner="o")'
    assert "entries=1" in repr(fb)
