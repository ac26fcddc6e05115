"""The ASGI callables' types and :class:`HTTPError`, the one exception that picks an HTTP status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class HTTPError(Exception):
    """An error answered with ``status``.

    The body is JSON: ``{"error": reason, **extra}`` unless the app gives
    its own error shape (the interception server and ``serve-model`` answer
    in each protocol's shape).  ``headers`` are added to the response
    (``retry-after`` on a 503, ``allow`` on a 405).

    Attributes:
        status: the HTTP status code.
        reason: a sentence saying what was wrong.
        headers: response header name (lower case) -> value.
        extra: further fields of the default JSON body (e.g. ``missing``).
    """

    def __init__(self, status: int, reason: str, *, headers: Mapping[str, str] | None = None, **extra: Any) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = dict(headers or {})
        self.extra = extra
