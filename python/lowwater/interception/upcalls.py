"""Serving the data plane's upcalls in the Trio control plane.

The Rust data plane (:class:`lowwater._native.DataPlane`) hands two kinds of
request to Python and waits for the answer (docs/dataplane.md, "Upcalls"):

* ``"intercept"``: a model call, validated, before forwarding (the plane's
  ``intercept`` option).  :func:`serve_upcalls` awaits ``intercept(upcall)``:
  it returns the body to forward (``None``: the agent's bytes unchanged) or
  raises :class:`~lowwater.interception.hooks.Reject` (the agent gets its
  status in the protocol's error body).  :func:`run_interceptors` adapts the
  plugins' ``intercept_request`` hooks to that callback.
* ``"route"``: a request to one of the plane's ``python_routes`` (``lowwater
  proxy``'s ``/lowwater/`` endpoints, :meth:`InterceptionServer.mount`'s
  apps).  :func:`serve_upcalls` runs the ASGI ``app`` on a scope built from
  the upcall and relays its whole response (not streamed: these endpoints
  answer small JSON bodies).

Each upcall is served in its own Trio task, so a slow hook delays only its
own call.  The common path never enters this module: a plane with neither
option set makes no upcall.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import orjson
import trio

from lowwater._native import DataPlane, DataPlaneClosed, Upcall
from lowwater.http import App, HTTPError
from lowwater.interception.hooks import InterceptedCall, Interceptors, Reject

log = logging.getLogger("lowwater.interception")

__all__ = ["Intercept", "header_map", "run_interceptors", "serve_upcall", "serve_upcalls"]

#: The intercept callback: the body to forward (``None``: unchanged), or
#: :class:`Reject` raised.
Intercept = Callable[[Upcall], Awaitable[bytes | None]]


async def serve_upcalls(plane: DataPlane, *, app: App | None = None, intercept: Intercept | None = None) -> None:
    """Answer ``plane``'s upcalls until cancelled (or the plane is found closed).

    Waits with :func:`trio.lowlevel.wait_readable` on the plane's upcall fd
    and serves each drained upcall in its own task (:func:`serve_upcall`);
    ``drain_upcalls`` and the answers take a lock for a moment and never
    wait, so the Trio loop is never blocked.  Cancelling this cancels the
    upcalls being served, each answered 503 on the way out (an upcall left
    unanswered would hold its call until its client leaves).  Cancel it
    before :meth:`DataPlane.close`, which closes the fd.

    Args:
        plane: a started data plane.
        app: the ASGI app serving route upcalls (``None``: each is a 404).
        intercept: the callback of intercept upcalls (``None``: each call
            is forwarded unchanged).
    """
    try:
        fd = plane.upcall_fd()
    except DataPlaneClosed:
        return
    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                upcalls = plane.drain_upcalls()
            except DataPlaneClosed:
                nursery.cancel_scope.cancel()
                return
            for upcall in upcalls:
                nursery.start_soon(serve_upcall, plane, upcall, app, intercept)


async def serve_upcall(plane: DataPlane, upcall: Upcall, app: App | None, intercept: Intercept | None) -> None:
    """Serve one upcall and answer it (exactly once, whatever happens).

    An intercept callback's :class:`Reject` or :class:`~lowwater.http.HTTPError`
    is the call's status and message; any other exception, or an answer that
    is neither bytes nor ``None``, is logged and is a 500 naming it.  An ASGI
    app that raises before its response starts is a 500; one that raises
    after is answered with what it had sent; a response the plane cannot
    send (a 1xx status, a header that is not HTTP) is a 500.
    """
    answered = False
    try:
        if upcall.kind == "intercept":
            outcome = await _run_intercept(upcall, intercept)
            try:
                _intercept_answer(plane, upcall, outcome)
            except (TypeError, ValueError, OverflowError) as exc:  # not bytes, or a status out of range
                log.exception("the intercept callback's answer is unusable")
                _answer(plane.reject, upcall.id, 500, f"interceptor answered unusably: {exc}")
        else:
            status, headers, body = await _run_app(plane, upcall, app)
            try:
                _answer(plane.respond, upcall.id, status, headers, body)
            except (TypeError, ValueError, OverflowError) as exc:  # a 1xx, a header that is not HTTP
                log.exception("the app's response to %s %s is unusable", upcall.method, upcall.path)
                error = orjson.dumps({"error": f"unusable response: {exc}"})
                _answer(plane.respond, upcall.id, 500, [(b"content-type", b"application/json")], error)
        answered = True
    finally:
        if not answered:  # cancelled (the control plane stops) or a bug above
            if upcall.kind == "intercept":
                _answer(plane.reject, upcall.id, 503, "the control plane stopped")
            else:
                _answer(plane.respond, upcall.id, 503, [(b"content-type", b"application/json")], _ERROR_503)


_ERROR_503 = orjson.dumps({"error": "the control plane stopped"})


def _answer(method: Callable[..., bool], *args: Any) -> None:
    try:
        method(*args)
    except DataPlaneClosed:
        pass  # the plane answered every waiting upcall 503 as it closed


async def _run_intercept(upcall: Upcall, intercept: Intercept | None) -> bytes | None | HTTPError:
    if intercept is None:
        return None
    try:
        return await intercept(upcall)
    except Reject as reject:
        return HTTPError(reject.status, reject.message)
    except HTTPError as err:
        return err
    except Exception as exc:
        log.exception("the intercept callback failed on a call of rollout %r", upcall.rollout_id)
        return HTTPError(500, f"interceptor failed: {type(exc).__name__}: {exc}")


def _intercept_answer(plane: DataPlane, upcall: Upcall, outcome: bytes | None | HTTPError) -> None:
    if isinstance(outcome, HTTPError):
        status = outcome.status if 400 <= outcome.status <= 599 else 500
        _answer(plane.reject, upcall.id, status, outcome.reason)
    else:
        _answer(plane.resume, upcall.id, outcome)


async def _run_app(plane: DataPlane, upcall: Upcall, app: App | None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Run ``app`` on the upcall's request; its whole response."""
    if app is None:
        return 404, [(b"content-type", b"application/json")], orjson.dumps({"error": f"no route {upcall.path}"})
    path, _, query = upcall.path.partition("?")
    host, _, port = plane.address.rpartition(":")
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": upcall.method,
        "scheme": "http",
        "path": urllib.parse.unquote(path),
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": upcall.headers,
        "client": None,
        "server": (host.strip("[]"), int(port)),
    }
    done = trio.Event()
    received = False
    start: dict[str, Any] | None = None
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": upcall.body, "more_body": False}
        await done.wait()  # as a server does: the client "leaves" once answered
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                done.set()

    try:
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                await app(scope, receive, send)
                done.set()

            nursery.start_soon(run)
            await done.wait()
            nursery.cancel_scope.cancel()  # e.g. a disconnect watcher still waiting
    except Exception:
        log.exception("the app serving %s %s failed", upcall.method, path)
        if start is None:
            return 500, [(b"content-type", b"application/json")], orjson.dumps({"error": "internal error"})
    if start is None:
        return 500, [(b"content-type", b"application/json")], orjson.dumps({"error": "the app sent no response"})
    headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
    return int(start["status"]), headers, b"".join(chunks)


