"""lowwater.framing: the one length-prefixed codec (workers, warm workers, shard batches)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from lowwater.framing import (
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    MAX_LENGTH,
    FrameDecoder,
    FrameError,
    encode_frame,
)


def test_the_prefix_is_four_bytes_unsigned_little_endian():
    assert encode_frame(b"ab") == b"\x02\x00\x00\x00ab"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame(bytearray(b"x" * 258))[:HEADER_SIZE] == b"\x02\x01\x00\x00"


@given(
    payloads=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(1, 97), max_size=40),
)
def test_frames_come_back_whole_and_in_order_however_the_stream_is_cut(payloads, cuts):
    data = b"".join(encode_frame(p) for p in payloads)
    decoder = FrameDecoder()
    got, pos = [], 0
    for cut in [*cuts, len(data)]:
        decoder.feed(data[pos : pos + cut])
        pos += cut
        while (payload := decoder.next_frame()) is not None:
            got.append(bytes(payload))
        if pos >= len(data):
            break
    decoder.close()
    assert got == payloads and decoder.buffered == 0


def test_oversized_frames_are_refused_on_both_sides():
    with pytest.raises(FrameError, match="frame of 11 bytes exceeds the 10-byte limit"):
        encode_frame(b"x" * 11, max_frame=10)
    decoder = FrameDecoder(max_frame=10)
    decoder.feed(encode_frame(b"x" * 11)[:HEADER_SIZE])  # refused from the prefix alone
    with pytest.raises(FrameError, match="incoming frame of 11 bytes exceeds the 10-byte limit"):
        decoder.next_frame()
    decoder = FrameDecoder(max_frame=10)
    decoder.feed(encode_frame(b"x" * 11))
    assert bytes(decoder.next_frame(max_frame=11)) == b"x" * 11  # a per-frame bound
    assert FrameDecoder().max_frame == MAX_FRAME_BYTES == 64 << 20


def test_a_stream_that_ends_inside_a_frame_is_an_error():
    decoder = FrameDecoder()
    decoder.feed(encode_frame(b"abcdef")[:-1])
    assert decoder.next_frame() is None and decoder.missing == 1
    with pytest.raises(FrameError, match=r"inside a frame \(9 bytes pending\)"):
        decoder.close()
    decoder.clear()
    decoder.close()


def test_missing_says_how_much_the_next_frame_needs():
    decoder = FrameDecoder()
    assert decoder.missing == HEADER_SIZE
    frame = encode_frame(b"x" * 100)
    decoder.feed(frame[:2])
    assert decoder.missing == 2
    decoder.feed(frame[2:10])
    assert decoder.missing == 100 - 6
    decoder.feed(frame[10:])
    assert decoder.missing == 0


def test_unframed_bytes_after_a_frame_are_handed_over():
    decoder = FrameDecoder()
    decoder.feed(encode_frame(b"head") + b"raw payload")
    assert bytes(decoder.next_frame()) == b"head"
    assert bytes(decoder.take_buffered()) == b"raw payload" and decoder.buffered == 0


def test_bounds_outside_what_four_bytes_say_are_rejected():
    with pytest.raises(ValueError):
        FrameDecoder(max_frame=MAX_LENGTH + 1)
    with pytest.raises(ValueError):
        encode_frame(b"", max_frame=-1)


def test_the_workers_protocol_and_shard_batches_use_this_codec():
    import orjson

    from lowwater.trainer.shards import ShardFetchError, decode_batch
    from lowwater.workers.protocol import encode

    message = {"op": "hb", "rss": 1}
    assert encode(message) == encode_frame(orjson.dumps(message))
    header = orjson.dumps([{"id": "a", "dtype": "uint8", "shape": [2], "nbytes": 2}])
    [(meta, payload)] = decode_batch(encode_frame(header) + b"xy")
    assert meta["id"] == "a" and bytes(payload) == b"xy"
    with pytest.raises(ShardFetchError, match="header: incoming frame of 4294967295 bytes exceeds"):
        decode_batch(b"\xff\xff\xff\xff")


def test_receive_object_reads_across_cuts_and_tells_a_clean_end_from_a_cut_one():
    import orjson
    import trio
    import trio.testing

    from lowwater.framing import READ_BYTES, receive_object

    async def main() -> None:
        big = {"x": "y" * (3 * READ_BYTES)}  # larger than one read: the reader asks for what is missing
        for tail, ends_clean in ((b"", True), (encode_frame(b"{}")[:3], False)):
            send, receive = trio.testing.memory_stream_one_way_pair()
            decoder = FrameDecoder()
            await send.send_all(encode_frame(b'{"a": 1}') + encode_frame(orjson.dumps(big)) + tail)
            await send.aclose()
            assert await receive_object(receive, decoder) == {"a": 1}
            assert await receive_object(receive, decoder) == big
            if ends_clean:
                assert await receive_object(receive, decoder) is None
            else:
                with pytest.raises(FrameError, match="ended inside a frame"):
                    await receive_object(receive, decoder)
        for payload, message in ((b"[]", "not a JSON object"), (b"{x", "malformed payload")):
            send, receive = trio.testing.memory_stream_one_way_pair()
            await send.send_all(encode_frame(payload))
            with pytest.raises(FrameError, match=message):
                await receive_object(receive, FrameDecoder())

    trio.run(main)
