"""RSS gate: env workers of a pooled eval come back down after their rollouts.

A real ``python -m lowwater eval --workers 2`` runs ``TASKS`` tasks of the
default arithmetic environment in groups of ``GROUP`` (so ``TASKS * GROUP``
rollouts) against its scripted model.  A probe plugin (tests/memory/rss_probe.py,
loaded in every process through ``LOWWATER_PLUGINS``) reads each worker's RSS
after its first ``WARM`` rollouts and again at the worker's shutdown, after
all of them, both after a collection and a trim.  Per worker:

* it ran enough rollouts for the figure to mean something (counts);
* its RSS at the end is within ``BOUND`` of the warm figure: what a rollout
  holds goes when it ends.

The eval itself must complete every rollout without error, and its workers
report no leftovers in their engines and tables (summary JSON).
The failing control loads the same probe with a leak of each finished
rollout's trajectory and 64 KiB (an agent's request body with a
screenshot); the gate must catch it (the leftovers stay empty there: the
leak is outside the structures the workers count, which is why RSS is
measured at all).
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from ._proc import HERE, MIB, child_env

pytestmark = pytest.mark.memory

TASKS = 64
GROUP = 8
WARM = 32
#: A worker's RSS after all its rollouts over its RSS after the first WARM (bytes).
BOUND = 8 * MIB
LEAK = 64 * 1024


def run_gate(tmp_path, leak: int = 0) -> list[dict]:
    """Each worker's probe figures (bytes) after a pooled eval."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    env = child_env(
        LOWWATER_PLUGINS="rss_probe",
        LOWWATER_RSS_PROBE_DIR=str(probe_dir),
        LOWWATER_RSS_PROBE_WARM=str(WARM),
        LOWWATER_RSS_PROBE_LEAK=str(leak),
    )
    env["PYTHONPATH"] = ":".join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    summary = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, "-m", "lowwater", "eval", "--workers", "2", "-n", str(TASKS), "--group-size", str(GROUP)]
        + ["--summary-json", str(summary), "--out", str(tmp_path / "results.jsonl"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    s = orjson.loads(summary.read_bytes())
    assert (s["rollouts"], s["completed"], s["errors"]) == (TASKS * GROUP, TASKS * GROUP, 0), s
    # The workers' own count of what their engines and tables still held at teardown.
    assert s.get("leftovers", {}) == {}, s
    workers = [orjson.loads(p.read_bytes()) for p in sorted(probe_dir.glob("*.json"))]
    assert len(workers) == 2, (workers, done.stderr[-4000:])
    assert sum(w["rollouts"] for w in workers) == TASKS * GROUP, workers
    return workers


def violations(workers: list[dict]) -> list[str]:
    out = []
    for w in workers:
        if w["rollouts"] < 4 * WARM:
            out.append(f"worker {w['pid']} ran only {w['rollouts']} rollouts")
        elif w["end"] - w["warm"] > BOUND:
            out.append(f"worker {w['pid']}: {(w['end'] - w['warm']) / MIB:.1f} MiB over its warm RSS")
    return out


def describe(workers: list[dict]) -> str:
    return "; ".join(
        f"worker {w['pid']}: {w['rollouts']} rollouts, warm {w.get('warm', 0) / MIB:.1f} MiB, "
        f"end {w['end'] / MIB:.1f} MiB"
        for w in workers
    )


def test_eval_workers_rest_after_their_rollouts(tmp_path, record_property):
    workers = run_gate(tmp_path)
    record_property("rss", describe(workers))
    assert violations(workers) == [], describe(workers)


def test_control_a_plugin_that_keeps_rollouts_fails_the_gate(tmp_path, record_property):
    workers = run_gate(tmp_path, leak=LEAK)
    record_property("rss", describe(workers))
    assert any("over its warm RSS" in v for v in violations(workers)), describe(workers)
