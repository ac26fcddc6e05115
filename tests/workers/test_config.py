"""PoolConfig validation, WorkerPool's keyword and config forms, and the worker states."""

from __future__ import annotations

import attrs
import pytest

from lowwater.workers import JobSpec, PoolConfig, PoolConfigError, WorkerPool
from lowwater.workers.record import WorkerState

from . import jobs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": 0}, "workers must be >= 1, not 0"),
        ({"max_tasks_per_worker": 0}, "max_tasks_per_worker must be >= 1 or None"),
        ({"max_rss_mb": 0}, "max_rss_mb must be > 0 or None"),
        ({"memory_limit_mb": -1}, "memory_limit_mb must be > 0 or None"),
        ({"jitter": -0.1}, r"jitter must be in \[0, 1\)"),
        ({"heartbeat_s": 0}, "heartbeat_s must be > 0"),
        ({"cancel_grace_s": -1}, "cancel_grace_s must be >= 0"),
        ({"pool_high_water_fraction": 1.5}, r"pool_high_water_fraction must be in \(0, 1\]"),
        ({"pool_high_water_fraction": 0.5, "pool_low_water_fraction": 0.6}, "pool_low_water_fraction <="),
        ({"low_water_mb": 10}, "low_water_mb needs high_water_mb"),
        ({"high_water_mb": 10, "low_water_mb": 20}, "low_water_mb <= high_water_mb"),
        ({"heartbeat_s": 2.0, "heartbeat_timeout_s": 1.0}, "must exceed heartbeat_s"),
        ({"start_method": "fork"}, "start_method must be 'forkserver' or 'spawn'"),
        ({"malloc_arena_max": "lots"}, "malloc_arena_max must be an integer, None or 'off'"),
    ],
)
def test_bad_values_raise_pool_config_error_naming_the_setting(kwargs, match):
    with pytest.raises(PoolConfigError, match=match):
        PoolConfig(**{"workers": 1, **kwargs})
    assert issubclass(PoolConfigError, ValueError)


def test_config_is_frozen_and_keyword_only():
    config = PoolConfig(workers=2, preload=["a.b"])
    assert config.preload == ("a.b",) and config.max_tasks_per_worker == 500
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.workers = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        PoolConfig(2)  # type: ignore[misc]


def test_pool_takes_keywords_a_config_or_a_config_with_overrides():
    spec = JobSpec(jobs.FACTORY)
    assert WorkerPool(spec, workers=3, max_rss_mb=100).config == PoolConfig(workers=3, max_rss_mb=100)
    base = PoolConfig(workers=2, seed=7)
    assert WorkerPool(spec, base).config is base
    assert WorkerPool(spec, base, workers=4).config == attrs.evolve(base, workers=4)
    with pytest.raises(PoolConfigError):
        WorkerPool(spec, base, workers=0)
    with pytest.raises(TypeError):
        WorkerPool(spec, worker=2)  # a misspelt setting is not ignored
    with pytest.raises(TypeError):
        WorkerPool(spec)  # workers has no default


def test_worker_states_group_as_the_pool_uses_them():
    assert {s for s in WorkerState if s.serving} == {WorkerState.STARTING, WorkerState.READY}
    assert {s for s in WorkerState if s.running} == {WorkerState.STARTING, WorkerState.READY, WorkerState.RETIRING}
    assert {s for s in WorkerState if s.gone} == {WorkerState.DEAD, WorkerState.REAPED}
