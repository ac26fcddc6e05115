"""Env worker processes: a pool that recycles, admits by memory, heartbeats
and recovers from crashes.  See ``docs/workers.md``."""

from lowwater.workers.admission import Hysteresis, PoolAdmission, memory_limit_bytes
from lowwater.workers.allocator import AllocatorSettings
from lowwater.workers.pool import (
    JobSpec,
    PoolConfigError,
    PoolReport,
    TaskInfo,
    WorkerJob,
    WorkerPool,
    WorkerStartError,
)

__all__ = [
    "AllocatorSettings",
    "Hysteresis",
    "JobSpec",
    "PoolAdmission",
    "PoolConfigError",
    "PoolReport",
    "TaskInfo",
    "WorkerJob",
    "WorkerPool",
    "WorkerStartError",
    "memory_limit_bytes",
]
