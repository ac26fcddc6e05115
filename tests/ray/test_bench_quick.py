"""benches/ray_backend.py --quick prints the JSON shape benches/README.md#output
asks for (shapes only: no time or ratio is asserted), and leaves no Ray process."""

from __future__ import annotations

import pytest

from _bench_output import assert_benchmark_json, run_quick

pytestmark = pytest.mark.ray


def test_quick_run_prints_benchmark_json():
    line = run_quick("ray_backend")
    assert_benchmark_json(line, "ray_backend")
    assert line["results"]["ray_processes_left_count"] == 0
    assert line["results"]["steps_objects_left_after_drain_max_count"] == 0
