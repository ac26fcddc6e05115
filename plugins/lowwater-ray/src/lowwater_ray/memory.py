"""Memory on Ray nodes: per-host admission marks, the object store's use, the
host's shared memory, and which process still holds an object.

Ray keeps memory lowwater's RSS figures do not see: the object store is a
shared-memory segment per node whose pages are never returned to the OS
(Shmem 8 -> 520 MiB after one 512 MiB put, kept until the node stops), and a
zero-copy ``ray.get`` pins an object for as long as any view of it lives.
So the memory record reports the object store's use and the host's Shmem
high-water beside RSS, and a step's objects are looked up in the raylets'
reference tables after the drain.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import attrs

from lowwater.workers import PoolConfig
from lowwater.workers.admission import memory_limit_bytes

MIB = 1 << 20
#: Ray's OOM killer acts above this fraction of the host's memory (its default).
DEFAULT_RAY_THRESHOLD = 0.95
#: Margin kept under Ray's threshold: lowwater holds new tasks before Ray kills workers.
THRESHOLD_MARGIN = 0.05


def ray_memory_threshold() -> float:
    """``RAY_memory_usage_threshold`` (fraction of host memory), default 0.95."""
    try:
        return float(os.environ.get("RAY_memory_usage_threshold", DEFAULT_RAY_THRESHOLD))
    except ValueError:
        return DEFAULT_RAY_THRESHOLD


def host_marks(config: PoolConfig, pools_on_host: int, limit_bytes: int | None = None) -> PoolConfig:
    """``config`` for one of ``pools_on_host`` node pools sharing a host.

    The host's memory limit (cgroup or machine, or ``config.memory_limit_mb``)
    is split evenly between the pools on it, so two simulated nodes on one
    machine do not each count the whole machine; the pool's high-water mark
    stays :data:`THRESHOLD_MARGIN` under Ray's OOM threshold (and the low
    mark under the high one).
    """
    if config.memory_limit_mb is not None:
        host_mb = config.memory_limit_mb
    else:
        host_mb = (limit_bytes if limit_bytes is not None else memory_limit_bytes()[0]) / MIB
    ceiling = max(0.05, ray_memory_threshold() - THRESHOLD_MARGIN)
    high = min(config.pool_high_water_fraction, ceiling)
    low = min(config.pool_low_water_fraction, high)
    return attrs.evolve(
        config,
        memory_limit_mb=host_mb / max(1, pools_on_host),
        pool_high_water_fraction=high,
        pool_low_water_fraction=low,
    )


def shmem_bytes() -> int:
    """This host's shared memory (``Shmem`` of ``/proc/meminfo``, bytes); 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Shmem:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _node_stats(node: dict[str, Any], include_memory_info: bool) -> Any:
    from ray._private import internal_api  # the raylet's GetNodeStats (grpc; what `ray memory` reads)

    return internal_api.node_stats(
        node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=include_memory_info
    )


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def object_store(nodes: Iterable[dict[str, Any]] | None = None) -> dict[str, dict[str, int]]:
    """Per node id: ``used_bytes``, ``capacity_bytes``, ``objects`` of its object store."""
    out = {}
    for node in alive_nodes() if nodes is None else nodes:
        try:
            stats = _node_stats(node, include_memory_info=False).store_stats
        except Exception:  # a node going away: skip it, never fail the run over a figure
            continue
        out[node["NodeID"]] = {
            "used_bytes": int(stats.object_store_bytes_used),
            "capacity_bytes": int(stats.object_store_bytes_avail),
            "objects": int(stats.num_local_objects),
        }
    return out


def holders(object_hexes: Iterable[str]) -> dict[str, list[str]]:
    """For each of ``object_hexes`` still referenced or pinned by any process
    of the cluster: where (``"pid N on IP"``, with ``pinned`` for a
    zero-copy view), from every raylet's reference tables."""
    wanted = set(object_hexes)
    found: dict[str, list[str]] = {}
    if not wanted:
        return found
    for node in alive_nodes():
        try:
            reply = _node_stats(node, include_memory_info=True)
        except Exception:
            continue
        for worker in reply.core_workers_stats:
            for ref in worker.object_refs:
                hex_id = ref.object_id.hex()
                if hex_id in wanted and (ref.local_ref_count or ref.pinned_in_memory or ref.submitted_task_ref_count):
                    what = "pinned by a view" if ref.pinned_in_memory else "referenced"
                    found.setdefault(hex_id, []).append(f"{what} in pid {worker.pid} on {node['NodeManagerAddress']}")
    return found


__all__ = [
    "alive_nodes",
    "holders",
    "host_marks",
    "object_store",
    "ray_memory_threshold",
    "shmem_bytes",
]
