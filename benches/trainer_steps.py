"""Trainer steps with and without the step-end drain: consumer RSS per step.

The incident (docs/design.md#incidents): trainer consumer processes grew ~2 GB per
step and crashed near step 113, because the shard fetch buffer was drained only
on the controller.  Here a producer (this process, a ``ShardStore`` served over
loopback HTTP) makes each step's shards (per group: token ids int64
``[rollouts, seq]``, logprobs float32, loss mask uint8, advantages float32
``[rollouts]``), two consumer processes fetch them into their ``FetchBuffer``,
and at step end either

* ``drain``: ``clear_batch`` removes the owner's copies and drains both
  consumers (lowwater's design), or
* ``no_drain``: only the owner's copies are removed (the peer's bug),

each phase with fresh consumer processes, in the same run.  Each consumer
reports its current RSS after every step; the slope is a least-squares fit
over the second half of the steps (the first half absorbs allocator warm-up).

Usage: ``python benches/trainer_steps.py [--quick] [--steps 200] [--groups 4]
[--rollouts 8] [--seq 4096] [--consumers 2]``.  Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import orjson
import trio

sys.path.insert(0, str(Path(__file__).parent))
from _common import MIB, emit, params_of, progress, rss_bytes, target
from lowwater.http import serve
from lowwater.trainer.drain import clear_batch
from lowwater.trainer.shards import ShardConsumer, ShardRef, ShardStore


async def consumer_main() -> None:
    """Consumer process: serve the drain endpoint, fetch on request, report RSS."""
    stdin = trio.wrap_file(sys.stdin)
    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
        consumer = ShardConsumer(client)
        address = await nursery.start(serve, consumer)
        print(orjson.dumps({"address": address, "rss_bytes": rss_bytes()}).decode(), flush=True)
        while line := await stdin.readline():
            cmd = orjson.loads(line)
            if "fetch" in cmd:
                views = await consumer.fetch([ShardRef.from_json(r) for r in cmd["fetch"]])
                # Touch every byte, as a training step would.
                checksum = sum(int(np.frombuffer(v, np.uint8).sum()) for v in views)
                del views
                reply = {"checksum": checksum}
            else:
                reply = {"rss_bytes": rss_bytes(), "buffer": consumer.buffer.stats()}
            print(orjson.dumps(reply).decode(), flush=True)
        nursery.cancel_scope.cancel()


class Consumer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--_consumer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        first = orjson.loads(self.proc.stdout.readline())
        self.address = first["address"]
        self.baseline_bytes = first["rss_bytes"]

    async def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(orjson.dumps(cmd).decode() + "\n")
        # readline releases the GIL: the owner server keeps serving meanwhile.
        return orjson.loads(await trio.to_thread.run_sync(self.proc.stdout.readline))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def make_step(
    store: ShardStore, step: int, groups: int, rollouts: int, seq: int, rng: np.random.Generator
) -> list[ShardRef]:
    refs = []
    for g in range(groups):
        prefix = f"step{step}/group{g}"
        tokens = rng.integers(0, 150_000, size=(rollouts, seq), dtype=np.int64)
        logprobs = rng.standard_normal((rollouts, seq), dtype=np.float32)
        mask = (rng.random((rollouts, seq)) < 0.7).astype(np.uint8)
        rewards = rng.random(rollouts, dtype=np.float32)
        advantages = (rewards - rewards.mean()).astype(np.float32)
        for name, arr in (("tokens", tokens), ("logprobs", logprobs), ("loss_mask", mask), ("advantages", advantages)):
            refs.append(store.put(f"{prefix}/{name}", arr, dtype=str(arr.dtype), shape=arr.shape))
    return refs


def slope_bytes_per_step(rss: list[int]) -> float:
    half = rss[len(rss) // 2 :]
    if len(half) < 2:
        return 0.0
    x = np.arange(len(half), dtype=np.float64)
    return float(np.polyfit(x, np.asarray(half, dtype=np.float64), 1)[0])


async def phase(drain: bool, a: argparse.Namespace) -> dict:
    rng = np.random.default_rng(a.seed)
    consumers = [Consumer() for _ in range(a.consumers)]
    per_consumer: list[list[int]] = [[] for _ in consumers]
    step_bytes = 0
    try:
        async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
            store = ShardStore()
            store.address = await nursery.start(serve, store)
            for step in range(a.steps):
                refs = make_step(store, step, a.groups, a.rollouts, a.seq, rng)
                step_bytes = sum(r.nbytes for r in refs)
                payload = {"fetch": [r.to_json() for r in refs]}
                async with trio.open_nursery() as fetches:
                    for c in consumers:
                        fetches.start_soon(c.ask, payload)
                if drain:
                    report = await clear_batch(
                        refs, client=client, consumers=[c.address for c in consumers], local=store
                    )
                    assert report.leaked_bytes == 0, report
                else:
                    store.remove(r.shard_id for r in refs)
                for i, c in enumerate(consumers):
                    per_consumer[i].append((await c.ask({"rss": True}))["rss_bytes"])
                if step % 50 == 0:
                    progress(
                        f"  {'drain' if drain else 'no drain'} step {step}: consumer RSS {[round(r[-1] / MIB, 1) for r in per_consumer]} MiB"
                    )
            nursery.cancel_scope.cancel()
    finally:
        for c in consumers:
            c.close()
    slopes = [slope_bytes_per_step(r) for r in per_consumer]
    return {
        "step_bytes": step_bytes,
        "slope_bytes_per_step": max(slopes),
        "rss_baseline_mb": max(c.baseline_bytes for c in consumers) / MIB,
        "rss_peak_mb": max(max(r) for r in per_consumer) / MIB,
        "rss_resting_mb": max(r[-1] for r in per_consumer) / MIB,
        "rss_per_step_mb": [[round(v / MIB, 2) for v in r] for r in per_consumer],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--_consumer", dest="consumer", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.consumer:
        trio.run(consumer_main)
        return
    if a.quick:
        a.steps = 12
    progress(f"{a.steps} steps, {a.consumers} consumers, {a.groups} groups x {a.rollouts} rollouts x {a.seq} tokens")
    with_drain = trio.run(phase, True, a)
    without = trio.run(phase, False, a)
    step_bytes = with_drain["step_bytes"]
    results = {
        "step_bytes": step_bytes,
        "drain_slope_bytes_per_step": with_drain["slope_bytes_per_step"],
        "no_drain_slope_bytes_per_step": without["slope_bytes_per_step"],
        "no_drain_slope_to_step_bytes_ratio": without["slope_bytes_per_step"] / step_bytes,
        "rss_baseline_mb": with_drain["rss_baseline_mb"],
        "rss_peak_mb": with_drain["rss_peak_mb"],
        "rss_resting_mb": with_drain["rss_resting_mb"],
        "no_drain_rss_baseline_mb": without["rss_baseline_mb"],
        "no_drain_rss_peak_mb": without["rss_peak_mb"],
        "no_drain_rss_resting_mb": without["rss_resting_mb"],
    }
    targets = {
        "drain_slope_bytes_per_step": target(results["drain_slope_bytes_per_step"], max=64 * 1024),
        # The bench can fail: without the drain, consumers grow by about a step's bytes.
        "no_drain_slope_to_step_bytes_ratio": target(results["no_drain_slope_to_step_bytes_ratio"], min=0.5),
    }
    # --seed stays out of params, as before: the keys stay those of the recorded runs.
    params = params_of(a, omit=("seed", "consumer"))
    series = {
        "drain_rss_per_step_mb": with_drain["rss_per_step_mb"],
        "no_drain_rss_per_step_mb": without["rss_per_step_mb"],
    }
    progress("per-consumer RSS per step (MiB): " + orjson.dumps(series).decode())
    emit("trainer_steps", params, results, targets)


if __name__ == "__main__":
    main()
