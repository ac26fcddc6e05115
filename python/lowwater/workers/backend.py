"""Worker backends: where a job's tasks run.

A backend turns a job (:class:`~lowwater.workers.JobSpec`) and its pool
settings (:class:`~lowwater.workers.PoolConfig`) into a *task pool* that
runs task ids and hands back rows, exactly as
:class:`~lowwater.workers.WorkerPool` does: ids are pulled lazily from an
iterable or a :class:`~lowwater.workers.stream.TaskStream`, ``on_rows`` is
awaited once per task, and ``run`` returns a
:class:`~lowwater.workers.PoolReport`.  ``lowwater eval --backend NAME`` and
``TrainerConfig(backend=NAME)`` look backends up by name in the plugin
registry (``register_backends``); lowwater itself never imports a cluster
library.

Built in: ``"local"``, the :class:`~lowwater.workers.WorkerPool` on this
machine (:class:`LocalBackend`).  The ``lowwater-ray`` plugin adds ``"ray"``:
one node pool per Ray node, each an unchanged ``WorkerPool`` (docs/ray.md).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterable, Awaitable, Callable, Hashable, Iterable
from typing import Any, ClassVar, Protocol

import attrs

from lowwater.workers.config import PoolConfig
from lowwater.workers.contract import JobSpec, PoolReport, TaskInfo

#: The ``store_url`` a trainer job is given when its backend has a shard
#: store on every node (:attr:`WorkerBackend.node_stores`): the node pool
#: replaces it with its own store's URL.
NODE_STORE_URL = "lowwater-node-store:"

#: A task pool's row callback: ``await on_rows(rows, info)`` once per finished task.
OnRows = Callable[[list[dict[str, Any]], TaskInfo], Awaitable[None]]
#: A pool's event callback: ``on_event(kind, fields)`` (worker started, retired, ...).
OnEvent = Callable[[str, dict[str, Any]], None]
#: A pool's pin key of a task id (``None``: not pinned); see :class:`~lowwater.workers.WorkerPool`.
PinBy = Callable[[Any], Hashable | None]


class TaskPool(Protocol):
    """What :meth:`WorkerBackend.pool` returns (a
    :class:`~lowwater.workers.WorkerPool` is one)."""

    async def run(self, task_ids: Iterable[Any] | AsyncIterable[Any], on_rows: OnRows) -> PoolReport:
        """Run every task once, ``on_rows`` once per task; as :meth:`lowwater.workers.WorkerPool.run`."""
        ...

    def stats(self) -> dict[str, Any]:
        """Live stats: ``{"workers": {...}, "pool": {...}}`` (a backend may add keys)."""
        ...

    def unpin(self, key: Hashable) -> int:
        """Release a ``pin_by`` key on every worker (see :class:`~lowwater.workers.WorkerPool`)."""
        ...


@attrs.frozen
class BackendOptions:
    """How a backend is reached and sized.

    Attributes:
        address: the cluster to join (``ray``: ``"auto"`` or ``HOST:PORT``;
            ``None``: the backend's default, for ``local`` this machine).
        options: backend-specific settings (``--backend-option KEY=VALUE``).
    """

    address: str | None = None
    options: dict[str, Any] = attrs.field(factory=dict)


class WorkerBackend(abc.ABC):
    """Base class of a worker backend (register a factory with ``register_backends``).

    Attributes:
        name: the name it is registered under.
        remote: workers may run on other hosts, so every server they call
            (the model server) must be reachable from there, not bound to
            loopback.
        node_stores: each node pool hosts a shard store its workers upload
            to, and the backend returns a finished task's shards as
            :class:`~lowwater.trainer.shards.ShardRef` objects with a
            transport handle (trainer jobs get :data:`NODE_STORE_URL`).
    """

    name: ClassVar[str] = ""
    remote: ClassVar[bool] = False
    node_stores: ClassVar[bool] = False

    def __init__(self, options: BackendOptions | None = None) -> None:
        self.options = options or BackendOptions()

    @abc.abstractmethod
    def pool(
        self, spec: JobSpec, config: PoolConfig, *, on_event: OnEvent | None = None, pin_by: PinBy | None = None
    ) -> TaskPool:
        """A task pool for ``spec``; ``config.workers`` is per node for a
        multi-node backend.  Nothing starts before ``run``.

        Raises:
            lowwater.workers.PoolConfigError: a setting the backend cannot honour.
        """

    def describe(self) -> str:
        """One line for logs: the backend and where it runs."""
        return self.name


class LocalBackend(WorkerBackend):
    """``"local"``: a :class:`~lowwater.workers.WorkerPool` on this machine."""

    name = "local"

    def pool(
        self, spec: JobSpec, config: PoolConfig, *, on_event: OnEvent | None = None, pin_by: PinBy | None = None
    ) -> TaskPool:
        from lowwater.workers.pool import WorkerPool

        return WorkerPool(spec, config, on_event=on_event, pin_by=pin_by)


def open_backend(plugins: Any, name: str, options: BackendOptions | None = None) -> WorkerBackend:
    """The backend registered as ``name``, built with ``options``.

    Raises:
        lowwater.plugins.UnknownName: no plugin registered ``name`` (the
            message lists the installed backends).
    """
    factory = plugins.backend(name)
    backend: WorkerBackend = factory(options or BackendOptions())
    return backend


__all__ = [
    "NODE_STORE_URL",
    "BackendOptions",
    "LocalBackend",
    "OnEvent",
    "OnRows",
    "PinBy",
    "TaskPool",
    "WorkerBackend",
    "open_backend",
]
