"""lowwater on Ray: the ``ray`` worker backend (one node pool per Ray node,
each running lowwater's unchanged :class:`~lowwater.workers.WorkerPool`) and
the ``ray`` shard transport (shards as object-store objects the trainer
process owns).  See ``docs/ray.md`` in the lowwater repository."""

from lowwater_ray.backend import RayBackend, RayPoolReport
from lowwater_ray.transport import RayHandle, RayTransport

__all__ = ["RayBackend", "RayHandle", "RayPoolReport", "RayTransport"]
