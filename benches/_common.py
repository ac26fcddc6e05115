"""Helpers shared by the benchmark scripts (see benches/README.md#output)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20


def rss_bytes(pid: int | None = None) -> int:
    """Current resident set size in bytes, from /proc/<pid>/statm (never a peak counter)."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def pid_rss_bytes(pid: int) -> int | None:
    """Current RSS of ``pid`` in bytes, or ``None`` if it is gone."""
    try:
        return rss_bytes(pid)
    except (OSError, ValueError, IndexError):
        return None


def slope_bytes_per_rollout(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (bytes) against finished rollouts over the
    second half of ``points`` (``(finished, rss_bytes)`` pairs)."""
    half = points[len(points) // 2 :]
    if len(half) < 2 or len({x for x, _ in half}) < 2:
        return 0.0
    mx = sum(x for x, _ in half) / len(half)
    my = sum(y for _, y in half) / len(half)
    num = sum((x - mx) * (y - my) for x, y in half)
    den = sum((x - mx) ** 2 for x, _ in half)
    return num / den


async def settle_and_sample(pool, resting: dict[int, list[tuple[int, int]]], timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s``) until every worker of ``pool`` is idle and
    settled (collected and trimmed), then append ``(completed, rss_bytes)``
    to ``resting[pid]`` for each worker."""
    import trio

    deadline = trio.current_time() + timeout_s
    while trio.current_time() < deadline:
        workers = pool.stats()["workers"].values()
        if workers and all(w["idle"] and w["settled"] for w in workers):
            break
        await trio.sleep(0.02)
    for w in pool.stats()["workers"].values():
        rss = pid_rss_bytes(w["pid"]) if w["pid"] else None
        if rss is not None:
            resting.setdefault(w["pid"], []).append((w["completed"], rss))


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def target(value: float, *, max: float | None = None, min: float | None = None) -> dict:
    if max is not None:
        return {"value": value, "max": max, "met": bool(value <= max)}
    assert min is not None
    return {"value": value, "min": min, "met": bool(value >= min)}


def params_of(a: argparse.Namespace, *, omit: tuple[str, ...] = (), **extra: object) -> dict:
    """The ``params`` of :func:`emit`: every parsed flag of ``a`` (after ``--quick``
    adjusted it) in the order the parser declared them, but the ``omit`` ones (the
    hidden child-process flags), then ``extra`` (a value given there replaces the
    flag's own)."""
    return {k: v for k, v in vars(a).items() if k not in omit} | extra


def emit(bench: str, params: dict, results: dict, targets: dict) -> None:
    """Print the one JSON line BENCHMARKS.md asks for, as the last line of stdout."""
    line = {"bench": bench, "commit": commit(), "params": params, "results": results, "targets": targets}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
