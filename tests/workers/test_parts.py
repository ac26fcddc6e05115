"""The pool's parts in-process: framing, admission hysteresis, memory limit
discovery, allocator settings."""

from __future__ import annotations

import os
import socket
import struct

import hypothesis.strategies as st
import orjson
import pytest
import trio
from hypothesis import given, settings

from lowwater.workers import JobSpec, PoolConfigError, WorkerPool
from lowwater.workers.admission import Hysteresis, PoolAdmission, memory_limit_bytes
from lowwater.workers.allocator import AllocatorSettings, apply, resolve
from lowwater.workers.child import load_factory
from lowwater.workers.protocol import FramedStream, ProtocolError, encode

from . import jobs


def _pair() -> tuple[FramedStream, FramedStream]:
    a, b = socket.socketpair()
    return FramedStream.from_fd(a.detach()), FramedStream.from_fd(b.detach())


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=40)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=50, deadline=None)
@given(messages=st.lists(st.dictionaries(st.text(max_size=10), json_values, max_size=6), min_size=1, max_size=8))
def test_frames_round_trip(messages):
    async def main():
        left, right = _pair()
        async with trio.open_nursery() as nursery:

            async def send_all():
                for m in messages:
                    await left.send(m)
                await left.aclose()

            nursery.start_soon(send_all)
            got = []
            while (m := await right.receive()) is not None:
                got.append(m)
            await right.aclose()
        assert got == [orjson.loads(orjson.dumps(m)) for m in messages]

    trio.run(main)


def test_large_frames_and_many_frames_in_one_write():
    async def main():
        left, right = _pair()
        big = {"rows": [{"x": "y" * 1000}] * 300}  # ~300 KB: several reads
        small = [{"i": i} for i in range(50)]
        async with trio.open_nursery() as nursery:

            async def writer():
                await left.send_frame(b"".join(encode(m) for m in small))
                await left.send(big)

            nursery.start_soon(writer)
            for m in small:
                assert await right.receive() == m
            assert await right.receive() == big

    trio.run(main)


@pytest.mark.parametrize(
    "raw, match",
    [
        (struct.pack("<I", 10) + b"{}", "inside a frame"),
        (struct.pack("<I", 2) + b"[]", "not a JSON object"),
        (struct.pack("<I", 3) + b"{x}", "malformed payload"),
        (struct.pack("<I", 1 << 30), "exceeds"),
    ],
)
def test_bad_frames_raise_protocol_error(raw, match):
    async def main():
        a, b = socket.socketpair()
        a.sendall(raw)
        a.close()
        right = FramedStream.from_fd(b.detach())
        with pytest.raises(ProtocolError, match=match):
            await right.receive()

    trio.run(main)


def test_unserialisable_and_oversized_messages_are_refused():
    with pytest.raises(TypeError):
        encode({"x": object()})
    with pytest.raises(ProtocolError):
        encode({"x": "a" * 100}, max_frame=50)


def test_hysteresis_holds_above_high_and_releases_below_low():
    h = Hysteresis(high=100, low=80)
    assert [h.update(v) for v in (50, 99, 100, 90, 81, 80, 95, 120)] == [
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        True,
    ]
    assert h.holds == 2
    with pytest.raises(ValueError):
        Hysteresis(high=10, low=20)


def test_pool_admission_marks():
    adm = PoolAdmission(worker_high_bytes=100, worker_low_bytes=None, limit_bytes=1000)
    assert adm.worker_low == 80
    assert (
        adm.worker(1, 120) == (True, True) and adm.worker(1, 90) == (True, False) and adm.worker(1, 70) == (False, True)
    )
    assert (
        adm.update_pool(900) == (True, True)
        and adm.update_pool(760) == (True, False)
        and adm.update_pool(750) == (False, True)
    )
    adm.worker(2, 500)
    adm.retire(2)
    assert adm.worker_holds == 2 and not adm.worker_held(2)
    no_worker_marks = PoolAdmission(worker_high_bytes=None, worker_low_bytes=None, limit_bytes=1000)
    assert no_worker_marks.worker(1, 10**12) == (False, False)
    with pytest.raises(ValueError):
        PoolAdmission(
            worker_high_bytes=None,
            worker_low_bytes=None,
            limit_bytes=1000,
            pool_high_fraction=0.5,
            pool_low_fraction=0.6,
        )
    with pytest.raises(ValueError):
        PoolAdmission(worker_high_bytes=None, worker_low_bytes=50, limit_bytes=1000)


