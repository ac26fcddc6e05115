"""benches/ray_backend.py --quick prints the JSON shape benches/README.md#output
asks for (shapes only: no time or ratio is asserted), and leaves no Ray process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

BENCH = Path(__file__).resolve().parents[2] / "benches" / "ray_backend.py"
UNIT_SUFFIXES = ("_bytes", "_mb", "_s", "_ms", "_us", "_per_s", "_ratio", "_count", "_bytes_per_step")


def test_quick_run_prints_benchmark_json():
    out = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(line) == {"bench", "commit", "params", "results", "targets"}
    assert line["bench"] == "ray_backend" and line["params"]["quick"] is True
    for key, value in line["results"].items():
        assert key.endswith(UNIT_SUFFIXES), f"{key} has no unit in its name"
        assert isinstance(value, (int, float))
    for key, t in line["targets"].items():
        assert key in line["results"] and t["value"] == line["results"][key]
        assert ("max" in t) != ("min" in t) and isinstance(t["met"], bool)
    assert line["results"]["ray_processes_left_count"] == 0
    assert line["results"]["steps_objects_left_after_drain_max_count"] == 0
