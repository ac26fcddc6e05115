"""Framing between the pool (parent) and a worker (child).

One message is a 4-byte little-endian payload length followed by an orjson
payload (a JSON object).  Both ends wrap their end of a Unix socket pair in
:class:`trio.lowlevel.FdStream`, so reads and writes never block the loop.

Messages are small and few: the parent sends task *ids* (never payloads,
docs/design.md#incidents: the 30-worker evaluation incident kept copies of run
data per result); the child sends result rows once per task and a
heartbeat on a fixed cadence.  See ``docs/workers.md`` for every message.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson
import trio

HEADER = struct.Struct("<I")

#: Largest accepted payload (bytes).  A result row set larger than this is a
#: bug in a job (rows are summaries, not trajectories); it is refused with
#: :class:`ProtocolError` rather than buffered.
MAX_FRAME_BYTES = 64 << 20

_DUMPS_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


class ProtocolError(Exception):
    """A malformed, oversized or truncated frame."""


def encode(message: dict[str, Any], max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame for ``message``.

    Raises:
        TypeError: ``message`` is not JSON-serialisable (``orjson.JSONEncodeError``).
        ProtocolError: the payload exceeds ``max_frame`` bytes.
    """
    payload = orjson.dumps(message, option=_DUMPS_OPTIONS)
    if len(payload) > max_frame:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {max_frame}-byte limit")
    return HEADER.pack(len(payload)) + payload


class FramedStream:
    """Length-prefixed JSON messages over a Trio stream.

    One task may send while another receives; concurrent senders are
    serialised by a lock (a frame is never interleaved with another).

    Args:
        stream: usually ``trio.lowlevel.FdStream(fd)``; closed by :meth:`aclose`.
        max_frame: largest accepted payload in bytes, both directions.
    """

    def __init__(self, stream: trio.abc.Stream, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self._buf = bytearray()
        self._send_lock = trio.Lock()

    @classmethod
    def from_fd(cls, fd: int, max_frame: int = MAX_FRAME_BYTES) -> FramedStream:
        """Take ownership of ``fd`` (set non-blocking; closed with the stream)."""
        return cls(trio.lowlevel.FdStream(fd), max_frame)

    async def send(self, message: dict[str, Any]) -> None:
        """Send one message.

        Raises:
            TypeError, ProtocolError: see :func:`encode`.
            trio.BrokenResourceError: the peer has gone.
            trio.ClosedResourceError: this end was closed.
        """
        await self.send_frame(encode(message, self.max_frame))

    async def send_frame(self, frame: bytes) -> None:
        """Send a frame made by :func:`encode` (same errors as :meth:`send`)."""
        async with self._send_lock:
            await self.stream.send_all(frame)

    async def receive(self) -> dict[str, Any] | None:
        """The next message, or ``None`` at a clean end of stream.

        Raises:
            ProtocolError: the stream ended inside a frame, a frame is too
                large, or a payload is not a JSON object.
            trio.BrokenResourceError: the connection was reset.
        """
        while True:
            if len(self._buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buf)
                if size > self.max_frame:
                    raise ProtocolError(f"incoming frame of {size} bytes exceeds the {self.max_frame}-byte limit")
                end = HEADER.size + size
                if len(self._buf) >= end:
                    try:
                        with memoryview(self._buf) as view:
                            message = orjson.loads(view[HEADER.size : end])
                    except orjson.JSONDecodeError as exc:
                        raise ProtocolError(f"malformed payload: {exc}") from None
                    del self._buf[:end]
                    if not isinstance(message, dict):
                        raise ProtocolError("payload is not a JSON object")
                    return message
            chunk = await self.stream.receive_some(1 << 16)
            if not chunk:
                if self._buf:
                    raise ProtocolError(f"stream ended inside a frame ({len(self._buf)} bytes pending)")
                return None
            self._buf += chunk

    async def aclose(self) -> None:
        await self.stream.aclose()
