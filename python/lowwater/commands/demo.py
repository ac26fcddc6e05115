"""``lowwater demo``: both Rust tables through a few trainer steps, with RSS.

Each step plays what a real run does to the tables:

* the **intercept table** holds the request body of every in-flight model
  call (a growing chat history with a base64 image, as in the 45-turn
  browser rollouts of docs/design.md#incidents); a delivered call is discarded at
  once, and closing a rollout sweeps the calls it left undelivered;
* the **fetch buffer** of a consumer fills with the step's shards (token ids,
  logprobs, rewards), hands out zero-copy views, and is drained at step end
  with ``clear(step_ids)``.

It prints each step's table stats and current RSS, then checks the low-water
mark: both tables empty and RSS back near its baseline.  Exit status 1 if a
table is not empty at the end.
"""

from __future__ import annotations

import argparse
import array
import base64
import json
import random
from typing import Any

import psutil

from lowwater import FetchBuffer, InterceptTable

MIB = 1 << 20


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="exercise both Rust tables and print their stats and RSS")
    p.add_argument("--steps", type=int, default=5, help="trainer steps (default 5)")
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per step (default 8)")
    p.add_argument("--turns", type=int, default=12, help="model calls per rollout (default 12)")
    p.add_argument("--image-kb", type=int, default=150, help="base64 image per turn, KiB (default 150)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=131072,
        help="tokens per rollout (default 131072: an int64 shard of 1 MiB, at the mmap threshold)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the demo's tasks (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON summary line instead of text")
    p.set_defaults(func=run)
    return p


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / MIB


def _validate(args: argparse.Namespace) -> None:
    from lowwater.cli import UsageError

    for name in ("steps", "rollouts", "turns", "seq_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.image_kb < 0:
        raise UsageError(f"--image-kb must be >= 0, got {args.image_kb}")


def _intercept_step(table: InterceptTable, step: int, args: argparse.Namespace, rng: random.Random) -> int:
    """Run one step's model calls through the intercept table; returns bytes seen."""
    image = base64.b64encode(rng.randbytes(args.image_kb * 1024 * 3 // 4)).decode()
    seen = 0
    for r in range(args.rollouts):
        rollout_id = f"step{step}-rollout{r}"
        table.open_rollout(rollout_id)
        history: list[dict[str, Any]] = [{"role": "system", "content": "You are a browsing agent."}]
        for turn in range(args.turns):
            history.append(
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}],
                }
            )
            body = json.dumps({"model": "demo", "messages": history}).encode()
            request_id = f"{rollout_id}-call{turn}"
            table.insert(request_id, rollout_id, body, protocol="chat.completions", stream=turn % 2 == 0)
            seen += len(body)
            # The response is delivered: the body must not outlive the call.
            # The last call of every other rollout is left undelivered, as when
            # an agent is cancelled mid-call; closing the rollout sweeps it.
            if not (turn == args.turns - 1 and r % 2):
                table.discard(request_id)
            history.append({"role": "assistant", "content": f"turn {turn} done"})
        swept = table.close_rollout(rollout_id)
        assert swept == ([] if r % 2 == 0 else [f"{rollout_id}-call{args.turns - 1}"]), swept
    return seen


def _shard_step(buffer: FetchBuffer, step: int, args: argparse.Namespace, rng: random.Random) -> list[str]:
    """Fill the fetch buffer with one step's shards; returns their ids."""
    ids = []
    for r in range(args.rollouts):
        first = rng.randrange(50_000)
        tokens = array.array("q", range(first, first + args.seq_len))
        logprobs = array.array("f", [-rng.random()]) * args.seq_len
        mask = bytes([1, 1, 0]) * (args.seq_len // 3) + bytes(args.seq_len % 3)
        for name, data, dtype in (
            ("tokens", tokens, "int64"),
            ("logprobs", logprobs, "float32"),
            ("mask", mask, "uint8"),
        ):
            shard_id = f"step{step}/rollout{r}/{name}"
            buffer.put(shard_id, data, dtype=dtype, shape=(1, args.seq_len), owner="127.0.0.1:0")
            ids.append(shard_id)
    # Consumers read through zero-copy views; a view is released before drain.
    for shard_id in ids:
        view = buffer.get(shard_id)
        assert view is not None and len(memoryview(view)) == view.nbytes
        del view
    return ids


def run(args: argparse.Namespace) -> int:
    _validate(args)
    rng = random.Random(args.seed)
    table = InterceptTable()
    buffer = FetchBuffer()
    baseline = _rss_mb()
    peak = baseline
    rows = []
    for step in range(args.steps):
        seen = _intercept_step(table, step, args, rng)
        ids = _shard_step(buffer, step, args, rng)
        filled = buffer.stats()
        peak = max(peak, _rss_mb())
        drained = buffer.clear(ids)
        rows.append(
            {
                "step": step,
                "intercept_bytes_seen": seen,
                "intercept_peak_bytes": table.stats()["peak_bytes"],
                "intercepts_left": len(table),
                "shards_filled": filled["entries"],
                "shard_bytes_filled": filled["bytes"],
                "shards_drained": drained,
                "shards_left": len(buffer),
                "rss_mb": _rss_mb(),
            }
        )
        if not args.json:
            row = rows[-1]
            print(
                f"step {step}: intercepts {row['intercept_bytes_seen'] / MIB:8.1f} MiB through, "
                f"{row['intercepts_left']} left | shards {row['shards_filled']} filled "
                f"({row['shard_bytes_filled'] / MIB:.1f} MiB), {row['shards_drained']} drained, "
                f"{row['shards_left']} left | RSS {row['rss_mb']:.1f} MiB"
            )
    resting = _rss_mb()
    summary = {
        "intercept_table": table.stats(),
        "fetch_buffer": buffer.stats(),
        "rss_baseline_mb": round(baseline, 1),
        "rss_peak_mb": round(peak, 1),
        "rss_resting_mb": round(resting, 1),
    }
    empty = len(table) == 0 and len(buffer) == 0
    if args.json:
        print(json.dumps({"steps": rows, **summary, "low_water": empty}))
    else:
        print("intercept table:", table.stats())
        print("fetch buffer:   ", buffer.stats())
        print(
            f"RSS: baseline {baseline:.1f} MiB, peak {peak:.1f} MiB, resting {resting:.1f} MiB "
            f"({'both tables empty: back at the low-water mark' if empty else 'TABLES NOT EMPTY'})"
        )
    return 0 if empty else 1
