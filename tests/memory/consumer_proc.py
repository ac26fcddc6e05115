"""A trainer's shard consumer for test_consumer_rss.py, driven over stdin/stdout.

Usage: ``python consumer_proc.py [--keep-views]``.  Serves the consumer's drain endpoint on
127.0.0.1, prints ``{"address": ..., "rss_bytes": ...}``, then answers one
JSON command per stdin line with one JSON line:

* ``{"fetch": [refs], "keep": n}`` -> ``{"checksum": c}``: fetches the
  shards, reads every byte (as a training step would), and keeps ``n``
  bytes of bookkeeping per shard alive for the rest of the process (a
  trainer's per-sample records: small heap allocations that land between
  payloads and pin glibc's heap around them once those are freed).
* ``{"rss": true}`` -> ``{"rss_bytes": ..., "buffer": stats}``.

``--keep-views`` is the failing control of the test: every view is kept
past the drain (a trainer holding arrays of drained shards), so the
payloads stay resident (``live_bytes``, not ``bytes``).

The consumer is built with ``trim=None``: its rate-limited ``malloc_trim``
(at most once a second) skips every drain of a step shorter than that, so
RSS must fall from the drain itself, by unmapping payloads of 64 KiB and
more (benches/trainer_steps.py found the one-step-per-step sawtooth when it
did not).
"""

import sys

import httpx
import numpy as np
import orjson
import trio

from lowwater.http import serve
from lowwater.memory import rss_bytes
from lowwater.trainer.shards import ShardConsumer, ShardRef

KEPT: list = []
#: A trainer's first large temporary (bytes): below glibc's 32 MiB cap on its dynamic mmap threshold.
FIRST_TEMPORARY = 30 << 20
KEEP_VIEWS = "--keep-views" in sys.argv[1:]


def free_a_large_temporary() -> None:
    """Put glibc's allocator where a trainer's has it after its first step.

    Freeing a mapped block raises glibc's mmap threshold to that block's size
    (up to 32 MiB) and its trim threshold to twice that: from then on, blocks
    below 30 MiB come from the heap and the heap's top is not given back
    until 60 MiB of it is free.  A trainer gets there with its first large
    numpy or torch temporary; without it, which of this test's frees happen
    to give pages back would depend on where glibc placed each block.
    """
    block = bytearray(FIRST_TEMPORARY)
    del block


async def main() -> None:
    free_a_large_temporary()
    stdin = trio.wrap_file(sys.stdin)
    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
        consumer = ShardConsumer(client, trim=None)
        address = await nursery.start(serve, consumer)
        print(orjson.dumps({"address": address, "rss_bytes": rss_bytes()}).decode(), flush=True)
        while line := await stdin.readline():
            cmd = orjson.loads(line)
            if "fetch" in cmd:
                refs = [ShardRef.from_json(r) for r in cmd["fetch"]]
                checksum = 0
                # One shard per fetch, with the trainer's bookkeeping allocated
                # between them, as a loop over a step's samples would.
                for ref in refs:
                    (view,) = await consumer.fetch([ref])
                    checksum += int(np.frombuffer(view, np.uint8).sum())
                    if KEEP_VIEWS:
                        KEPT.append(view)
                    del view
                    KEPT.append(b"\x01" * cmd["keep"])
                reply = {"checksum": checksum}
            else:
                reply = {"rss_bytes": rss_bytes(), "buffer": consumer.buffer.stats()}
            print(orjson.dumps(reply).decode(), flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
