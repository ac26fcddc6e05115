"""RSS gate: a trim at quiescence gives freed heap pages back to the OS (measured, not counted).

A real process (tests/memory/trim_proc.py) fills glibc's heap with 96 MiB of
600 B - 4 KiB objects, frees all but a few survivors spread over it (so glibc
returns nothing by itself: the pages stay resident, the state of a worker
after a burst, docs/design.md#incidents), then calls
``lowwater.memory.Trimmer(0.0)()``.  The trim must give back at least half
of what the fill added.  ``Trimmer.calls`` counts a trim whether or not it
freed anything, so only RSS shows a ``malloc_trim`` that does nothing (the
mutation in tests/mutations/).  The failing control frees nothing (a leak):
the trim has nothing to return and the gate must say so.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from lowwater.memory import malloc_trim_available

from ._proc import HERE, MIB, child_env

pytestmark = [
    pytest.mark.memory,
    pytest.mark.skipif(not malloc_trim_available(), reason="glibc's malloc_trim is not available here"),
]

#: The fill must have been resident (bytes): most of trim_proc.TOTAL.
MIN_RISE = 64 * MIB


def run(*flags: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(HERE / "trim_proc.py"), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    return orjson.loads(done.stdout.splitlines()[-1])


def violations(f: dict) -> list[str]:
    rise = f["filled"] - f["start"]
    out = []
    if rise < MIN_RISE:
        out.append(f"the fill added only {rise / MIB:.1f} MiB")
    if f["freed"] - f["trimmed"] < rise // 2:
        out.append(f"the trim gave back {(f['freed'] - f['trimmed']) / MIB:.1f} MiB of {rise / MIB:.1f} MiB filled")
    return out


def describe(f: dict) -> str:
    return ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in f.items() if k in ("start", "filled", "freed", "trimmed"))


def test_trim_at_quiescence_returns_freed_pages(record_property):
    figures = run()
    record_property("rss", describe(figures))
    assert (figures["ran"], figures["calls"]) == (True, 1)
    assert violations(figures) == [], describe(figures)


def test_control_nothing_freed_fails_the_gate(record_property):
    figures = run("--keep")
    record_property("rss", describe(figures))
    assert (figures["ran"], figures["calls"]) == (True, 1)
    assert any(v.startswith("the trim gave back") for v in violations(figures)), describe(figures)
