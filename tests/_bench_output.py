"""A benchmark's ``--quick`` run and the JSON line benches/README.md#output asks
for, shared by tests/test_benches.py and tests/ray/test_bench_quick.py.

Shapes only: no time or ratio is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parent.parent / "benches"
#: The units a result key may end in (benches/README.md#output).
UNIT_SUFFIXES = (
    "_bytes",
    "_mb",
    "_s",
    "_ms",
    "_us",
    "_per_s",
    "_ratio",
    "_count",
    "_bytes_per_step",
    "_bytes_per_rollout",
)


def run_quick(name: str, *args: str) -> dict:
    """Run ``benches/<name>.py --quick [args]`` (at most 600 s); its last stdout line, parsed."""
    out = subprocess.run(
        [sys.executable, str(BENCHES / f"{name}.py"), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_benchmark_json(line: dict, name: str) -> None:
    """``line`` has the README's keys, is bench ``name`` run with ``--quick``, every
    result is a number with a unit in its key, and every target names a result."""
    assert set(line) == {"bench", "commit", "params", "results", "targets"}
    assert line["bench"] == name and line["params"]["quick"] is True
    for key, value in line["results"].items():
        assert key.endswith(UNIT_SUFFIXES), f"{key} has no unit in its name"
        assert isinstance(value, (int, float))
    for key, t in line["targets"].items():
        assert key in line["results"] and t["value"] == line["results"][key]
        assert ("max" in t) != ("min" in t) and isinstance(t["met"], bool)
