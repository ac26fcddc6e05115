"""Env worker processes: a pool that recycles, admits by memory, heartbeats
and recovers from crashes.  See ``docs/workers.md``."""

from lowwater.workers.admission import Hysteresis, PoolAdmission, memory_limit_bytes
from lowwater.workers.allocator import AllocatorSettings
from lowwater.workers.config import PoolConfig
from lowwater.workers.contract import (
    JobSpec,
    PoolConfigError,
    PoolReport,
    TaskInfo,
    WorkerJob,
    WorkerStartError,
)
from lowwater.workers.pool import WorkerPool

__all__ = [
    "AllocatorSettings",
    "Hysteresis",
    "JobSpec",
    "PoolAdmission",
    "PoolConfig",
    "PoolConfigError",
    "PoolReport",
    "TaskInfo",
    "WorkerJob",
    "WorkerPool",
    "WorkerStartError",
    "memory_limit_bytes",
]
