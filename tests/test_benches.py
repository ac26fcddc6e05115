"""Every benchmark's --quick run prints the JSON shape benches/README.md#output asks for.

Shapes only: the test suite never asserts a time.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
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


def run_quick(name: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(BENCHES / f"{name}.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name", ["tables", "trainer_steps", "scoring", "interception", "workers", "churn", "eval_gsm8k"]
)
def test_quick_run_prints_benchmark_json(name):
    if name == "eval_gsm8k" and not (BENCHES.parents[1] / "shared" / "data" / "gsm8k" / "test.jsonl").is_file():
        pytest.skip("GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)")
    line = run_quick(name)
    assert set(line) == {"bench", "commit", "params", "results", "targets"}
    assert line["bench"] == name and line["params"]["quick"] is True
    for key, value in line["results"].items():
        assert key.endswith(UNIT_SUFFIXES), f"{key} has no unit in its name"
        assert isinstance(value, (int, float))
    for key, t in line["targets"].items():
        assert key in line["results"] and t["value"] == line["results"][key]
        assert ("max" in t) != ("min" in t) and isinstance(t["met"], bool)
