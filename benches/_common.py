"""Helpers shared by the benchmark scripts (see ../shared/BENCHMARKS.md)."""

from __future__ import annotations

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


def emit(bench: str, params: dict, results: dict, targets: dict) -> None:
    """Print the one JSON line BENCHMARKS.md asks for, as the last line of stdout."""
    line = {"bench": bench, "commit": commit(), "params": params, "results": results, "targets": targets}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
