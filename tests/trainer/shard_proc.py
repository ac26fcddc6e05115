"""A shard owner or consumer process for tests/trainer, driven over stdin/stdout.

Usage: ``python shard_proc.py owner|consumer``.  It serves its endpoints on
127.0.0.1 (OS-chosen port), prints ``{"address": ...}``, then answers one JSON
command per stdin line with one JSON line:

* owner: ``{"make": step, "n": count, "elems": k}`` -> ``{"refs": [...]}``
  (int64 shards whose values are ``step * 1_000_000 + i * 1000 + arange(k)``);
  ``{"stats": true}`` -> the store's stats.
* consumer: ``{"fetch": [refs]}`` -> ``{"sums": [...], "stats": {...}}``;
  ``{"stats": true}`` -> the buffer's stats.
"""

import sys

import httpx
import numpy as np
import orjson
import trio

from lowwater.http import serve
from lowwater.trainer.shards import ShardConsumer, ShardRef, ShardStore


async def main(role: str) -> None:
    stdin = trio.wrap_file(sys.stdin)
    async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
        app = ShardStore() if role == "owner" else ShardConsumer(client)
        address = await nursery.start(serve, app)
        if role == "owner":
            app.address = address
        print(orjson.dumps({"address": address}).decode(), flush=True)
        while line := await stdin.readline():
            cmd = orjson.loads(line)
            if "stats" in cmd:
                reply = app.stats() if role == "owner" else app.buffer.stats()
            elif "make" in cmd:
                refs = []
                for i in range(cmd["n"]):
                    data = np.arange(cmd["elems"], dtype=np.int64) + cmd["make"] * 1_000_000 + i * 1000
                    refs.append(
                        app.put(f"step{cmd['make']}/{i}", data, dtype="int64", shape=(1, cmd["elems"])).to_json()
                    )
                reply = {"refs": refs}
            else:
                views = await app.fetch([ShardRef.from_json(r) for r in cmd["fetch"]])
                sums = [int(np.frombuffer(v, v.dtype).sum()) for v in views]
                del views
                reply = {"sums": sums, "stats": app.buffer.stats()}
            print(orjson.dumps(reply).decode(), flush=True)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
