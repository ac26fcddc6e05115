"""Every benchmark's --quick run prints the JSON shape benches/README.md#output asks for.

Shapes only: the test suite never asserts a time.
"""

import pytest

from _bench_output import BENCHES, assert_benchmark_json, run_quick


@pytest.mark.parametrize(
    "name", ["tables", "trainer_steps", "scoring", "interception", "workers", "churn", "eval_gsm8k"]
)
def test_quick_run_prints_benchmark_json(name):
    if name == "eval_gsm8k" and not (BENCHES.parents[1] / "shared" / "data" / "gsm8k" / "test.jsonl").is_file():
        pytest.skip("GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)")
    assert_benchmark_json(run_quick(name), name)


def test_interception_forwarder_series_is_reported():
    # cargo is there: the README's test command builds the extension with it.
    line = run_quick("interception", "--phases", "latency", "--servers", "plane", "--forwarder")
    assert_benchmark_json(line, "interception")
    assert {"forwarder_added_latency_p50_ms", "plane_beyond_forwarder_p50_ms"} <= set(line["results"])
