"""The one length-prefixed framing lowwater uses on its byte streams.

Format: a frame is a 4-byte unsigned **little-endian** payload length
(``struct`` format ``"<I"``), then exactly that many payload bytes.  Payloads
are opaque here (JSON in practice); a length may be 0.  One byte order
everywhere: there used to be three framings, one of them big-endian, and a
peer built against the wrong one reads a length off by a factor of 2**24.

Users:

* :mod:`lowwater.workers.protocol`: pool <-> worker messages (orjson objects).
* :mod:`lowwater.runtime.warm` <-> ``runtime/_warm_worker.py``: warm-worker
  calls over the child's stdin/stdout.  The child runs as a stdlib-only
  script in any Python (possibly in a sandbox) and cannot import this
  module, so it keeps its own two-line copy of the format;
  ``tests/runtime/test_warm.py`` checks that the copy and this codec agree.
* :mod:`lowwater.trainer.shards`: the header of a batch response (the shard
  payloads that follow it are not framed; their sizes are in the header).

Reading from a stream: :func:`receive_frame` takes the next payload off a
Trio receive stream through a :class:`FrameDecoder`, and
:func:`receive_object` decodes it as a JSON object (the pool's and the warm
workers' messages), so both readers end, bound and decode a stream the same way.

Limits: every reader and writer bounds the payload at ``max_frame`` bytes
(default :data:`MAX_FRAME_BYTES`, 64 MiB; at most :data:`MAX_LENGTH`, what 4
bytes can say).  A reader checks the length as soon as the 4 header bytes
are in, before buffering the payload, so a corrupt or hostile length costs
nothing.  Every violation raises :class:`FrameError`.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # pragma: no cover
    import trio

#: The length prefix: 4-byte unsigned, little-endian.
HEADER = struct.Struct("<I")
#: Bytes of the length prefix.
HEADER_SIZE = HEADER.size
#: Default bound on a payload (bytes): rows and messages are summaries, not data.
MAX_FRAME_BYTES = 64 << 20
#: The largest length the prefix can carry (bytes).
MAX_LENGTH = (1 << 32) - 1


class FrameError(ValueError):
    """A payload over its ``max_frame`` bound, or a stream that ended inside a frame."""


def _bound(max_frame: int) -> int:
    if not 0 <= max_frame <= MAX_LENGTH:
        raise ValueError(f"max_frame must be in [0, {MAX_LENGTH}], not {max_frame}")
    return max_frame


def encode_frame(payload: bytes | bytearray | memoryview, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: the length prefix, then ``payload`` (copied once).

    Raises:
        FrameError: ``payload`` is longer than ``max_frame`` bytes.
        ValueError: ``max_frame`` is outside ``[0, MAX_LENGTH]``.
    """
    size = len(payload)
    if size > _bound(max_frame):
        raise FrameError(f"frame of {size} bytes exceeds the {max_frame}-byte limit")
    return HEADER.pack(size) + payload


class FrameDecoder:
    """Incremental parser: feed bytes as they arrive, take whole payloads out.

    Holds only the bytes not yet taken (at most one partial frame once the
    complete ones are taken).  Not thread-safe; one reader per stream.

    Args:
        max_frame: bound on a payload (bytes); :meth:`next_frame` can
            override it per frame.

    Raises:
        ValueError: ``max_frame`` is outside ``[0, MAX_LENGTH]``.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.max_frame = _bound(max_frame)
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet taken."""
        return len(self._buf)

    @property
    def missing(self) -> int:
        """Bytes still needed to complete the next frame (at least 1 if none
        is complete; ``0`` if one is): a hint for the size of the next read."""
        if len(self._buf) < HEADER_SIZE:
            return HEADER_SIZE - len(self._buf)
        (size,) = HEADER.unpack_from(self._buf)
        return max(0, HEADER_SIZE + size - len(self._buf))

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` (any length, any cut) to the buffer."""
        self._buf += data

    def next_frame(self, max_frame: int | None = None) -> bytearray | None:
        """The next complete payload (the caller owns it), or ``None`` if it
        has not fully arrived yet.

        Args:
            max_frame: this frame's bound (bytes); ``None``: the decoder's.

        Raises:
            FrameError: the announced length exceeds the bound (raised as
                soon as the prefix is in; the decoder is then unusable).
        """
        limit = self.max_frame if max_frame is None else _bound(max_frame)
        buf = self._buf
        if len(buf) < HEADER_SIZE:
            return None
        (size,) = HEADER.unpack_from(buf)
        if size > limit:
            raise FrameError(f"incoming frame of {size} bytes exceeds the {limit}-byte limit")
        end = HEADER_SIZE + size
        if len(buf) < end:
            return None
        if len(buf) == end:
            # The common case (one frame per read, or a large frame that
            # arrived in pieces): hand the buffer over instead of copying it.
            self._buf = bytearray()
            del buf[:HEADER_SIZE]
            return buf
        payload = buf[HEADER_SIZE:end]
        del buf[:end]
        return payload

    def take_buffered(self) -> bytearray:
        """Every byte fed and not yet taken, as is (for a stream whose frames
        are followed by unframed data); the decoder is left empty."""
        rest, self._buf = self._buf, bytearray()
        return rest

    def clear(self) -> None:
        """Drop every buffered byte (the stream is being discarded)."""
        self._buf = bytearray()

    def close(self) -> None:
        """Check the stream ended between frames.

        Raises:
            FrameError: bytes are still buffered (an unfinished frame, or
                complete ones never taken).
        """
        if self._buf:
            raise FrameError(f"stream ended inside a frame ({len(self._buf)} bytes pending)")


#: Bytes asked of the stream per read at least (more when the frame being read is larger).
READ_BYTES = 1 << 16


async def receive_frame(
    stream: trio.abc.ReceiveStream, decoder: FrameDecoder, max_frame: int | None = None
) -> bytearray | None:
    """The next payload read from ``stream`` through ``decoder`` (which keeps
    the bytes of later frames), or ``None`` when the stream ended between frames.

    Args:
        max_frame: this frame's bound (bytes); ``None``: the decoder's.

    Raises:
        FrameError: the frame exceeds the bound, or the stream ended inside one.
        trio.BrokenResourceError, trio.ClosedResourceError: from the stream.
    """
    while (payload := decoder.next_frame(max_frame)) is None:
        data = await stream.receive_some(max(READ_BYTES, decoder.missing))
        if not data:
            decoder.close()
            return None
        decoder.feed(data)
    return payload


async def receive_object(
    stream: trio.abc.ReceiveStream, decoder: FrameDecoder, max_frame: int | None = None
) -> dict[str, Any] | None:
    """:func:`receive_frame`, its payload decoded as a JSON object (``None``
    when the stream ended between frames).

    Raises:
        FrameError: as :func:`receive_frame`, or a payload that is not JSON
            or not a JSON object.
    """
    payload = await receive_frame(stream, decoder, max_frame)
    if payload is None:
        return None
    try:
        message = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"malformed payload: {exc}") from None
    if not isinstance(message, dict):
        raise FrameError("payload is not a JSON object")
    return message
