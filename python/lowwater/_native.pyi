"""Type stubs of ``lowwater._native``, the Rust extension (crate ``rust/py``).

Both tables are concurrent maps with explicit eviction: nothing is removed
behind the caller's back, a capacity bound refuses new entries, and a removed
payload is freed when its last view is dropped.  Payloads of at least
``mmap_threshold`` bytes live in their own anonymous mapping, so RSS falls on
release whatever the allocator does.  All byte figures are bytes; ages are
seconds.
"""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Self, final

# typing_extensions, not collections.abc: Buffer is in collections.abc from 3.12
# only, and the package supports 3.11.  A stub is never imported, so this is
# read by the type checker alone (mypy reads its bundled typeshed copy).
from typing_extensions import Buffer

# The extension's own __all__ (pyo3 appends every name the module adds).
__all__ = [
    "LowwaterError",
    "BufferFull",
    "RolloutClosed",
    "DataPlaneConfigError",
    "DataPlaneClosed",
    "DuplicateRollout",
    "DuplicateSecret",
    "InternalError",
    "FetchBuffer",
    "ShardView",
    "PendingShard",
    "InterceptTable",
    "InterceptView",
    "DataPlane",
    "TurnRecord",
    "Upcall",
    "error_body",
    "error_event",
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

class DataPlaneConfigError(LowwaterError):
    """:class:`DataPlane` cannot start with this configuration: a bad upstream
    URL, an ``SSL_CERT_FILE`` that cannot be read or holds no certificate, a
    limit or count that must be positive given as 0, or a request rewrite
    that is not JSON, of an unknown kind or for an unknown protocol.  Also
    :meth:`DataPlane.register` with a rollout upstream or key the plane could
    not start with."""

class DataPlaneClosed(LowwaterError):
    """A method of a :class:`DataPlane` was called after :meth:`DataPlane.close`."""

class DuplicateRollout(LowwaterError):
    """:meth:`DataPlane.register` of a rollout id that is open already."""

class DuplicateSecret(LowwaterError):
    """:meth:`DataPlane.register` with a secret another open rollout has."""

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

@final
class TurnRecord:
    """One recorded model call, drained from a :class:`DataPlane`.

    Attributes:
        seq: pass to :meth:`DataPlane.ack` to release the call's held last bytes.
        rollout_id: the rollout the call belongs to.
        request_id: the call's id (its key in :attr:`DataPlane.table` while
            it ran; unique per data plane).
        protocol: the protocol's name (``"openai.chat"``, ``"openai.responses"``,
            ``"anthropic.messages"``); ``protocol_id`` is its index in the
            data plane's protocol table.
        model: the ``model`` the agent asked for (``""`` if none), also when
            the rollout's ``model`` (see :meth:`DataPlane.register`) replaced
            it upstream.
        streamed: whether the agent asked for an SSE stream.
        kept: how many leading messages equal the rollout's previous request's;
            ``messages`` starts at this index of the request's list.
        previous: how many messages the previous request had; ``kept <
            previous`` means the agent rewrote its history, and the request is
            ``previous_request[:kept] + messages``.
        messages: the request's messages from ``kept`` on, each its JSON text
            as sent (bytes; for a plain-string responses ``input``, that JSON string).
        tools: the tools the agent offered: a JSON object (bytes) of the
            request's tool fields as sent, ``{"tools": [...]}`` (OpenAI chat
            also the deprecated ``functions``), for the protocol's
            ``tools()`` to read; ``None`` when the request had none (``null``
            counts as absent).
        status: the HTTP status the agent was answered with (the upstream's, or 502/504).
        response: the upstream's answer bytes: the whole body, or for a stream
            every event relayed (line endings ``\\n``), terminal event included.
        error: why the call failed (upstream unreachable, timed out, stream cut), or ``None``.
        started_s: when the request's head arrived, seconds since the Unix epoch.
        upstream_s: seconds from the request's arrival to the upstream's
            response head (0.0 if none came).
        duration_s: seconds from the request's arrival to the record.
    """

    @property
    def seq(self) -> int: ...
    @property
    def rollout_id(self) -> str: ...
    @property
    def request_id(self) -> str: ...
    @property
    def protocol(self) -> str: ...
    @property
    def protocol_id(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def streamed(self) -> bool: ...
    @property
    def kept(self) -> int: ...
    @property
    def previous(self) -> int: ...
    @property
    def messages(self) -> tuple[bytes, ...]: ...
    @property
    def tools(self) -> bytes | None: ...
    @property
    def status(self) -> int: ...
    @property
    def response(self) -> bytes: ...
    @property
    def error(self) -> str | None: ...
    @property
    def started_s(self) -> float: ...
    @property
    def upstream_s(self) -> float: ...
    @property
    def duration_s(self) -> float: ...

@final
class Upcall:
    """A request the :class:`DataPlane` hands to the control plane and waits
    on (``lowwater.interception.upcalls.serve_upcalls`` serves them).

    Answer an ``"intercept"`` upcall with :meth:`DataPlane.resume` or
    :meth:`DataPlane.reject`, a ``"route"`` upcall with
    :meth:`DataPlane.respond`.  Until answered the agent's call waits (it is
    answered 410 if its rollout is unregistered, 503 if the plane closes, and
    dropped if its client leaves).

    Attributes:
        id: pass to the answer.
        kind: ``"intercept"`` (a model call before forwarding) or ``"route"``
            (a request to one of the plane's ``python_routes``).
        rollout_id: the intercepted call's rollout (``None`` for a route).
        request_id: the intercepted call's id, its record's ``request_id`` (``None``
            for a route).
        protocol: the intercepted call's protocol name (``None`` for a route).
        method: the HTTP method (``"POST"`` for an intercepted call).
        path: the path with its query string, as sent (percent-escapes kept).
        headers: the request's headers as ``(name, value)`` byte pairs, names
            lower-case, repeated names repeated in order (an intercepted
            call's without ``authorization`` and ``x-api-key``: the rollout's
            secret).
        body: the request's body (an intercepted call's validated JSON).
    """

    @property
    def id(self) -> int: ...
    @property
    def kind(self) -> Literal["intercept", "route"]: ...
    @property
    def rollout_id(self) -> str | None: ...
    @property
    def request_id(self) -> str | None: ...
    @property
    def protocol(self) -> str | None: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def headers(self) -> list[tuple[bytes, bytes]]: ...
    @property
    def body(self) -> bytes: ...

def error_body(flavour: str, status: int, reason: str) -> bytes:
    """The data plane's JSON error body for ``status`` (UTF-8 JSON bytes):
    ``flavour`` ``"openai"`` gives ``{"error": {"message", "type", "param",
    "code"}}``, ``"anthropic"`` gives ``{"type": "error", "error": {"type",
    "message"}}``; ``type`` is what the flavour's SDK maps ``status`` to
    (400/413/415 ``invalid_request_error``, 401 ``authentication_error``,
    ...; anything unlisted ``api_error``).

    Raises:
        ValueError: an unknown ``flavour``.
        OverflowError: ``status`` outside 0-65535.
    """

def error_event(flavour: str, reason: str) -> bytes:
    """The data plane's SSE error event (``event: error``, then the JSON data
    the flavour's SDK raises on, then a blank line), as sent before it breaks
    off a stream.

    Raises:
        ValueError: an unknown ``flavour``.
    """

@final
class DataPlane:
    """The interception data plane (crate ``rust/dataplane``, docs/dataplane.md):
    an HTTP/1.1 server on its own tokio runtime that authenticates each model
    call by its rollout's secret, forwards it to ``upstream`` with ``api_key``,
    relays the answer, and queues a :class:`TurnRecord` per recorded call.
    It also answers ``GET /v1/models`` for a rollout's secret (401 without
    one) with the one model the rollout is served by, as the Python server
    does.  Constructing it starts serving; :meth:`close` stops it.

    With ``hold_for_ack`` each call's last bytes (a stream's terminal event, a
    whole answer) wait until its record is acked, so the owner must drain and
    ack every record (``lowwater.interception.dataplane.serve_records``).
    With ``release_when_readable`` too, only the calls that need the owner's
    verdict wait (see the argument); the others go out once their record is
    queued, and the owner drains before it shows a turn
    (``lowwater.interception.dataplane.Records.flush``).

    Args:
        upstream: the upstream's base URL (``http://host:port/v1``); a call to
            ``/v1/chat/completions`` goes to ``{upstream}/chat/completions``.
            ``https://`` verifies the upstream against the Mozilla roots and
            the PEM file ``SSL_CERT_FILE`` names, if set (read at start); a
            certificate that does not verify fails the call with a 502.
        api_key: sent upstream in place of the rollout's secret (``None``: none sent).
        host: address to bind (``"127.0.0.1"``); ``port``: 0 for any free port.
        max_body_bytes: largest request body accepted (bytes); larger is a 413.
        max_response_bytes: largest non-streamed upstream answer (bytes); larger is a 502.
        body_read_timeout_s: the longest a request's whole body may take to
            arrive (seconds, > 0); past it a 408 (``connection: close``), not recorded.
        upstream_timeout_s: connect timeout and the longest wait for any part
            of the upstream's answer (seconds); past it a 504.
        retries: retries of an error before the answer's head (connect, reset, closed), a 429 or a 5xx.
        backoff_s: first backoff step (seconds; full jitter, doubling).
        max_backoff_s: longest backoff and cap on a ``Retry-After`` (seconds).
        max_concurrency: upstream calls at once; more wait for a slot.
        pool_idle_timeout_s: idle upstream connections close after this (seconds).
        hold_for_ack: hold each call's last bytes until :meth:`ack` (off:
            records reach the wakeup fd in batches, at most 5 ms after the
            batch's first).
        release_when_readable: with ``hold_for_ack``, hold only the calls
            that need a verdict: those of a protocol whose spec has
            ``reads_any_json`` false, those handed over as ``"intercept"``
            upcalls (their response hooks run before the ack), and a 2xx
            answer that is not JSON (a stream with an event whose data is
            not); the others' last bytes go out once their record is queued.
            Records of released calls reach the wakeup fd in batches (at
            most 5 ms after the batch's first), not one wakeup per call.
        worker_threads: tokio worker threads (default: 1 where the process
            may use two cores or fewer, as Rust's
            ``std::thread::available_parallelism`` counts them, CPU affinity
            and cgroup quotas heeded; else 2).
        table: the :class:`InterceptTable` each call's request body is held in
            from its validation to its end (default: a new unbounded one).  A
            call over a bounded table's capacity is refused with 503 and
            ``retry-after: 1``; :meth:`register` opens the rollout in it and
            :meth:`unregister` closes it (sweeping what is still held).
        protocols: the routes, each a
            :meth:`lowwater.interception.protocols.Protocol.data_plane_spec`
            dict (default: the built-in three); the table is exactly these.
        rewrites: request rewrites by protocol name, each a mapping of rule
            kinds to rules, values as JSON text::

                {"openai.chat": {
                    "set": {"logprobs": "true"},  # always this value
                    "defaults": {"max_tokens": ("512", ("max_tokens", "max_completion_tokens"))},
                    "append": {"include": '"message.output_text.logprobs"'},
                }}

            ``set`` replaces or inserts the key; ``defaults`` inserts it only
            when neither the key nor any alias is present (``null``
            counts as present: the agent's value wins); ``append`` adds the
            item to the list at the key (absent or ``null``: ``[item]``; a
            list holding an equal item, or not a list: left alone).  Applied
            after the rollout's model override, in the order set, defaults,
            append, each in the mapping's order.  The body's other bytes are
            forwarded as sent; a body with nothing to change is forwarded
            unchanged.  Records keep the agent's messages.

        intercept: hand model calls to the control plane after validation
            and before forwarding, as ``"intercept"`` :class:`Upcall` s:
            ``True`` (every protocol), a list of protocol names, or
            ``False``/``None`` (the default: no call waits on Python).
        python_routes: path prefixes (each starting with ``/``; ``"/"``
            catches every path) whose requests, when no protocol route
            matches, are handed to the control plane as ``"route"``
            :class:`Upcall` s (any method; body under ``max_body_bytes``).
            Empty (the default): such requests are 404.
        trim_when_idle: give glibc's free heap pages back to the OS
            (``malloc_trim(0)`` on a thread of its own, never a worker) once
            for a second no call started, no client connection ended and no
            rollout was unregistered, and again once the idle upstream
            connections have closed (``stats()["trims"]`` counts them).

    Raises:
        DataPlaneConfigError: an unusable configuration (see the exception),
            including a bad protocol table (an unknown flavour or field kind,
            not exactly one terminal rule, two protocols with one name or path).
            Also an ``intercept`` name no protocol has or a ``python_routes``
            prefix not starting with ``/``.
        TypeError: ``intercept`` neither a bool nor a list of names.
        ValueError: a negative or non-finite duration.
        TypeError: ``rewrites`` not shaped as above.
        OverflowError: a negative count or a port over 65535.
        OSError: the address cannot be resolved or bound.
    """

    def __new__(
        cls,
        upstream: str,
        *,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 64 << 20,
        max_response_bytes: int = 256 << 20,
        body_read_timeout_s: float = 60.0,
        upstream_timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_concurrency: int = 1024,
        pool_idle_timeout_s: float = 5.0,
        hold_for_ack: bool = True,
        release_when_readable: bool = False,
        worker_threads: int | None = None,
        table: InterceptTable | None = None,
        protocols: list[dict[str, Any]] | None = None,
        rewrites: Mapping[str, Mapping[str, Mapping[str, str | tuple[str, tuple[str, ...]]]]] | None = None,
        intercept: bool | Sequence[str] | None = None,
        python_routes: Sequence[str] = ...,
        trim_when_idle: bool = True,
    ) -> Self: ...
    @property
    def protocols(self) -> list[dict[str, Any]]:
        """The protocol table in order (a record's ``protocol_id`` indexes
        it), each as :meth:`lowwater.interception.protocols.Protocol.data_plane_spec`
        gives it.

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    @property
    def table(self) -> InterceptTable:
        """The intercept table holding the in-flight calls' request bodies."""
    @property
    def address(self) -> str:
        """``"host:port"`` the server listens on (the chosen port when 0 was asked)."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
    def register(
        self,
        rollout_id: str,
        secret: str,
        *,
        upstream: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
    ) -> None:
        """Open a rollout: calls with ``Authorization: Bearer <secret>`` or
        ``x-api-key: <secret>`` are its calls.

        Args:
            upstream: the rollout's upstream base URL (``http://host:port/v1``;
                ``None``: the plane's).
            api_key: the key sent to the rollout's upstream (``None``: the plane's).
            model: sent upstream as each request's ``model`` in place of the
                agent's, recorded as the turn's model, and the one model
                ``GET /v1/models`` lists (``None``: the agent's model is
                forwarded, and ``lowwater-upstream`` is listed).

        Raises:
            DataPlaneConfigError: a bad ``upstream`` (not http or https), or an
                ``api_key`` that is not visible ASCII.
            DuplicateRollout: ``rollout_id`` is open already.
            DuplicateSecret: another open rollout has ``secret``.
            ValueError: an empty ``rollout_id`` or ``secret``.
            DataPlaneClosed: after :meth:`close`.
        """
    def unregister(self, rollout_id: str) -> int:
        """Close a rollout: its secret is refused from now on (401), a call
        not yet answered gets 410 and a stream under way an error event.
        Every call of the rollout not cancelled has its record queued when
        this returns.

        Its upcalls waiting for an answer are answered 410 as well, and a
        later :meth:`resume`/:meth:`reject` of them returns False.

        Returns the number of in-flight calls and waiting upcalls cancelled.

        Raises:
            KeyError: ``rollout_id`` is not open.
            DataPlaneClosed: after :meth:`close`.
        """
    def wakeup_fd(self) -> int:
        """An fd that is readable while records wait (owned by the plane: do
        not close it; it is closed by :meth:`close`, so stop waiting on it first).

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def drain(self) -> list[TurnRecord]:
        """Every waiting record, oldest first (clears the wakeup fd first, so
        no wakeup is lost).

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def set_rewrites(
        self, rewrites: Mapping[str, Mapping[str, Mapping[str, str | tuple[str, tuple[str, ...]]]]]
    ) -> None:
        """Replace the request rewrites (as the constructor's ``rewrites``), for
        the calls that start from now on.

        Raises:
            DataPlaneConfigError: a value that is not JSON, an unknown rule
                kind or protocol (nothing changed).
            TypeError: a wrongly shaped mapping.
            DataPlaneClosed: after :meth:`close`.
        """
    def set_intercept(self, intercept: bool | Sequence[str]) -> None:
        """Switch which protocols' calls are intercepted (as the constructor's
        ``intercept``), for the calls that reach their intercept step from now on.

        Raises:
            DataPlaneConfigError: a name no protocol has (nothing changed).
            TypeError: neither a bool nor a list of names.
            DataPlaneClosed: after :meth:`close`.
        """
    def ack(self, seq: int) -> bool:
        """Release the held last bytes of record ``seq``; False if nothing
        waits on it (acked already, its client left, or not held).

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def fail(self, seq: int, status: int, reason: str) -> bool:
        """Release record ``seq``'s call with an error instead of its held
        bytes (its protocol could not read the answer): a whole answer is
        replaced by ``status`` with ``reason`` in the protocol's error body,
        a stream gets an error event with ``reason`` instead of its terminal
        event and is broken off.  False as for :meth:`ack`.

        Raises:
            ValueError: ``status`` outside 400-599.
            DataPlaneClosed: after :meth:`close`.
        """
    def release_all(self) -> int:
        """Release every held call; returns how many were held.

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def stats(self) -> dict[str, int]:
        """A snapshot: ``open_rollouts``, ``secrets``, ``in_flight``,
        ``active_calls``, ``connections``, ``queued``, ``awaiting_ack`` (now),
        and the counters since start ``calls``, ``ok``, ``failed``,
        ``closed``, ``disconnected``, ``refused``, ``released`` (recorded
        calls whose last bytes went out without waiting for the ack,
        ``release_when_readable``); ``intercepts`` and
        ``intercept_bytes``: request bodies held in :attr:`table` now;
        ``upstream_requests`` and ``upstream_retried``: attempts sent
        upstream since start, and of those the retries;
        ``pending_upcalls`` (upcalls waiting for an answer) and the counter
        ``upcalls`` (made since start);
        ``trims`` (times free heap pages were given back, ``trim_when_idle``).

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def upcall_fd(self) -> int:
        """An fd that is readable while upcalls wait to be drained (owned by
        the plane: do not close it; closed by :meth:`close`).

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def drain_upcalls(self) -> list[Upcall]:
        """Every queued upcall still waiting, oldest first (clears the fd
        first, so no wakeup is lost).  One whose client left or whose rollout
        was unregistered meanwhile is not returned.

        Raises:
            DataPlaneClosed: after :meth:`close`.
        """
    def resume(self, id: int, body: bytes | None = None) -> bool:
        """Forward intercepted call ``id``: the agent's bytes (``None``) or
        ``body``, which the plane validates again with the call's protocol
        (a 400 naming the problem if it does not pass) and which the turn
        records (its messages delta is of ``body``).  False if the upcall no
        longer waits (answered, unregistered, its client left, closed).

        Raises:
            ValueError: ``id`` is a route upcall.
            DataPlaneClosed: after :meth:`close`.
        """
    def reject(self, id: int, status: int, message: str) -> bool:
        """Refuse intercepted call ``id``: the agent gets ``status`` with
        ``message`` in the protocol's error body; nothing is forwarded or
        recorded.  False if the upcall no longer waits.

        Raises:
            ValueError: ``status`` outside 400-599, or ``id`` is a route upcall.
            OverflowError: ``status`` outside 0-65535.
            DataPlaneClosed: after :meth:`close`.
        """
    def respond(self, id: int, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes = ...) -> bool:
        """Answer route upcall ``id`` with ``status``, ``headers`` (byte
        pairs; ``content-length``, ``transfer-encoding`` and ``connection``
        are dropped: the plane frames the body) and ``body``.  False if the
        upcall no longer waits.

        Raises:
            ValueError: ``status`` outside 200-599, an invalid header name or
                value, or ``id`` is an intercept upcall.
            OverflowError: ``status`` outside 0-65535.
            DataPlaneClosed: after :meth:`close`.
        """
    def close(self) -> None:
        """Stop serving, answer waiting upcalls 503, release held calls,
        stop the runtime and join its threads (the GIL released meanwhile).
        Idempotent."""
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: object, exc: object, tb: object, /) -> bool:
        """:meth:`close`."""
