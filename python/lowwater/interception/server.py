"""The interception server: an OpenAI/Anthropic-compatible proxy that records
each model call of a rollout as a turn and holds its request body for exactly
the life of the call.

Per call (docs/design.md#data-flow, step 4): authenticate the rollout's secret,
put the raw body in the :class:`~lowwater.InterceptTable`, forward it
upstream, append the turn to the trajectory, deliver the answer (relaying
SSE as it arrives and holding the terminal event until the turn is
recorded), and discard the intercept in ``finally``.  A peer kept every
intercepted body (the full history with base64 images) until its rollout
ended and ran out of memory within a few training steps
(docs/design.md#incidents).  Here the agent's bytes live once, in the table: the upstream
request is sent from a zero-copy view of the table entry, and of the parsed
body only the turn's message delta and the tools offered (one list per
distinct set in a trajectory) outlive the parse.

:meth:`InterceptionServer.unregister` sweeps a rollout's undelivered
intercepts and cancels every handler still serving it: a handler that has
not answered yet answers 410 at once, a stream already under way gets an
error event and is broken off.  No handler waits on a rollout that is gone.

Status codes the agent can see: 400 (malformed JSON, a missing or mistyped
field), 401 (missing or unknown secret), 404/405 (no such route or method),
410 (the rollout was closed), 413 (body over ``max_body_bytes``), 503 (the
intercept table is full), the upstream's own 4xx (429 with its
``retry-after``), 502 (upstream unreachable, 5xx after retries, or a
malformed answer) and 504 (upstream timeout).  None is a 500, except a
call an interceptor plugin failed on (:mod:`lowwater.interception.hooks`);
an interceptor's :class:`~lowwater.interception.hooks.Reject` gives its own status.

Why one module of ~700 lines: it is one call's path, read top to bottom
(intake, hooks, table, forward, relay, record, discard), and every step
shares the per-call state (``_Call``) and the server's counters; the wire
formats (:mod:`.protocols`, :mod:`.sse`), the hooks (:mod:`.hooks`), slots
(:mod:`.slots`) and the HTTP plumbing (:mod:`lowwater.http`) already live
elsewhere.  (The per-call path is due to move into the Rust data plane:
docs/dataplane.md.)
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import orjson
import trio

from lowwater._native import BufferFull, InterceptTable, RolloutClosed
from lowwater.http import (
    MAX_JSON_DEPTH,
    App,
    HTTPError,
    Receive,
    Router,
    Scope,
    Send,
    lifespan,
    nests_deeper,
    parse_json,
    read_body,
    request_keys,
    send_bytes,
    send_error,
    send_json,
    start_response,
)
from lowwater.http.routes import normalise
from lowwater.http.server import open_server
from lowwater.interception.hooks import InterceptedCall, InterceptedResponse, Interceptors
from lowwater.interception.protocols import Completion, Protocol, builtin_protocols
from lowwater.interception.sampling import apply as apply_sampling
from lowwater.interception.slots import Slot, SlotRegistry, new_secret
from lowwater.interception.sse import SSEParser
from lowwater.redact import redact_url
from lowwater.trajectory import Trajectory, Turn
from lowwater.upstream.client import Answer, ModelClient, read_answer

log = logging.getLogger("lowwater.interception")

DEFAULT_MAX_BODY_BYTES = 64 << 20
# How often idle upstream connections are pruned when no client is known (seconds).
DEFAULT_PRUNE_INTERVAL_S = 5.0
MIN_PRUNE_INTERVAL_S = 0.1
# Request headers that change what the upstream does, passed on as sent.
_FORWARD_HEADERS = (b"anthropic-version", b"anthropic-beta", b"openai-beta")
# Agents keep connections between turns; a turn may take minutes (seconds).
KEEP_ALIVE_S = 75.0
# Thousands of rollouts may connect at once (hypercorn's default backlog is
# 100; the kernel caps it at net.core.somaxconn).
BACKLOG = 4096
# A send to the client is never interrupted by a rollout's cancellation: a
# cancel that lands inside hypercorn's ``send`` leaves the keep-alive
# connection half-written, and the agent's next request on it was never
# answered (found as a hung ``lowwater eval``).  A client that reads nothing
# for this long is cut off instead.
SEND_TIMEOUT_S = 60.0
# The recorded answer fields are checked inside one list: one level more.
_ANSWER_DEPTH = MAX_JSON_DEPTH + 1


class InterceptionServer:
    """The interception server, an ASGI app served by hypercorn on Trio.

    Start it in a nursery, then register rollouts::

        server = InterceptionServer(ModelClient("http://127.0.0.1:8000/v1"))
        url = await nursery.start(server.run)          # "http://127.0.0.1:PORT"
        slot = server.register(trajectory)             # slot.base_url, slot.secret
        ...                                            # the agent calls slot.base_url
        server.unregister(trajectory.rollout_id)

    Args:
        upstream: the default :class:`~lowwater.upstream.client.ModelClient`; a slot
            may be given its own at :meth:`register`.
        protocols: the wire protocols to route (default: the three built-ins).
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
        on_pruned: ``None`` or a callable given the number of idle upstream
            connections a pruning pass closed (called on the loop, only when
            it closed some): freed memory an owner may want to trim
            (``lowwater proxy`` does).

    Raises:
        ValueError: two protocols share a name or a path.
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
        # Every client a slot forwards through, for _prune_upstreams; weak, so
        # a client given to register() is not kept alive by the server.
        self._upstreams: weakref.WeakSet[ModelClient] = weakref.WeakSet([upstream] if upstream else [])
        self.table = table if table is not None else InterceptTable()
        self.max_body_bytes = max_body_bytes
        self.request_logprobs = request_logprobs
        #: Sampling arguments added to every forwarded call; the agent's own keys win
        #: (:mod:`lowwater.interception.sampling`).
        self.sampling: dict[str, Any] = {}
        #: ``None``, or the plugins' interceptor hooks
        #: (:meth:`lowwater.plugins.Plugins.interceptors`), awaited on every call.
        self.interceptors: Interceptors | None = None
        self.routes: dict[str, Protocol] = {}
        self._router = Router(error_body=self._error_body)
        self._router.add("GET", "/v1/models", self._models)
        names: set[str] = set()
        for protocol in protocols if protocols is not None else builtin_protocols():
            path = normalise(protocol.path)
            if path in self.routes or protocol.name in names:
                raise ValueError(f"protocol {protocol.name!r} ({protocol.path}) clashes with one already given")
            self.routes[path] = protocol
            self._router.add("POST", path, functools.partial(self._call, protocol))
            names.add(protocol.name)
        self.url = ""
        self.on_pruned: Callable[[int], None] | None = None
        self.slots = SlotRegistry()
        self._watchers: trio.Nursery | None = None
        # Request ids: unique per server and cheap (uuid4 reads os.urandom per call).
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self.calls = {"total": 0, "ok": 0, "failed": 0, "closed": 0, "disconnected": 0}

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
        server and every handler (each discards its intercept on the way out).
        ``HOST`` (and every slot's ``base_url``) uses ``advertise`` when given
        (for a ``0.0.0.0`` bind: this host's primary address), so agents on
        other hosts can dial it.  Binding beyond loopback needs ``admin_key``
        (the caller's proof that it meant to expose the server; every call
        still needs its rollout's secret) and is logged.

        Raises:
            lowwater.http.exposure.ExposureError: ``host`` is beyond loopback
                and no ``admin_key`` was given.
            OSError: the address cannot be bound.
        """
        server = open_server(
            "the interception server",
            self,
            host,
            port,
            advertise=advertise,
            admin_key=admin_key,
            keep_alive_s=KEEP_ALIVE_S,
            backlog=BACKLOG,
        )
        async with server as (nursery, address):
            # Set with the URL: a call reaches _serve only through a slot, and register() needs the URL.
            self._watchers = nursery
            self.url = f"http://{address}"
            nursery.start_soon(self._prune_upstreams)
            task_status.started(self.url)

    async def _prune_upstreams(self) -> None:
        """Every keep-alive expiry, close the upstream connections left idle past it.

        A burst of calls leaves one idle connection per concurrent call in the
        pool, reused only from the top: without this, 1,024 of them (closed
        by the upstream, in CLOSE_WAIT) outlived every rollout of the burst.
        """
        while True:
            clients = list(self._upstreams)
            interval = min((c.keepalive_expiry_s for c in clients), default=DEFAULT_PRUNE_INTERVAL_S)
            await trio.sleep(max(interval, MIN_PRUNE_INTERVAL_S))  # an expiry of 0 must not spin
            closed = 0
            for client in clients:
                closed += await client.prune_idle()
            if closed and self.on_pruned is not None:
                self.on_pruned(closed)

    def register(self, trajectory: Trajectory, *, upstream: ModelClient | None = None) -> Slot:
        """Open a slot for ``trajectory``'s rollout (and the rollout in the table).

        Returns the :class:`Slot`: ``base_url`` (``http://HOST:PORT/v1``),
        ``secret``, ``rollout_id``.

        Raises:
            KeyError: the rollout is already registered.
            RuntimeError: the server is not running yet (no URL), or no
                upstream was given here or at construction.
        """
        if not self.url:
            raise RuntimeError("the interception server is not running (await nursery.start(server.run) first)")
        client = upstream or self.upstream
        if client is None:
            raise RuntimeError("no upstream ModelClient: give one to InterceptionServer() or register()")
        self._upstreams.add(client)
        slot = Slot(trajectory.rollout_id, f"{self.url}/v1", new_secret(), trajectory, client)
        self.slots.add(slot)
        self.table.open_rollout(slot.rollout_id)
        return slot

    def unregister(self, rollout_id: str) -> int:
        """Close a rollout's slot at once.

        Sweeps its undelivered intercepts from the table, forgets its secret
        (later calls get 401), and cancels every handler serving it: each
        answers 410 (or breaks its stream) without waiting for the upstream.
        Idempotent.

        Returns:
            How many undelivered intercepts were swept.
        """
        slot = self.slots.pop(rollout_id)
        swept = len(self.table.close_rollout(rollout_id))
        if slot is not None:
            slot.close()
        return swept

    def stats(self) -> dict[str, Any]:
        """``intercepts`` (the table's stats), ``open_rollouts``, ``waiting_handlers``
        (calls being served now) and ``calls`` (counters since start: ``total``,
        ``ok``, ``failed``, ``closed`` by unregister, ``disconnected`` clients)."""
        return {
            "intercepts": self.table.stats(),
            "open_rollouts": len(self.slots),
            "waiting_handlers": self.slots.waiting(),
            "calls": dict(self.calls),
        }

    def mount(self, prefix: str, app: App) -> None:
        """Route requests whose path starts with ``prefix`` to another ASGI ``app``
        (``lowwater proxy`` mounts its admin endpoints at ``/lowwater/``)."""
        self._router.mount(prefix, app)

    # -- ASGI ----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] != "http":
            return
        await self._router.dispatch(scope, receive, _shielded(send))

    def _error_body(self, scope: Scope, err: HTTPError) -> Any:
        """An error in the shape of the protocol the path names (OpenAI's elsewhere)."""
        protocol = self.routes.get(normalise(scope["path"])) or Protocol()
        return protocol.error_body(err.status, err.reason)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models``: the one model the rollout's upstream serves."""
        slot = self._authenticate(scope)
        name = slot.upstream.model or "lowwater-upstream"
        model = {
            "id": name,
            "object": "model",
            "type": "model",
            "created": 0,
            "owned_by": "lowwater",
            "display_name": name,
            "created_at": "1970-01-01T00:00:00Z",
        }
        await send_json(
            send, 200, {"object": "list", "data": [model], "has_more": False, "first_id": name, "last_id": name}
        )

    async def _call(self, protocol: Protocol, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST`` to a protocol's path: one model call of a rollout."""
        # Authenticate before reading the body: a stranger's 60 MiB is refused unread.
        slot = self._authenticate(scope)
        body = await read_body(scope, receive, self.max_body_bytes)
        if self.interceptors is None:  # checked once per call: no plugin, no hook path
            call = self._parse(scope, protocol, slot, body)
        else:
            call = await self._intercept(scope, protocol, slot, body, self.interceptors)
        self._insert(call, body)
        del body  # the table holds the agent's bytes from here on
        try:
            await self._serve(call, receive, send)
        finally:
            self.table.discard(call.request_id)

    def _authenticate(self, scope: Scope) -> Slot:
        """The slot whose secret the request carries; :class:`HTTPError` 401 otherwise."""
        found: Slot | None = None
        for secret in request_keys(scope):
            slot = self.slots.by_secret(secret)
            if slot is not None:
                if found is not None and found is not slot:
                    raise HTTPError(401, "the request carries the keys of two different rollouts")
                found = slot
        if found is None:
            raise HTTPError(401, "missing or unknown API key for this interception server")
        return found

    def _parse(self, scope: Scope, protocol: Protocol, slot: Slot, body: bytes | bytearray) -> _Call:
        """Decode and validate ``body``; :class:`HTTPError` 400 naming the problem.

        A body nesting deeper than :data:`~lowwater.http.MAX_JSON_DEPTH` is
        refused here: its turn could not be written out later.
        """
        return self._build(scope, protocol, slot, parse_json(body, max_depth=MAX_JSON_DEPTH))

    async def _intercept(
        self, scope: Scope, protocol: Protocol, slot: Slot, body: bytes | bytearray, interceptors: Interceptors
    ) -> _Call:
        """:meth:`_parse` with the ``intercept_request`` hooks run on the parsed
        body first: the body they leave is validated, forwarded and recorded
        (the turn shows what was sent upstream, not what the agent wrote)."""
        payload = parse_json(body, max_depth=MAX_JSON_DEPTH)
        if not isinstance(payload, dict):
            return self._build(scope, protocol, slot, payload)  # the protocol's 400 names it
        intercepted = InterceptedCall(slot.rollout_id, protocol.name, payload)
        await interceptors.request(intercepted)
        call = self._build(scope, protocol, slot, intercepted.body, changed=True)
        call.intercepted = intercepted
        return call

    def _build(self, scope: Scope, protocol: Protocol, slot: Slot, payload: Any, *, changed: bool = False) -> _Call:
        """The call for a parsed body; ``changed``: forward ``payload`` even
        when the protocol keeps the agent's bytes (an interceptor changed it)."""
        request = protocol.parse(payload)
        rewritten = (
            protocol.upstream_body(payload, model=slot.upstream.model, logprobs=self.request_logprobs)
            if isinstance(payload, dict)
            else None
        )
        if self.sampling and isinstance(payload, dict):
            rewritten = apply_sampling(protocol.name, rewritten or payload, self.sampling) or rewritten
        if changed and rewritten is None:
            rewritten = payload
        try:
            forward = orjson.dumps(rewritten) if rewritten is not None else None
        except orjson.JSONEncodeError as exc:  # a protocol plugin's rewrite, past what was checked
            raise HTTPError(400, f"the request cannot be re-encoded for the upstream: {exc}") from None
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _FORWARD_HEADERS}
        for name, value in headers.items():
            if not value.isascii():  # httpx sends ASCII header values only: this was a bare 500
                raise HTTPError(400, f"header {name} must be ASCII")
        call = _Call(
            f"{self._id_prefix}-{next(self._ids)}",
            protocol,
            slot,
            request.model,
            request.stream,
            request.messages,
            forward,
            headers,
        )
        if isinstance(payload, dict):
            call.tools = protocol.tools(payload)
        return call

    def _insert(self, call: _Call, body: bytes | bytearray) -> None:
        self.calls["total"] += 1
        try:
            self.table.insert(
                call.request_id, call.slot.rollout_id, body, protocol=call.protocol.name, stream=call.stream
            )
        except RolloutClosed:
            self.calls["closed"] += 1
            raise HTTPError(410, f"rollout {call.slot.rollout_id} is closed") from None
        except BufferFull:
            self.calls["failed"] += 1
            raise HTTPError(503, "the intercept table is full; retry later", headers={"retry-after": "1"}) from None

    # -- one call ---------------------------------------------------------------------

    async def _serve(self, call: _Call, receive: Receive, send: Send) -> None:
        """Forward, record, deliver; answer at once if the rollout closes or the client leaves."""
        slot = call.slot
        # Of the parsed body only the delta outlives this line (the rest is
        # the history earlier turns recorded, base64 images included).
        call.delta_start, call.delta = slot.trajectory.message_delta(call.messages)
        call.messages = []
        # An equal list an earlier turn holds replaces this call's copy (freed with the body).
        call.tools = slot.trajectory.intern_tools(call.tools)
        scope = trio.CancelScope()
        slot.handlers.add(scope)
        if slot.closed:  # unregistered while the body was read (and re-registered since)
            scope.cancel()
        failure: HTTPError | None = None
        # The watcher lives in the server's nursery, not in one per call (a
        # nursery per call cost ~5 % of the proxy's throughput); it ends when
        # hypercorn reports the stream closed, which it does for every response.
        assert self._watchers is not None, "the server is not running"
        self._watchers.start_soon(_watch_disconnect, receive, scope, call)
        try:
            with scope:
                try:
                    if call.stream:
                        await self._forward_stream(call, send)
                    else:
                        await self._forward(call, send)
                except HTTPError as err:
                    # Kept without its traceback and context: they hold this
                    # frame (a cycle) and the upstream client's frames, with a
                    # view of the intercept, until the cyclic GC ran (30 failed
                    # calls of 4 MiB left 12 MiB of live_bytes a minute later).
                    failure = err.with_traceback(None)
                    failure.__context__ = failure.__cause__ = None
        finally:
            call.done = True
            slot.handlers.discard(scope)
        if call.disconnected:
            self.calls["disconnected"] += 1
            if not call.recorded:
                self._record(call, None, "the client disconnected before the answer was complete")
        elif scope.cancelled_caught:
            self.calls["closed"] += 1
            reason = f"rollout {slot.rollout_id} was closed during the call"
            if not call.started:
                await _send_error(send, call.protocol, HTTPError(410, reason))
            elif not call.finished:
                await _break_stream(send, call.protocol, reason)
        elif failure is not None:
            self.calls["failed"] += 1
            await _send_error(send, call.protocol, failure)
        else:
            self.calls["ok" if call.error is None else "failed"] += 1

    def _body(self, call: _Call) -> Any:
        """What goes upstream: the rewritten body, or a zero-copy view of the table entry."""
        if call.forward is not None:
            return call.forward
        view = self.table.get(call.request_id)
        if view is None:  # swept by unregister in the same tick; the cancel is on its way
            raise HTTPError(410, f"rollout {call.slot.rollout_id} is closed")
        return view

    def _delivered(self, call: _Call) -> None:
        """Discard the intercept as the last bytes are handed over: by the time
        the agent holds its answer the body is gone, so an unregister right
        after it sweeps nothing (``finally`` discards on every other path)."""
        self.table.discard(call.request_id)

    def _record(self, call: _Call, done: Completion | None, error: str | None) -> None:
        """Append the call's turn to the trajectory (once)."""
        if call.recorded or call.slot.closed:
            return  # a closed rollout's trajectory is no longer ours to write
        call.recorded = True
        done = done or Completion()
        if error is not None:
            # Written to files with the turn: an error text may quote a URL with credentials.
            error = redact_url(error)
        if nests_deeper(
            [done.completion, done.finish_reason, done.usage, done.token_ids, done.logprobs], _ANSWER_DEPTH
        ):
            # An upstream answer nesting past the limit could not be written
            # with the trajectory: the turn keeps the error, not the answer.
            done = Completion()
            error = error or f"upstream answer nests deeper than {MAX_JSON_DEPTH} levels; not recorded"
        call.error = error
        trajectory = call.slot.trajectory
        trajectory.add_turn(
            Turn(
                index=len(trajectory.turns),
                protocol=call.protocol.name,
                model=call.model,
                request_delta=call.delta,
                request_delta_start=call.delta_start,
                completion=done.completion,
                finish_reason=done.finish_reason,
                usage=done.usage,
                token_ids=done.token_ids,
                logprobs=done.logprobs,
                started_s=call.wall_s,
                duration_s=time.perf_counter() - call.started_s,
                streamed=call.stream,
                error=error,
                tools=call.tools,
            )
        )

    async def _forward(self, call: _Call, send: Send) -> None:
        try:
            answer = await call.slot.upstream.post(call.protocol.path, self._body(call), call.headers)
        except httpx.HTTPError as exc:
            raise self._upstream_failed(call, exc) from None
        if answer.status >= 300:
            return await self._relay_error(call, answer, send)
        try:
            done = call.protocol.completion(orjson.loads(answer.content))
        except Exception as exc:
            self._record(call, None, f"upstream answer malformed: {type(exc).__name__}: {exc}")
            raise HTTPError(502, "the upstream's answer is not a valid response object") from None
        self._record(call, done, done.error)
        if call.intercepted is not None and self.interceptors is not None:
            await self.interceptors.response(call.intercepted, InterceptedResponse.of(done))
        # Finished as the last bytes are handed over: hypercorn reports a
        # disconnect as soon as a response ends, which is not a client leaving.
        call.started = call.finished = True
        self._delivered(call)
        await send_bytes(send, answer.status, answer.content, answer.content_type)

    async def _forward_stream(self, call: _Call, send: Send) -> None:
        protocol = call.protocol
        accumulator = protocol.accumulator()
        parser = SSEParser()
        held: list[bytes] = []  # the terminal event, and anything after it
        terminal = False
        error: str | None = None
        try:
            async with call.slot.upstream.stream(protocol.path, self._body(call), call.headers) as response:
                if response.status_code >= 300:
                    return await self._relay_error(call, await read_answer(response), send)
                await start_response(send, 200, "text/event-stream; charset=utf-8", [("cache-control", "no-cache")])
                call.started = True
                try:
                    async for chunk in response.aiter_bytes():
                        relay = []
                        for event in parser.feed(chunk):
                            if terminal:
                                held.append(event.raw)
                            elif accumulator.feed(event.event, event.data):
                                terminal = True
                                held.append(event.raw)  # held until the turn is recorded
                            else:
                                relay.append(event.raw)
                        if relay:
                            await send({"type": "http.response.body", "body": b"".join(relay), "more_body": True})
                    for event in parser.finish():
                        if not terminal and accumulator.feed(event.event, event.data):
                            terminal = True
                        held.append(event.raw)
                except httpx.TimeoutException as exc:
                    error = f"upstream stream timed out: {type(exc).__name__}"
                except httpx.HTTPError as exc:
                    error = f"upstream stream cut: {type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:
            raise self._upstream_failed(call, exc) from None
        except HTTPError:
            raise
        except Exception as exc:
            if not call.started:
                raise
            error = f"upstream sent a malformed event: {type(exc).__name__}: {exc}"
        if error is None and not terminal:
            error = "upstream stream ended before its terminal event"
        try:
            done: Completion | None = accumulator.result()
        except Exception as exc:
            done, error = None, error or f"upstream stream malformed: {type(exc).__name__}: {exc}"
        self._record(call, done, error or (done.error if done else None))
        if error is not None:
            # Not an empty success: the SDK raises on the error event, and a
            # raw client sees the chunked body end without its terminator.
            return await _break_stream(send, protocol, error)
        if call.intercepted is not None and self.interceptors is not None and done is not None:
            await self.interceptors.response(call.intercepted, InterceptedResponse.of(done))
        call.finished = True
        self._delivered(call)
        await send({"type": "http.response.body", "body": b"".join(held), "more_body": False})

    async def _relay_error(self, call: _Call, answer: Answer, send: Send) -> None:
        """Pass an upstream 4xx on as is (with ``retry-after``); a 5xx becomes 502."""
        self._record(call, None, f"upstream answered {answer.status}")
        if answer.status >= 500 or not answer.content_type.startswith("application/json"):
            excerpt = redact_url(answer.content[:200].decode("utf-8", "replace"))
            raise HTTPError(
                502 if answer.status >= 500 else answer.status, f"upstream answered {answer.status}: {excerpt}"
            )
        call.started = call.finished = True
        self._delivered(call)
        headers = [("retry-after", answer.retry_after)] if answer.retry_after else []
        await send_bytes(send, answer.status, answer.content, answer.content_type, headers)

    def _upstream_failed(self, call: _Call, exc: httpx.HTTPError) -> HTTPError:
        self._record(call, None, f"upstream: {type(exc).__name__}: {exc}")
        if isinstance(exc, httpx.TimeoutException):
            return HTTPError(504, f"upstream timed out: {type(exc).__name__}")
        return HTTPError(502, f"upstream unreachable: {type(exc).__name__}")


class _Call:
    """One call's state, shared by the handler, the disconnect watcher and the recorder."""

    __slots__ = (
        "request_id",
        "protocol",
        "slot",
        "model",
        "stream",
        "messages",
        "forward",
        "headers",
        "delta",
        "delta_start",
        "tools",
        "started_s",
        "wall_s",
        "started",
        "finished",
        "done",
        "disconnected",
        "recorded",
        "error",
        "intercepted",
    )

    def __init__(
        self,
        request_id: str,
        protocol: Protocol,
        slot: Slot,
        model: str,
        stream: bool,
        messages: list[Any],
        forward: bytes | None,
        headers: dict[str, str],
    ) -> None:
        self.request_id = request_id
        self.protocol = protocol
        self.slot = slot
        self.model = model
        self.stream = stream
        self.messages = messages
        self.forward = forward
        self.headers = headers
        self.delta: list[Any] = []
        self.delta_start = 0
        self.tools: list[Any] | None = None
        self.started_s = time.perf_counter()
        self.wall_s = time.time()
        self.started = False  # response headers sent
        self.finished = False  # response complete
        self.done = False  # the handler is past its call
        self.disconnected = False
        self.recorded = False
        self.error: str | None = None
        self.intercepted: InterceptedCall | None = None


def _shielded(send: Send) -> Send:
    """``send`` run to completion under a shield, bounded by :data:`SEND_TIMEOUT_S`.

    A pending cancel is delivered at the handler's next checkpoint, i.e. on
    a message boundary, where hypercorn's connection state stays consistent.
    """

    async def shielded_send(message: dict[str, Any]) -> None:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + SEND_TIMEOUT_S):
            await send(message)

    return shielded_send


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, call: _Call) -> None:
    """Cancel the call when the client goes away; closing the upstream response stops the generation."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not (call.finished or call.done):
        call.disconnected = True
        scope.cancel()


async def _send_error(send: Send, protocol: Protocol, err: HTTPError) -> None:
    """``err`` as a JSON error body in the protocol's shape."""
    await send_error(send, err, protocol.error_body(err.status, err.reason))


async def _break_stream(send: Send, protocol: Protocol, reason: str) -> None:
    """Send an error event and return without ending the body: hypercorn then
    closes the connection mid-chunked-body, which every HTTP client reports."""
    await send({"type": "http.response.body", "body": protocol.error_event(reason), "more_body": True})
