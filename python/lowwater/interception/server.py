"""The interception server: an OpenAI/Anthropic-compatible proxy that records
each model call of a rollout as a turn and holds its request body for exactly
the life of the call.

The calls are served by the Rust data plane (:class:`lowwater._native.DataPlane`,
docs/dataplane.md) on its own threads: it authenticates each call by its
rollout's secret, holds the body in the :class:`~lowwater.InterceptTable`,
forwards it upstream (the run's sampling arguments, the rollout's model and
the logprob fields spliced into the bytes), relays the answer (SSE as it
arrives, the terminal event held until the turn is recorded) and discards
the body when the call ends, on every path.  A peer kept every intercepted
body (the full history with base64 images) until its rollout ended and ran
out of memory within a few training steps (docs/design.md#incidents); a
Python HTTP stack per call left a long-lived proxy hundreds of MB over its
baseline after a burst (benches/README.md).

This module is the control plane, on the Trio loop.  It registers rollouts
(:meth:`InterceptionServer.register` hands out a :class:`Slot`: base URL and
secret), turns each recorded call into a :class:`~lowwater.trajectory.Turn`
of the rollout's trajectory (:func:`~lowwater.interception.dataplane.turn_of`
parses only the messages the rollout had not sent before), and serves what
the plane hands to Python (:mod:`lowwater.interception.upcalls`): the
interceptor hooks, only when some plugin implements one, and the routes
mounted with :meth:`InterceptionServer.mount` (``lowwater proxy``'s
``/lowwater/`` endpoints).  A call enters the interpreter only as its record.

:meth:`InterceptionServer.unregister` closes a rollout at once: its secret
is refused (401), a call not yet answered gets 410 and a stream under way an
error event, and its held bodies are swept from the table.

Status codes the agent can see: 400 (malformed JSON, a missing or mistyped
field), 401 (missing or unknown secret), 404/405 (no such route or method),
408 (a body not received within 60 s), 410 (the rollout was closed), 413
(body over ``max_body_bytes``), 503 (the intercept table is full), the
upstream's own 4xx (429 with its ``retry-after``), 502 (upstream
unreachable, 5xx after retries) and 504 (upstream timeout).  None is a 500,
except a call an interceptor plugin failed on
(:mod:`lowwater.interception.hooks`); an interceptor's
:class:`~lowwater.interception.hooks.Reject` gives its own status.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Sequence
from typing import Any

import orjson
import trio

from lowwater._native import DataPlane, DataPlaneClosed, InterceptTable, TurnRecord, Upcall
from lowwater.http import MAX_JSON_DEPTH, App, HTTPError, Router, nests_deeper
from lowwater.http.exposure import check_bind, public_address
from lowwater.http.routes import normalise
from lowwater.interception.dataplane import Fail, Records, read_record, rewrites_for
from lowwater.interception.hooks import InterceptedCall, InterceptedResponse, Interceptors
from lowwater.interception.protocols import Completion, Protocol, builtin_protocols
from lowwater.interception.slots import Slot, SlotRegistry, new_secret
from lowwater.interception.upcalls import header_map, serve_upcalls
from lowwater.trajectory import Trajectory, Turn
from lowwater.upstream.client import ModelClient

log = logging.getLogger("lowwater.interception")

DEFAULT_MAX_BODY_BYTES = 64 << 20
# The recorded answer fields are checked inside one list: one level more.
_ANSWER_DEPTH = MAX_JSON_DEPTH + 1
# The plane needs a default upstream; a server given none names this
# unroutable one, and every register() must then name its own.
_NO_UPSTREAM = "http://127.0.0.1:9/v1"
_CALL_COUNTERS = ("total", "ok", "failed", "closed", "disconnected")


class InterceptionServer:
    """The interception server: a Rust data plane and its Trio control plane.

    Start it in a nursery, then register rollouts::

        server = InterceptionServer(ModelClient("http://127.0.0.1:8000/v1"))
        url = await nursery.start(server.run)          # "http://127.0.0.1:PORT"
        slot = server.register(trajectory)             # slot.base_url, slot.secret
        ...                                            # the agent calls slot.base_url
        server.unregister(trajectory.rollout_id)

    Args:
        upstream: the default :class:`~lowwater.upstream.client.ModelClient`
            (its URL, key, model, retries, backoff, timeout, concurrency and
            keep-alive expiry configure the plane's upstream client); a slot
            may be given its own at :meth:`register`.
        protocols: the wire protocols to route (default: the three built-ins);
            each must declare its :attr:`~lowwater.interception.protocols.Protocol.wire`.
        table: the intercept table (default: a new unbounded one).
        max_body_bytes: request bodies above this are refused with 413 (bytes).
        request_logprobs: ask the upstream for token ids and logprobs where
            the protocol allows (chat: ``logprobs`` + ``return_token_ids``,
            vLLM/SGLang; responses: ``include`` output logprobs).  Trainers
            need them; a hosted API may refuse the extra fields.

    Attributes:
        table: the :class:`~lowwater.InterceptTable` (entries live for one call).
        url: ``http://HOST:PORT`` once :meth:`run` has started, else ``""``.
        routes: protocol by path.
        sampling: sampling arguments added to every forwarded call where the
            agent's request does not set them (:mod:`lowwater.interception.sampling`);
            may be set while the server runs (the calls that start from then on get them).
        interceptors: ``None``, or the plugins' interceptor hooks
            (:meth:`lowwater.plugins.Plugins.interceptors`); may be set while
            the server runs (the calls that start from then on see them).

    Raises:
        ValueError: two protocols share a name or a path, or one declares no wire format.
    """

    def __init__(
        self,
        upstream: ModelClient | None = None,
        *,
        protocols: Sequence[Protocol] | None = None,
        table: InterceptTable | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        request_logprobs: bool = False,
    ) -> None:
        self.upstream = upstream
        self.table = table if table is not None else InterceptTable()
        self.max_body_bytes = max_body_bytes
        self.request_logprobs = request_logprobs
        self._sampling: dict[str, Any] = {}
        self._interceptors: Interceptors | None = None
        self.routes: dict[str, Protocol] = {}
        names: set[str] = set()
        for protocol in protocols if protocols is not None else builtin_protocols():
            path = normalise(protocol.path)
            if path in self.routes or protocol.name in names:
                raise ValueError(f"protocol {protocol.name!r} ({protocol.path}) clashes with one already given")
            if protocol.wire is None:
                raise ValueError(
                    f"protocol {protocol.name!r} declares no wire format (Protocol.wire): the data plane cannot serve it"
                )
            if hasattr(protocol, "upstream_body"):
                # The Python server called it on every body; the data plane
                # does not, so a plugin's rewrite would be silently skipped.
                raise ValueError(
                    f"protocol {protocol.name!r} defines upstream_body(), which the data plane does not call: "
                    "declare the rewrite with data_plane_rewrites() (or an intercept_request hook)"
                )
            self.routes[path] = protocol
            names.add(protocol.name)
        self._by_name = {p.name: p for p in self.routes.values()}
        self.url = ""
        self._base_url = ""
        self.slots = SlotRegistry()
        self.plane: DataPlane | None = None
        self._records: Records | None = None
        self._mounts: list[tuple[str, App]] = []
        # Request id -> the call its intercept_request hooks saw, until its
        # record hands it to intercept_response (or its rollout closes).
        self._intercepted: dict[str, InterceptedCall] = {}
        self._last_stats: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------

    async def run(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise: str | None = None,
        admin_key: str | None = None,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; ``task_status.started`` gets ``"http://HOST:PORT"``.

        Port 0 lets the OS choose.  Cancelling the enclosing scope stops the
        plane (every call still open is dropped and its body discarded) and
        joins its threads.  ``HOST`` (and every slot's ``base_url``) uses
        ``advertise`` when given (for a ``0.0.0.0`` bind: this host's
        primary address), so agents on other hosts can dial it.  Binding
        beyond loopback needs ``admin_key`` (the caller's proof that it
        meant to expose the server; every call still needs its rollout's
        secret) and is logged.

        Raises:
            lowwater.http.exposure.ExposureError: ``host`` is beyond loopback
                and no ``admin_key`` was given.
            OSError: the address cannot be bound.
            lowwater.DataPlaneConfigError: the upstream URL is unusable.
        """
        check_bind("the interception server", host, admin_key)
        # Name resolution and the runtime's start block (the GIL released).
        plane = await trio.to_thread.run_sync(self._start_plane, host, port)
        self.plane = plane
        self._records = records = Records(plane, self._on_record)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(records.serve)
                # Always: interceptors may be set while the server runs (it
                # waits on the plane's upcall fd, which is quiet until then).
                nursery.start_soon(
                    functools.partial(serve_upcalls, plane, app=self._mounted_app(), intercept=self._intercept)
                )
                self.url = "http://" + public_address(host, plane.address, advertise)
                # One string shared by every slot of this run, not one per slot.
                self._base_url = f"{self.url}/v1"
                task_status.started(self.url)
                await trio.sleep_forever()
        finally:
            # The turns of calls already answered, before their slots close.
            records.stop()
            self._records = None
            self._last_stats = plane.stats()
            self.url = self._base_url = ""
            self.plane = None
            for rollout_id in list(self.slots):
                if (slot := self.slots.get(rollout_id)) is not None:
                    slot.closed = True  # its calls ended with the plane
                    slot.trajectory.sync_with(None)
                # The table outlives the plane (its owner may read it): no rollout left open in it.
                self.table.close_rollout(rollout_id)
            self._intercepted.clear()
            # Shielded: a cancelled run must still join the plane's threads.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(plane.close)

    def _start_plane(self, host: str, port: int) -> DataPlane:
        client = self.upstream
        options: dict[str, Any] = {}
        if client is not None:
            options = {
                "api_key": client.api_key,
                "retries": client.retries,
                "backoff_s": client.backoff_s,
                "max_backoff_s": client.max_backoff_s,
                "upstream_timeout_s": client.timeout_s,
                "max_concurrency": client.max_concurrency,
                "pool_idle_timeout_s": client.keepalive_expiry_s,
            }
        return DataPlane(
            client.plane_url() if client is not None else _NO_UPSTREAM,
            host=host,
            port=port,
            max_body_bytes=self.max_body_bytes,
            table=self.table,
            protocols=[p.data_plane_spec() for p in self.routes.values()],
            rewrites=self._rewrites(),
            # A call whose answer needs no verdict goes out once recorded in
            # the plane; trajectories drain before they are read (sync_with).
            release_when_readable=True,
            **self._upcall_options(),
            **options,
        )

    def _rewrites(self) -> dict[str, dict[str, dict[str, Any]]]:
        return rewrites_for(
            self._sampling, request_logprobs=self.request_logprobs, protocols=list(self.routes.values())
        )

    @property
    def sampling(self) -> dict[str, Any]:
        return self._sampling

    @sampling.setter
    def sampling(self, sampling: dict[str, Any]) -> None:
        previous, self._sampling = self._sampling, dict(sampling)
        try:
            # Encoded now: a value orjson cannot encode fails here, not on a call.
            rules = self._rewrites()
        except Exception:
            self._sampling = previous
            raise
        if self.plane is not None:
            self.plane.set_rewrites(rules)

    @property
    def interceptors(self) -> Interceptors | None:
        return self._interceptors

    @interceptors.setter
    def interceptors(self, interceptors: Interceptors | None) -> None:
        self._interceptors = interceptors
        if self.plane is not None:
            # Calls enter Python only while some plugin has an interceptor hook.
            self.plane.set_intercept(_hooked(interceptors))

    def _upcall_options(self) -> dict[str, Any]:
        """What the plane hands to Python: calls for the request hooks, mounted routes."""
        options: dict[str, Any] = {}
        if _hooked(self.interceptors):
            options["intercept"] = True
        if self._mounts:
            options["python_routes"] = [prefix for prefix, _ in self._mounts]
        return options

    def register(self, trajectory: Trajectory, *, upstream: ModelClient | None = None) -> Slot:
        """Open a slot for ``trajectory``'s rollout.

        Returns the :class:`Slot`: ``base_url`` (``http://HOST:PORT/v1``),
        ``secret``, ``rollout_id``.

        Raises:
            KeyError: the rollout is already registered.
            RuntimeError: the server is not running yet (no URL), or no
                upstream was given here or at construction.
            lowwater.DataPlaneConfigError: ``upstream``'s URL is unusable.
        """
        plane = self.plane
        if plane is None or not self.url:
            raise RuntimeError("the interception server is not running (await nursery.start(server.run) first)")
        client = upstream or self.upstream
        if client is None:
            raise RuntimeError("no upstream ModelClient: give one to InterceptionServer() or register()")
        slot = Slot(trajectory.rollout_id, self._base_url, new_secret(), trajectory, client)
        self.slots.add(slot)
        try:
            if client is self.upstream:
                plane.register(slot.rollout_id, slot.secret, model=client.model)
            else:
                plane.register(
                    slot.rollout_id,
                    slot.secret,
                    upstream=client.plane_url(),
                    api_key=client.api_key,
                    model=client.model,
                )
        except BaseException:
            self.slots.pop(slot.rollout_id)
            raise
        trajectory.sync_with(self._sync)
        return slot

    def unregister(self, rollout_id: str) -> int:
        """Close a rollout's slot at once.

        Forgets its secret (later calls get 401), answers each of its calls
        still waiting 410 (a stream under way gets an error event) without
        waiting for the upstream, and sweeps its bodies from the table.
        Idempotent.

        Returns:
            How many calls it cancelled.
        """
        slot = self.slots.get(rollout_id)
        if slot is None:
            return 0
        plane, cancelled = self.plane, 0
        if plane is not None:
            try:
                # Every call it does not cancel has its record queued when it returns ...
                cancelled = plane.unregister(rollout_id)
            except KeyError:
                pass
            # ... so the turns of calls already answered land before the slot closes.
            self._sync()
        self.slots.pop(rollout_id)
        slot.closed = True
        slot.trajectory.sync_with(None)
        for request_id in [r for r, c in self._intercepted.items() if c.rollout_id == rollout_id]:
            del self._intercepted[request_id]
        return cancelled

    def _sync(self) -> None:
        """Apply the records the plane has queued (a trajectory is about to be
        read; see :meth:`Records.flush`)."""
        records = self._records
        if records is not None:
            try:
                records.flush()
            except DataPlaneClosed:
                pass  # stopping: run()'s exit applies what is left

    @property
    def calls(self) -> dict[str, int]:
        """Counters since start: ``total`` calls, ``ok``, ``failed``, ``closed``
        by unregister, ``disconnected`` clients."""
        stats = self.plane.stats() if self.plane is not None else self._last_stats
        return {
            "total": stats.get("calls", 0),
            "ok": stats.get("ok", 0),
            "failed": stats.get("failed", 0),
            "closed": stats.get("closed", 0),
            "disconnected": stats.get("disconnected", 0),
        }

    def stats(self) -> dict[str, Any]:
        """``intercepts`` (the table's stats), ``open_rollouts``, ``waiting_handlers``
        (calls of open rollouts being served now), ``calls`` (:attr:`calls`),
        ``upstream`` (``requests`` and ``retried``: attempts sent upstream
        since start) and ``plane`` (the data plane's own stats, ``{}`` when
        not running)."""
        plane = self.plane.stats() if self.plane is not None else {}
        return {
            "intercepts": self.table.stats(),
            "open_rollouts": len(self.slots),
            "waiting_handlers": plane.get("in_flight", 0),
            "calls": self.calls,
            "upstream": {"requests": plane.get("upstream_requests", 0), "retried": plane.get("upstream_retried", 0)},
            "plane": plane,
        }

    def mount(self, prefix: str, app: App) -> None:
        """Serve requests whose path starts with ``prefix`` with another ASGI
        ``app`` (``lowwater proxy`` mounts its admin endpoints at ``/lowwater/``).

        Raises:
            RuntimeError: the server is running already (mount before :meth:`run`).
        """
        if self.plane is not None:
            raise RuntimeError("mount() before run(): the data plane's routes are fixed when it starts")
        self._mounts.append((prefix, app))

    # -- the control plane's two paths ---------------------------------------------

    def _on_record(self, record: TurnRecord) -> Awaitable[Fail | None] | Fail | None:
        """Append a recorded call's turn to its rollout's trajectory; the
        record's verdict (:func:`~lowwater.interception.dataplane.read_record`).

        The call's last bytes wait until this (and any ``intercept_response``
        hook) returns, so the agent never holds an answer whose turn is not
        in the trajectory."""
        intercepted = self._intercepted.pop(record.request_id, None)
        slot = self.slots.get(record.rollout_id)
        if slot is None or slot.closed:
            return None  # a closed rollout's trajectory is no longer ours to write
        turn, verdict = read_record(record, slot.trajectory, self._by_name)
        if nests_deeper(
            [turn.completion, turn.finish_reason, turn.usage, turn.token_ids, turn.logprobs], _ANSWER_DEPTH
        ):
            # An upstream answer nesting past the limit could not be written
            # with the trajectory: the turn keeps the error, not the answer.
            turn.completion = turn.finish_reason = turn.usage = turn.token_ids = turn.logprobs = None
            turn.error = turn.error or f"upstream answer nests deeper than {MAX_JSON_DEPTH} levels; not recorded"
        slot.trajectory.add_turn(turn)
        interceptors = self.interceptors
        if verdict is not None or intercepted is None or interceptors is None or not interceptors.responses:
            return verdict
        return self._respond(interceptors, intercepted, turn)

    @staticmethod
    async def _respond(interceptors: Interceptors, call: InterceptedCall, turn: Turn) -> None:
        await interceptors.response(call, InterceptedResponse.of(_completion_of(turn)))

    def _mounted_app(self) -> App | None:
        """The mounted apps as one ASGI app, dispatched by prefix."""
        if not self._mounts:
            return None
        router = Router(error_body=_error_body)
        for prefix, app in self._mounts:
            router.mount(prefix, app)

        async def dispatch(scope: Any, receive: Any, send: Any) -> None:
            # A mounted app (lowwater proxy's admin and session endpoints)
            # shows turns: the calls already answered are in them first.
            self._sync()
            await router.dispatch(scope, receive, send)

        return dispatch

    async def _intercept(self, upcall: Upcall) -> bytes | None:
        """Run the ``intercept_request`` hooks on one call's body; the bytes to
        forward (what the last hook left), or ``None`` to forward the agent's.
        With ``intercept_response`` hooks, keep the call for them (its body
        as sent, its headers, the state the request hooks left): a plugin
        with only a response hook still needs the call it answers.

        Raises:
            lowwater.http.HTTPError: a hook's :class:`~lowwater.interception.hooks.Reject`,
                or 500 naming the plugin whose hook failed; 400 if what the
                hooks left cannot be encoded.
        """
        interceptors = self.interceptors
        if not _hooked(interceptors):
            return None
        assert interceptors is not None
        payload = orjson.loads(upcall.body)  # the plane validated it: a JSON object
        rollout_id, request_id = upcall.rollout_id or "", upcall.request_id or ""
        call = InterceptedCall(rollout_id, upcall.protocol or "", payload, headers=header_map(upcall.headers))
        forward = None
        if interceptors.requests:
            await interceptors.request(call)
            try:
                forward = orjson.dumps(call.body)
            except orjson.JSONEncodeError as exc:
                raise HTTPError(400, f"the request cannot be re-encoded for the upstream: {exc}") from None
        slot = self.slots.get(rollout_id)
        if interceptors.responses and slot is not None and not slot.closed:
            self._intercepted[request_id] = call
        return forward


def _hooked(interceptors: Interceptors | None) -> bool:
    """Whether calls must be handed to Python: some plugin has a request or a
    response hook (a response hook needs the call it answers: handed over
    for request hooks only, a plugin with only ``intercept_response`` was
    never called)."""
    return interceptors is not None and bool(interceptors.requests or interceptors.responses)


def _error_body(scope: Any, err: HTTPError) -> Any:
    """A mounted app's error in OpenAI's shape (no protocol owns those paths)."""
    return Protocol().error_body(err.status, err.reason)


def _completion_of(turn: Turn) -> Completion:
    return Completion(turn.completion, turn.finish_reason, turn.usage, turn.token_ids, turn.logprobs, turn.error)
