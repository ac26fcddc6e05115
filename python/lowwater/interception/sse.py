"""Server-sent events: incremental parsing of an upstream stream, and encoding.

The proxy relays exactly the bytes the upstream sent (after line-ending
normalisation), so each parsed :class:`Event` keeps its ``raw`` bytes beside
its ``event`` name and ``data`` text; the protocol reads the latter to build
the turn and to spot the terminal event.  Framing follows the WHATWG SSE
specification: events end at a blank line, lines end in ``\\n``, ``\\r\\n`` or
``\\r``, ``data:`` lines of one event are joined with ``\\n``, and lines
starting with ``:`` are comments (keep-alives).
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson


@attrs.frozen
class Event:
    """One SSE event.

    Attributes:
        raw: the event's bytes including its terminating blank line, with
            line endings normalised to ``\\n``.
        event: the ``event:`` field, or ``None``.
        data: the ``data:`` lines joined with ``\\n`` (``""`` if none).
    """

    raw: bytes
    event: str | None
    data: str


class SSEParser:
    """Feed bytes as they arrive; get the complete events back, in order.

    Comment-only blocks (keep-alives) are dropped.  Whatever is left in
    :attr:`pending` when the upstream closes is an incomplete event: the
    stream was cut.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        # Where the next search for a blank line starts, so a large event
        # arriving in many small chunks is scanned once, not once per chunk.
        self._scan = 0
        self._held_cr = False

    def feed(self, chunk: bytes) -> list[Event]:
        """Add ``chunk``; return the events it completed."""
        if self._held_cr:
            chunk = b"\r" + chunk
            self._held_cr = False
        if chunk.endswith(b"\r"):
            # A "\r\n" may straddle two chunks: decide on the next feed.
            chunk, self._held_cr = chunk[:-1], True
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        self._buffer += chunk
        events: list[Event] = []
        start = 0
        while True:
            end = self._buffer.find(b"\n\n", max(start, self._scan - 1))
            if end < 0:
                break
            raw = bytes(self._buffer[start : end + 2])
            start = end + 2
            self._scan = start
            event = _parse(raw)
            if event is not None:
                events.append(event)
        if start:
            del self._buffer[:start]
            self._scan = 0
        self._scan = max(self._scan, len(self._buffer))
        return events

    def finish(self) -> list[Event]:
        """The stream ended: complete an event whose last line end was a held ``\\r``."""
        if not self._held_cr:
            return []
        self._held_cr = False
        return self.feed(b"\n")

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (non-empty at the end: the stream was cut)."""
        return bytes(self._buffer) + (b"\r" if self._held_cr else b"")


def _parse(raw: bytes) -> Event | None:
    name: str | None = None
    data: list[str] = []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if not line or line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    if name is None and not data:
        return None
    return Event(raw, name, "\n".join(data))


def encode(data: Any, event: str | None = None) -> bytes:
    """One SSE event: ``data`` (a str, or JSON-encoded) under an optional ``event`` name."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    body = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return head + b"data: " + body + b"\n\n"
