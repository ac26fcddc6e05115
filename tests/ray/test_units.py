"""Pieces of lowwater-ray that need no cluster: per-host admission marks,
handles that release their reference, the transport's leak count."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

from lowwater.trainer.shards import ShardRef
from lowwater.workers import PoolConfig

pytestmark = pytest.mark.ray


def test_host_marks_split_the_host_and_stay_under_rays_threshold(monkeypatch):
    from lowwater_ray.memory import host_marks

    config = PoolConfig(workers=2)
    one = host_marks(config, 1, limit_bytes=8 << 30)
    two = host_marks(config, 2, limit_bytes=8 << 30)
    assert one.memory_limit_mb == 8192 and two.memory_limit_mb == 4096  # two pools on a host share it
    assert one.pool_high_water_fraction == 0.85 and one.pool_low_water_fraction == 0.75
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.8")
    tight = host_marks(config, 1, limit_bytes=8 << 30)
    assert tight.pool_high_water_fraction == pytest.approx(0.75) and tight.pool_low_water_fraction <= 0.75
    explicit = host_marks(PoolConfig(workers=1, memory_limit_mb=1000), 4)
    assert explicit.memory_limit_mb == 250


class _FakeRef:
    def hex(self) -> str:
        return "ab" * 14


def test_a_handle_releases_its_reference_and_keeps_its_id():
    from lowwater_ray.transport import RayHandle

    handle = RayHandle(_FakeRef(), "step0/g0/token_ids")
    again = pickle.loads(pickle.dumps(handle))
    assert again.key == handle.key and again.object_hex == handle.object_hex
    assert handle.release() and handle.ref is None and not handle.release()
    assert handle.object_hex == "ab" * 14


def test_a_view_kept_past_the_drain_is_counted():
    from lowwater_ray.transport import RayTransport

    transport = RayTransport()
    transport._views = {"a": np.zeros(10, np.float32), "b": np.zeros(4, np.int64)}
    kept = transport._views["a"][2:]  # a slice keeps its base alive
    assert transport.drain(["a", "b", "zzz"]) == 2
    assert transport.stats() == {"entries": 1, "bytes": 40, "held_after_drain": 1}
    del kept
    gc.collect()
    assert transport.stats() == {"entries": 0, "bytes": 0, "held_after_drain": 0}


def test_remove_releases_every_handle():
    import trio

    from lowwater_ray.transport import RayHandle, RayTransport

    refs = [ShardRef(f"s{i}", "ray:x", "uint8", (1,), 1, "ray", RayHandle(_FakeRef(), f"s{i}")) for i in range(3)]
    assert trio.run(RayTransport().remove, refs) == 3
    assert all(r.handle.ref is None for r in refs)
