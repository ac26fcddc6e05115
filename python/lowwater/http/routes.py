"""Dispatch: the lifespan answer, and a route table (method + path pattern -> ASGI handler).

A :class:`Router` answers unknown paths (404) and wrong methods (405, with
``allow``) itself, and turns an :class:`~lowwater.http.asgi.HTTPError` a
handler raises into its response, so no server repeats that logic.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from lowwater.http.asgi import App, HTTPError, Receive, Scope, Send
from lowwater.http.responses import error_payload, send_error

#: ``error_body(scope, err)``: the JSON body answering ``err`` for this request.
ErrorBody = Callable[[Scope, HTTPError], Any]

ANY_METHOD = "*"
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:path)?\}")


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the ASGI lifespan protocol (nothing to set up)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def handle(scope: Scope, receive: Receive, send: Send, route: App) -> None:
    """Run ``route`` for an HTTP request; answer lifespan; turn :class:`HTTPError` into its response."""
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    if scope["type"] != "http":
        return
    try:
        await route(scope, receive, send)
    except HTTPError as err:
        await send_error(send, err)


def normalise(path: str) -> str:
    """``path`` without its trailing slashes (``"/"`` stays)."""
    return path.rstrip("/") or "/"


def _compile(pattern: str) -> re.Pattern[str]:
    """``/shards/{shard_id:path}`` as a regex: ``{name}`` is one non-empty segment, ``{name:path}`` the rest."""
    out, last = [], 0
    for m in _PARAM.finditer(pattern):
        if m.group(2) and m.end() != len(pattern):
            raise ValueError(f"{pattern!r}: a {{name:path}} parameter must end the pattern")
        out.append(re.escape(pattern[last : m.start()]))
        out.append(f"(?P<{m.group(1)}>{'.+' if m.group(2) else '[^/]+'})")
        last = m.end()
    out.append(re.escape(pattern[last:]))
    return re.compile("".join(out))


class Router:
    """A route table: ``(method, pattern) -> handler``, first match wins.

    Handlers are ASGI callables; the pattern's parameters are in
    ``scope["path_params"]`` (as decoded by the server: ASGI paths are
    already percent-decoded, so they are never decoded twice).  Paths match
    without their trailing slash.  A path no route matches is a 404; a path
    some route matches but not with this method is a 405 whose ``allow``
    header lists the methods that would do.  Mounts (:meth:`mount`) are
    tried before routes.

    Args:
        error_body: the JSON body answering an :class:`HTTPError` (404, 405
            and those raised by handlers); default ``{"error": reason, **extra}``.

    Raises:
        ValueError: (from :meth:`add`) a ``{name:path}`` parameter not at the end.
    """

    def __init__(self, *, error_body: ErrorBody | None = None) -> None:
        self._routes: list[tuple[str, re.Pattern[str], App]] = []
        self._mounts: list[tuple[str, App]] = []
        self._error_body = error_body or (lambda _scope, err: error_payload(err))

    def add(self, method: str, pattern: str, handler: App) -> None:
        """Route ``method`` (``"*"``: any) requests whose whole path matches ``pattern`` to ``handler``."""
        self._routes.append((method.upper(), _compile(normalise(pattern)), handler))

    def mount(self, prefix: str, app: App) -> None:
        """Hand every request under ``prefix`` (the prefix itself included) to ``app``, any method."""
        self._mounts.append((normalise(prefix), app))

    def resolve(self, method: str, path: str) -> tuple[App, dict[str, str]]:
        """The handler for ``method path`` and its path parameters.

        Raises:
            HTTPError: 404 (no route has this path) or 405 (none takes this method).
        """
        path = normalise(path)
        for prefix, app in self._mounts:
            if path == prefix or path.startswith(prefix + "/"):
                return app, {}
        allowed: list[str] = []
        for route_method, regex, handler in self._routes:
            m = regex.fullmatch(path)
            if m is None:
                continue
            if route_method in (ANY_METHOD, method):
                return handler, m.groupdict()
            if route_method not in allowed:
                allowed.append(route_method)
        if not allowed:
            raise HTTPError(404, f"no endpoint {method} {path}")
        raise HTTPError(
            405, f"{path} takes {' or '.join(allowed)}, not {method}", headers={"allow": ", ".join(allowed)}
        )

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP request: resolve it, run the handler, answer an :class:`HTTPError`.

        A response started before the request's body was read to its end
        (a 401 before a 60 MiB body is read, a 404, a handler that takes
        no body) says ``connection: close``: the server drops such a
        connection after the response, and a client that was not told
        reused it and got "disconnected without sending a response".
        """
        if _has_body(scope) and "lowwater.body_watch" not in scope:
            watch = _BodyWatch(receive, send)
            scope["lowwater.body_watch"] = watch
            receive, send = watch.receive, watch.send
        try:
            handler, params = self.resolve(scope["method"], scope["path"])
            scope["path_params"] = params
            await handler(scope, receive, send)
        except HTTPError as err:
            await send_error(send, err, self._error_body(scope, err))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app: lifespan answered, HTTP dispatched, other scopes ignored."""
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] == "http":
            await self.dispatch(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    """Whether the request declares a body (a non-zero ``content-length``, or chunked)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


class _BodyWatch:
    """``receive``/``send`` that note when the body has been read and add ``connection: close``
    to a response started before that."""

    __slots__ = ("_receive", "_send", "done")

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.done = False

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self.done = True
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if not self.done and message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            self.done = True
        await self._send(message)
