"""Framing between the pool (parent) and a worker (child).

One message is one frame of :mod:`lowwater.framing` (a 4-byte
little-endian payload length, then the payload) whose payload is an orjson
JSON object.  Both ends wrap their end of a Unix socket pair in
:class:`trio.lowlevel.FdStream`, so reads and writes never block the loop.

Messages are small and few: the parent sends task *ids* (never payloads,
docs/design.md#incidents: the 30-worker evaluation incident kept copies of run
data per result); the child sends result rows once per task and a
heartbeat on a fixed cadence.  See ``docs/workers.md`` for every message.
"""

from __future__ import annotations

from typing import Any

import orjson
import trio

# MAX_FRAME_BYTES (64 MiB) is the largest accepted payload.  A result row set
# larger than this is a bug in a job (rows are summaries, not trajectories);
# it is refused with ProtocolError rather than buffered.
from lowwater.framing import HEADER, MAX_FRAME_BYTES, FrameDecoder, FrameError, encode_frame, receive_object

__all__ = ["HEADER", "MAX_FRAME_BYTES", "FramedStream", "ProtocolError", "encode"]

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
    try:
        return encode_frame(payload, max_frame)
    except FrameError as exc:
        raise ProtocolError(str(exc)) from None


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
        self._frames = FrameDecoder(max_frame)
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
        try:
            return await receive_object(self.stream, self._frames)
        except FrameError as exc:
            raise ProtocolError(str(exc)) from None

    async def aclose(self) -> None:
        await self.stream.aclose()
