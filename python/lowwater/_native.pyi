"""Type stubs of ``lowwater._native``, the Rust extension (crate ``rust/py``).

Both tables are concurrent maps with explicit eviction: nothing is removed
behind the caller's back, a capacity bound refuses new entries, and a removed
payload is freed when its last view is dropped.  Payloads of at least
``mmap_threshold`` bytes live in their own anonymous mapping, so RSS falls on
release whatever the allocator does.  All byte figures are bytes; ages are
seconds.
"""

from collections.abc import Iterable
from typing import Self, final

# typing_extensions, not collections.abc: Buffer is in collections.abc from 3.12
# only, and the package supports 3.11.  A stub is never imported, so this is
# read by the type checker alone (mypy reads its bundled typeshed copy).
from typing_extensions import Buffer

# The extension's own __all__ (pyo3 appends every name the module adds).
__all__ = [
    "LowwaterError",
    "BufferFull",
    "RolloutClosed",
    "InternalError",
    "FetchBuffer",
    "ShardView",
    "PendingShard",
    "InterceptTable",
    "InterceptView",
    "DTYPES",
]

DTYPES: dict[str, int]
"""Supported dtype names and their item sizes in bytes."""

class LowwaterError(Exception):
    """Base class of every error the extension raises on purpose."""

class BufferFull(LowwaterError):
    """An insert would exceed the table's ``capacity_bytes``; nothing was evicted."""

class RolloutClosed(LowwaterError):
    """An intercept was inserted for a rollout that is not open (or closed meanwhile)."""

class InternalError(LowwaterError):
    """A bug in the extension (a caught Rust panic); the table is still usable."""

