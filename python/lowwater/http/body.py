"""Request bodies: the one bounded reader every lowwater server uses, and JSON decoding."""

from __future__ import annotations

from typing import Any

import orjson
import trio

from lowwater.http.asgi import HTTPError, Receive, Scope

# After a 413, the rest of the body is read and thrown away (up to this long,
# seconds) so the client, still writing, reads the 413 instead of a
# connection reset.
DRAIN_S = 5.0
#: The deepest nesting of arrays and objects a server that keeps what it
#: parses accepts (``parse_json(..., max_depth=MAX_JSON_DEPTH)``).  orjson
#: parses 1,024 levels but writes at most 254: a request nesting 255 levels
#: was accepted, then its trajectory line, session export and stale dump all
#: failed.  128 leaves room for the levels a trajectory line, an export or a
#: dump wraps around a request's messages.
MAX_JSON_DEPTH = 128


async def read_body(scope: Scope, receive: Receive, limit_bytes: int) -> bytes | bytearray:
    """The whole request body (``bytes``, or a ``bytearray`` when it had a ``content-length``).

    With a ``content-length`` the chunks are copied into one buffer of that
    size as they arrive, each freed at once: a 9 MB body (45 turns of
    history with an image each) is then held once while it is read, not as
    a list of 64 KiB chunks plus their join, which also scattered the chunks
    over the heap (the churn bench's peak).  A declared length over the
    limit is refused before anything is allocated.

    Raises:
        HTTPError: 413 past ``limit_bytes`` (declared or read; the rest of
            the body is drained first, so the client reads the answer), 400
            if the client left mid-body or sent less than its
            ``content-length``.
    """
    expected = content_length(scope)
    if expected is not None and expected > limit_bytes:
        await _drain(receive)
        raise _too_large(limit_bytes)
    buffer = bytearray(expected) if expected else None
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected before the body was complete")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        end = size + len(chunk)
        if end > limit_bytes or (buffer is not None and end > len(buffer)):
            chunks.clear()
            buffer = None
            if more:
                await _drain(receive)
            raise _too_large(limit_bytes)
        if buffer is not None:
            buffer[size:end] = chunk
        else:
            chunks.append(chunk)
        size = end
        del chunk, message
    if buffer is not None:
        if size != len(buffer):
            raise HTTPError(400, f"body shorter than its content-length ({size} of {len(buffer)} bytes)")
        return buffer
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def content_length(scope: Scope) -> int | None:
    """The request's ``content-length`` in bytes, or ``None`` (absent or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses it before the app sees it; be safe anyway
    return None


def parse_json(body: bytes | bytearray, *, max_depth: int | None = None) -> Any:
    """Decode a JSON body; :class:`HTTPError` 400 naming the problem.

    Args:
        body: the request body.
        max_depth: refuse a document whose arrays and objects nest deeper
            than this (levels; ``None``: orjson's own limit of 1,024).

    Raises:
        HTTPError: 400 for malformed JSON or nesting past ``max_depth``.
    """
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"malformed JSON: {exc}") from None
    if max_depth is not None and nests_deeper(value, max_depth):
        raise HTTPError(400, f"JSON nests deeper than {max_depth} levels of arrays and objects")
    return value


def nests_deeper(value: Any, limit: int) -> bool:
    """True if ``value``'s dicts, lists and tuples nest more than ``limit`` levels
    (a scalar is 0 levels, ``[]`` one, ``[[1]]`` two).  Iterative: no recursion
    limit, and it stops at the first container past ``limit``."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return False


def id_list(payload: Any, key: str = "ids") -> list[str]:
    """``payload[key]`` as a list of str; :class:`HTTPError` 400 otherwise."""
    ids = payload.get(key) if isinstance(payload, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise HTTPError(400, f'body must be a JSON object with "{key}": a list of strings')
    return ids


def _too_large(limit_bytes: int) -> HTTPError:
    return HTTPError(413, f"body over the limit of {limit_bytes} bytes")


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a refused body (up to :data:`DRAIN_S`)."""
    with trio.move_on_after(DRAIN_S):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
