"""pass@k (Chen et al. 2021's unbiased estimator), pass^k, the clustered
standard error and the bounded error-message counter."""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.metrics import (
    MAX_MESSAGES,
    ErrorMessages,
    TaskCounts,
    binary_stderr,
    interval95,
    pass_at_k,
    pass_hat_k,
)


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_the_combinatorial_definition(nck):
    n, c, k = nck
    # Exhaustive: the share of k-subsets of the n samples holding a correct one.
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_hat_k(n, c, k) == pytest.approx(sum(all(s) for s in subsets) / len(subsets))


def test_pass_at_k_is_stable_for_large_n():
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)
    assert 0.0 <= pass_at_k(10_000, 5000, 100) <= 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_stderr_and_interval():
    assert binary_stderr(4, 2) == pytest.approx(math.sqrt(0.25 / 3))
    assert binary_stderr(1, 1) is None and interval95(0.5, None) is None
    low, high = interval95(0.5, 0.1)
    assert low == pytest.approx(0.304) and high == pytest.approx(0.696)
    assert interval95(0.99, 0.1)[1] == 1.0
    counts = TaskCounts()
    for task, correct in [(0, True), (0, False), (1, True), (1, True)]:
        counts.add(task, correct)
    assert counts.pass_at(1) == pytest.approx(0.75) and counts.pass_at(2) == pytest.approx(1.0)
    assert counts.pass_hat(2) == pytest.approx(0.5)
    assert counts.stderr() == pytest.approx(0.25)  # stdev(0.5, 1.0) / sqrt(2)


def test_error_messages_are_bounded_and_ranked():
    messages = ErrorMessages()
    for _ in range(3):
        messages.add("infra", "no openai package")
    for i in range(MAX_MESSAGES + 50):
        messages.add("model", f"HTTP 404 on call {i}")
    assert len(messages.counts) <= MAX_MESSAGES + 1
    top = messages.top(2)
    # the messages seen once the counter was full
    assert top[0] == {"class": "model", "message": "(other messages)", "count": 51}
    assert top[1] == {"class": "infra", "message": "no openai package", "count": 3}


def test_group_runs_report_pass_at_k_and_an_interval(tmp_path):
    report = trio.run(run_eval, EvalConfig(rollouts=3, group_size=2, out=tmp_path / "g.jsonl"))
    s = report.summary
    assert s["tasks"] == 3 and s["pass_at_k"] == {"1": 1.0, "2": 1.0} and s["pass_hat_k"] == {"1": 1.0, "2": 1.0}
    assert s["accuracy_stderr"] == 0.0 and s["accuracy_ci95"] == [1.0, 1.0]
    single = trio.run(run_eval, EvalConfig(rollouts=3, out=tmp_path / "s.jsonl")).summary
    assert single["pass_at_k"] is None and single["tasks"] == 3