@final
class ShardView:
    """Read-only zero-copy view of one shard's payload (buffer protocol).

    ``memoryview(view)`` and ``numpy.frombuffer(view, dtype).reshape(shape)``
    share the payload; the view keeps it alive after its entry is removed.
    """

    @property
    def shard_id(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def owner(self) -> str: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class PendingShard:
    """A put in progress (:meth:`FetchBuffer.reserve`): a writable buffer
    that is the payload itself.  The memory is never freed or frozen while a
    view of it is held, so a view cannot outlive it; dropping it uncommitted
    abandons it."""

    @property
    def shard_id(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    def commit(self) -> None:
        """Insert the payload into its buffer, replacing any shard of that id.

        Raises:
            BufferError: a view of the payload is still held.
            ValueError: already committed or abandoned.
            MemoryError: the mapping cannot be made read-only.
        """
    def abandon(self) -> None:
        """Give the reservation back without inserting (idempotent).

        Raises:
            BufferError: a view of the payload is still held.
        """
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class FetchBuffer:
    """The shard fetch buffer: ``shard_id -> shard`` (payload + dtype, shape, owner).

    Args:
        capacity_bytes: bound on the payload bytes held by entries (``None``:
            unbounded).  A put over it raises :class:`BufferFull`.
        mmap_threshold: payloads of at least this many bytes get their own
            anonymous mapping (default 1 MiB).

    Raises:
        ValueError: a negative ``capacity_bytes`` or ``mmap_threshold``.
    """

    def __new__(cls, capacity_bytes: int | None = None, mmap_threshold: int = 1 << 20) -> Self: ...
    @property
    def capacity_bytes(self) -> int | None:
        """The bound given at construction (bytes), or ``None``."""
    @property
    def mmap_threshold(self) -> int:
        """Payloads of at least this many bytes get their own mapping."""
    def put(
        self,
        shard_id: str,
        data: Buffer,
        *,
        dtype: str,
        shape: Iterable[int],
        owner: str = "",
    ) -> None:
        """Copy ``data`` in as shard ``shard_id`` (GIL released for large copies).

        Replacing an existing id frees the old payload (once its views drop).

        Raises:
            ValueError: unknown ``dtype``, a negative dimension, or
                ``len(bytes(data)) != prod(shape) * itemsize(dtype)``.
            TypeError: ``data`` does not support the buffer protocol.
            BufferFull: the table would exceed ``capacity_bytes``.
        """
    def reserve(self, shard_id: str, *, dtype: str, shape: Iterable[int], owner: str = "") -> PendingShard:
        """Start a put whose payload is written in place (a socket's
        ``recv_into`` straight into it, no copy after): a writable buffer of
        ``prod(shape) * itemsize(dtype)`` zero bytes, counted in ``bytes``
        until :meth:`PendingShard.commit` inserts it or
        :meth:`PendingShard.abandon` gives it back.

        Raises:
            ValueError: unknown ``dtype`` or a negative dimension.
            BufferFull: the table would exceed ``capacity_bytes``.
            MemoryError: the memory cannot be had.
        """
    def get(self, shard_id: str) -> ShardView | None: ...
    def pop(self, shard_id: str) -> ShardView | None: ...
    def clear(self, shard_ids: Iterable[str] | None = None) -> int:
        """Remove ``shard_ids`` (``None``: everything); unknown ids are skipped.

        Returns the number of entries removed by this call.
        """
    def stats(self) -> dict[str, int]:
        """Exact counters: ``entries``, ``bytes``, ``peak_bytes``, ``live_bytes``,
        ``inserts``, ``hits``, ``misses``, ``removals``, ``rejected``."""
    def keys(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, shard_id: object, /) -> bool: ...

@final
class InterceptView:
    """Read-only zero-copy view of one intercepted request body (buffer protocol)."""

    @property
    def request_id(self) -> str: ...
    @property
    def rollout_id(self) -> str: ...
    @property
    def protocol(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def age_s(self) -> float: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class InterceptTable:
    """The intercept table: ``request_id -> intercept`` for in-flight model calls.

    Only open rollouts are tracked; closing a rollout sweeps its intercepts.

    Args:
        capacity_bytes: bound on held body bytes (``None``: unbounded).
        mmap_threshold: bodies of at least this many bytes get their own mapping.
    """

    def __new__(cls, capacity_bytes: int | None = None, mmap_threshold: int = 1 << 20) -> Self: ...
    @property
    def capacity_bytes(self) -> int | None:
        """The bound given at construction (bytes), or ``None``."""
    @property
    def mmap_threshold(self) -> int:
        """Payloads of at least this many bytes get their own mapping."""
    def open_rollout(self, rollout_id: str) -> None:
        """Start tracking ``rollout_id`` (idempotent)."""
    def close_rollout(self, rollout_id: str) -> list[str]:
        """Stop tracking ``rollout_id``; remove and return its undelivered request ids."""
    def is_open(self, rollout_id: str) -> bool: ...
    def insert(
        self,
        request_id: str,
        rollout_id: str,
        body: Buffer,
        *,
        protocol: str,
        stream: bool,
    ) -> None:
        """Hold ``body`` for the life of the call.

        Raises:
            RolloutClosed: ``rollout_id`` is not open, or closed during the insert.
            KeyError: ``request_id`` is already held.
            BufferFull: the table would exceed ``capacity_bytes``.
            TypeError: ``body`` does not support the buffer protocol.
        """
    def get(self, request_id: str) -> InterceptView | None: ...
    def discard(self, request_id: str) -> bool:
        """Remove ``request_id``; True only for the call that removed it."""
    def stale(self, older_than_s: float) -> list[str]:
        """Request ids held for more than ``older_than_s`` seconds."""
    def rollout_requests(self, rollout_id: str) -> list[str]:
        """Request ids currently held for ``rollout_id``."""
    def stats(self) -> dict[str, int]:
        """Exact counters: ``entries``, ``bytes``, ``peak_bytes``, ``live_bytes``,
        ``open_rollouts``, ``inserts``, ``discards``, ``swept``, ``rejected``."""
    def keys(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, request_id: object, /) -> bool: ...
