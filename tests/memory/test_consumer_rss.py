"""RSS gate: a trainer consumer's RSS falls back after ``clear_batch`` drains large shards.

A real consumer process (tests/memory/consumer_proc.py: ``ShardConsumer``
with its default fetch buffer) fetches ``CYCLES`` steps of ``SHARDS`` shards
of ``SHARD_BYTES`` from a ``ShardStore`` served by this process, keeping a
trainer's small bookkeeping between them; each step ends with
``clear_batch``.  The shards are above the consumer's 64 KiB mmap threshold
(``CONSUMER_MMAP_THRESHOLD``) and below the table default's 1 MiB and glibc's
dynamic one, the sizes whose pages stay on the heap unless the drain unmaps
them.  Per step:

* the consumer's buffer is empty after the drain (counts: deterministic);
* its RSS rose by most of the step's bytes while it held them (the gate
  measures what it claims to);
* its RSS after the drain is within ``SLACK`` of the baseline taken after a
  warm-up step of small shards.

Raising ``CONSUMER_MMAP_THRESHOLD`` to 1 TiB (payloads on the heap, the
mutation in tests/mutations/) leaves about a step's bytes resident after
every drain and fails the last bound; so does the failing control, a
consumer that keeps its views past the drain.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import orjson
import pytest
import trio

from lowwater.http import serve
from lowwater.trainer.drain import clear_batch
from lowwater.trainer.shards import ShardStore

from ._proc import HERE, MIB, WAIT_S, child_env, end_input_and_wait

pytestmark = pytest.mark.memory

CYCLES = 6
SHARDS = 48
SHARD_BYTES = 384 * 1024
STEP_BYTES = SHARDS * SHARD_BYTES  # 18 MiB
#: Bytes of bookkeeping a consumer keeps per fetched shard (heap, not pymalloc: > 512 B).
KEEP = 2048
#: Resting RSS after a drain, over the baseline (bytes); a step's bytes left on the heap is 18 MiB.
SLACK = 6 * MIB
#: The payloads were resident while held: RSS rose by at least this much (bytes).
MIN_RISE = STEP_BYTES // 2


class Consumer:
    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), bufsize=0
        )
        first = orjson.loads(self.proc.stdout.readline())
        self.address = first["address"]

    async def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(orjson.dumps(cmd) + b"\n")
        # readline releases the GIL: this process's shard store keeps serving meanwhile.
        line = await trio.to_thread.run_sync(self.proc.stdout.readline)
        assert line, f"the consumer exited with {self.proc.poll()}"
        return orjson.loads(line)

    def close(self) -> None:
        end_input_and_wait(self.proc)


async def run_gate(argv: list[str]) -> dict[str, list[int]]:
    """The consumer's RSS (bytes): ``base`` after the warm-up, then ``held`` and ``drained`` per step."""
    rng = np.random.default_rng(0)
    consumer = Consumer(argv)
    figures: dict[str, list[int]] = {"base": [], "held": [], "drained": []}
    try:
        with trio.fail_after(WAIT_S * 2):
            async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
                store = ShardStore()
                store.address = await nursery.start(serve, store)

                async def step(name: str, nbytes: int) -> None:
                    refs = [
                        store.put(
                            f"{name}/{i}", rng.integers(0, 256, nbytes, dtype=np.uint8), dtype="uint8", shape=(nbytes,)
                        )
                        for i in range(SHARDS)
                    ]
                    await consumer.ask({"fetch": [r.to_json() for r in refs], "keep": KEEP})
                    held = await consumer.ask({"rss": True})
                    assert held["buffer"]["entries"] == SHARDS, held
                    report = await clear_batch(refs, client=client, consumers=[consumer.address], local=store)
                    assert report.leaked_bytes == 0, report
                    drained = await consumer.ask({"rss": True})
                    buffer = drained["buffer"]
                    assert (buffer["entries"], buffer["bytes"]) == (0, 0), buffer
                    figures["held"].append(held["rss_bytes"])
                    figures["drained"].append(drained["rss_bytes"])

                # Warm-up: the code paths, with shards far below every threshold.
                await step("warm", 4096)
                figures["base"].append(figures["drained"].pop())
                figures["held"].pop()
                for cycle in range(CYCLES):
                    await step(f"step{cycle}", SHARD_BYTES)
                nursery.cancel_scope.cancel()
    finally:
        consumer.close()
    return figures


def violations(f: dict[str, list[int]]) -> list[str]:
    (base,) = f["base"]
    out = []
    for cycle, (held, drained) in enumerate(zip(f["held"], f["drained"])):
        if held - base < MIN_RISE:
            out.append(f"step {cycle}: RSS rose by only {(held - base) / MIB:.1f} MiB while holding the step")
        if drained - base > SLACK:
            out.append(f"step {cycle}: {(drained - base) / MIB:.1f} MiB over the baseline after the drain")
    return out


def describe(f: dict[str, list[int]]) -> str:
    return "; ".join(f"{k} " + " ".join(f"{v / MIB:.1f}" for v in vs) for k, vs in f.items()) + " (MiB)"


def test_consumer_rss_falls_after_clear_batch(record_property):
    figures = trio.run(run_gate, [str(HERE / "consumer_proc.py")])
    record_property("rss", describe(figures))
    assert violations(figures) == [], describe(figures)


def test_control_a_consumer_that_keeps_its_views_fails_the_gate(record_property):
    figures = trio.run(run_gate, [str(HERE / "consumer_proc.py"), "--keep-views"])
    record_property("rss", describe(figures))
    found = violations(figures)
    assert any("after the drain" in v for v in found), f"the leak went unseen: {describe(figures)}"