def header_map(pairs: Sequence[tuple[bytes, bytes]]) -> Mapping[str, str]:
    """A read-only ``{name: value}`` of ``(name, value)`` byte pairs: names
    as sent (the plane lower-cases them), values decoded as Latin-1 (HTTP's
    historical charset: never fails), a repeated name's values joined with
    ``", "`` in order (RFC 9110 section 5.3)."""
    out: dict[str, str] = {}
    for name, value in pairs:
        k, v = name.decode("latin-1"), value.decode("latin-1")
        out[k] = f"{out[k]}, {v}" if k in out else v
    return MappingProxyType(out)


def run_interceptors(interceptors: Interceptors) -> Intercept:
    """The intercept callback running the plugins' ``intercept_request`` hooks
    (:meth:`Interceptors.request`) on the call's parsed body: the body they
    leave is forwarded (and recorded), a :class:`Reject` refuses the call.
    ``intercept_response`` is not run through the data plane yet.
    """

    async def intercept(upcall: Upcall) -> bytes | None:
        payload = orjson.loads(upcall.body)
        if not isinstance(payload, dict):
            return None  # the plane validated it: a protocol without a body object
        call = InterceptedCall(
            upcall.rollout_id or "", upcall.protocol or "", payload, headers=header_map(upcall.headers)
        )
        await interceptors.request(call)
        return orjson.dumps(call.body)

    return intercept
