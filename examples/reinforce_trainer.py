"""A REINFORCE-style trainer loop embedding lowwater, with two consumer processes.

The trainer is an ordinary (non-Trio) program: it uses
:class:`lowwater.trainer.SyncLowwater`, which runs lowwater's Trio loop in
a background thread.  Each step:

1. ``next_batch(n_groups)`` runs groups of rollouts of the embedded default
   environment (seeded arithmetic with a calculator tool) against the
   scripted model, and returns shard references (token ids, logprobs, loss
   masks, offsets, rewards, GRPO advantages per group);
2. two consumer processes (think: data-parallel ranks) each fetch half of the
   groups' shards into their own fetch buffer over loopback HTTP, zero-copy,
   and compute their part of the REINFORCE objective
   ``-sum_t A_i * logprob_t`` over trained tokens (Williams 1992), plus a
   toy update of a per-token-id bias table so there is something to train;
3. ``clear_batch(batch, consumers=[...])`` releases the step everywhere: the
   producer's store and both consumers' fetch buffers, which then report
   their stats (a non-empty buffer would be logged as a leak).

It prints one line per step (reward, loss, bytes per step, consumer buffer
bytes after the drain, RSS of each process) and exits 1 if any buffer is not
empty after a drain.

Usage: ``python examples/reinforce_trainer.py [--steps 20] [--groups 4] [--group-size 4] [--workers 0]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from typing import Any

VOCAB = 4096


def consumer_process(conn: Any) -> None:
    """A consumer rank: serve the drain endpoint, fetch and train on request."""
    import httpx
    import numpy as np
    import trio

    from lowwater.http import serve
    from lowwater.memory import rss_bytes
    from lowwater.trainer.shards import ShardConsumer, ShardRef

    bias = np.zeros(VOCAB, np.float64)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
            consumer = ShardConsumer(client)
            conn.send(await nursery.start(serve, consumer))
            while True:
                message = await trio.to_thread.run_sync(conn.recv)
                if message is None:
                    break
                if message == "stats":
                    conn.send({"buffer_bytes": consumer.buffer.stats()["bytes"], "rss_bytes": rss_bytes()})
                    continue
                refs = [ShardRef.from_json(r) for r in message]
                views = await consumer.fetch(refs)
                loss, tokens = 0.0, 0
                for g in range(0, len(views), 6):  # six shards per group, SHARD_NAMES order
                    ids, logprobs, mask, offsets, _rewards, advantages = (
                        np.frombuffer(v, v.dtype) for v in views[g : g + 6]
                    )
                    for i, advantage in enumerate(advantages):
                        lo, hi = int(offsets[i]), int(offsets[i + 1])
                        trained = mask[lo:hi].astype(bool)
                        loss -= float(advantage) * float(logprobs[lo:hi][trained].sum())
                        np.add.at(bias, ids[lo:hi][trained] % VOCAB, 1e-3 * float(advantage))
                        tokens += int(trained.sum())
                del views  # release the views before the step's drain
                conn.send({"loss": loss, "tokens": tokens})
            nursery.cancel_scope.cancel()

    trio.run(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=4, help="groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument(
        "--workers", type=int, default=0, help="env worker processes for the rollouts (default 0: in this process)"
    )
    args = parser.parse_args(argv)

    from lowwater.memory import rss_bytes
    from lowwater.trainer import SyncLowwater, TrainerConfig

    ctx = mp.get_context("spawn")  # no fork of a process with a Trio thread
    pipes, procs = [], []
    for _ in range(args.consumers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=consumer_process, args=(child,), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    addresses = [p.recv() for p in pipes]
    leaked = False
    try:
        with SyncLowwater(
            TrainerConfig(group_size=args.group_size, concurrency=args.groups, workers=args.workers)
        ) as lw:
            for step in range(args.steps):
                batch = lw.next_batch(args.groups)
                groups = [list(batch.refs[i : i + 6]) for i in range(0, len(batch.refs), 6)]
                for rank, pipe in enumerate(pipes):
                    pipe.send([r.to_json() for g in groups[rank :: len(pipes)] for r in g])
                results = [p.recv() for p in pipes]
                report = lw.clear_batch(batch, consumers=addresses)
                stats = []
                for pipe in pipes:
                    pipe.send("stats")
                    stats.append(pipe.recv())
                leftover = report.leaked_bytes + sum(s["buffer_bytes"] for s in stats) + lw.stats()["shards"]["bytes"]
                leaked |= leftover > 0
                mean_reward = sum(sum(r) for r in batch.rewards) / max(1, sum(len(r) for r in batch.rewards))
                print(
                    f"step {step:3d}  reward {mean_reward:.3f}  loss {sum(r['loss'] for r in results):9.3f}  "
                    f"tokens {sum(r['tokens'] for r in results):6d}  step_bytes {batch.nbytes:8d}  "
                    f"left_after_drain {leftover}  rss_mb trainer {rss_bytes() / 2**20:.1f} consumers "
                    + " ".join(f"{s['rss_bytes'] / 2**20:.1f}" for s in stats),
                    flush=True,
                )
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if leaked:
        print("a fetch buffer or the shard store was not empty after a drain", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