def test_memory_limit_prefers_the_smallest_cgroup_limit(tmp_path):
    import psutil

    total = psutil.virtual_memory().total
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    root = tmp_path / "cgroup"
    # v1, in the process's own memory cgroup; a v1 "unlimited" at the root.
    (proc / "self" / "cgroup").write_text("4:memory:/job/abc\n0::/\n")
    (root / "memory" / "job" / "abc").mkdir(parents=True)
    (root / "memory" / "job" / "abc" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_limit_bytes(root, proc) == (
        min(2 << 30, total),
        f"cgroup-v1:{root}/memory/job/abc/memory.limit_in_bytes" if (2 << 30) < total else "machine",
    )
    # v2 at the root of a container: "max" means no limit.
    (proc / "self" / "cgroup").write_text("0::/\n")
    (root / "memory.max").write_text("max\n")
    assert memory_limit_bytes(root, proc) == (total, "machine")
    (root / "memory.max").write_text(f"{1 << 30}\n")
    assert memory_limit_bytes(root, proc) == (1 << 30, f"cgroup-v2:{root}/memory.max")
    # Nothing readable: the machine.
    assert memory_limit_bytes(tmp_path / "none", tmp_path / "none") == (total, "machine")


def test_allocator_settings_precedence():
    assert resolve(environ={}) == AllocatorSettings(2, 128 * 1024)
    assert resolve(environ={"MALLOC_ARENA_MAX": "4", "MALLOC_TRIM_THRESHOLD_": "0"}) == AllocatorSettings(4, 0)
    assert resolve(1, 65536, environ={"MALLOC_ARENA_MAX": "4"}) == AllocatorSettings(1, 65536)
    assert resolve("off", "off", environ={"MALLOC_ARENA_MAX": "4"}) == AllocatorSettings(None, None)
    assert resolve(trim_threshold="off", environ={}) == AllocatorSettings(2, None)
    with pytest.raises(ValueError, match="malloc_trim_threshold"):
        resolve(trim_threshold="never", environ={})
    with pytest.raises(ValueError, match="MALLOC_ARENA_MAX"):
        resolve(environ={"MALLOC_ARENA_MAX": "lots"})
    with pytest.raises(ValueError):
        AllocatorSettings(arena_max=0)
    env: dict[str, str] = {}
    report = apply(AllocatorSettings(None, 262144), environ=env)
    assert env == {"MALLOC_TRIM_THRESHOLD_": "262144"} == report["env"]
    assert set(report["mallopt"]) == {"M_TRIM_THRESHOLD"}


def test_job_spec_and_factory_loading():
    with pytest.raises(ValueError):
        JobSpec("no-colon")
    assert isinstance(load_factory(jobs.FACTORY)(), jobs.ToyJob)
    with pytest.raises(ValueError):
        load_factory("module:")
    with pytest.raises(ImportError):
        load_factory("lowwater.no_such_module:x")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"workers": 0},
        {"concurrency_per_worker": 0},
        {"max_tasks_per_worker": 0},
        {"jitter": 1.0},
        {"max_rss_mb": -1},
        {"heartbeat_s": 2.0, "heartbeat_timeout_s": 1.0},
        {"high_water_mb": 10, "low_water_mb": 20},
        {"pool_high_water_fraction": 0.5, "pool_low_water_fraction": 0.7},
    ],
)
def test_pool_arguments_are_validated(kwargs):
    with pytest.raises(PoolConfigError):  # a ValueError
        WorkerPool(JobSpec(jobs.FACTORY), **{"workers": 1, **kwargs})


def test_pool_respects_allocator_values_in_the_environment(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    pool = WorkerPool(JobSpec(jobs.FACTORY), workers=1)
    assert pool.allocator == AllocatorSettings(3, 128 * 1024)
    assert WorkerPool(JobSpec(jobs.FACTORY), workers=1, malloc_arena_max=1).allocator.arena_max == 1
    assert WorkerPool(JobSpec(jobs.FACTORY), workers=1, allocator_hygiene=False).allocator is None
    assert os.environ["MALLOC_ARENA_MAX"] == "3"  # the parent's own environment is never changed


@pytest.mark.parametrize(
    "group, raised",
    [
        (BaseExceptionGroup("torn down", [KeyboardInterrupt(), RuntimeError("with it")]), KeyboardInterrupt),
        (
            BaseExceptionGroup("torn down", [ExceptionGroup("inner", [ValueError()]), KeyboardInterrupt()]),
            KeyboardInterrupt,
        ),
        (ExceptionGroup("torn down", [RuntimeError("alone")]), ExceptionGroup),
    ],
)
def test_ctrl_c_out_of_the_pools_nursery_comes_out_bare(monkeypatch, group, raised):
    """Whatever group the nursery raises, a KeyboardInterrupt in it is raised
    by itself (the CLI expects it so); a group without one is left alone."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def breaking_nursery():
        raise group
        yield  # unreachable: makes this an async generator

    monkeypatch.setattr(trio, "open_nursery", breaking_nursery)
    pool = WorkerPool(JobSpec(jobs.FACTORY), workers=1)

    async def on_rows(rows, info):
        raise AssertionError("nothing runs")

    with pytest.raises(raised) as info:
        trio.run(pool.run, ["ok:1"], on_rows)
    assert type(info.value) is raised
