"""Responses: the status line and headers, whole bytes or JSON bodies, and an
:class:`~lowwater.http.asgi.HTTPError` as its answer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from lowwater.http.asgi import HTTPError, Send


async def start_response(
    send: Send,
    status: int,
    content_type: str,
    headers: Iterable[tuple[str, str]] = (),
    *,
    content_length: int | None = None,
) -> None:
    """Send a response's status and headers; the body follows in ``http.response.body`` messages.

    Without ``content_length`` the body is sent chunked (a stream).  Header
    names and values are encoded as latin-1, HTTP's own charset.
    """
    raw = [(b"content-type", content_type.encode("latin-1"))]
    if content_length is not None:
        raw.append((b"content-length", str(content_length).encode()))
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})


async def send_bytes(
    send: Send,
    status: int,
    body: bytes | bytearray | memoryview,
    content_type: str,
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    """Send a complete response of ``body`` with its ``content-type`` and ``content-length``."""
    size = body.nbytes if isinstance(body, memoryview) else len(body)
    await start_response(send, status, content_type, headers, content_length=size)
    # A memoryview goes through as is: hypercorn's h11 writer accepts any
    # bytes-like body, which saves a full copy of a large shard on the loop.
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, payload: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
    """Send ``payload`` serialised by orjson as ``application/json``."""
    await send_bytes(send, status, orjson.dumps(payload), "application/json", headers)


def error_payload(err: HTTPError) -> dict[str, Any]:
    """The default error body: ``{"error": reason, **extra}``."""
    return {"error": err.reason, **err.extra}


async def send_error(send: Send, err: HTTPError, payload: Any = None) -> None:
    """Answer ``err``: its status and headers, and ``payload`` as JSON (default :func:`error_payload`)."""
    await send_json(send, err.status, error_payload(err) if payload is None else payload, err.headers.items())
