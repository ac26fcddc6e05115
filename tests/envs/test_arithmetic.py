"""The embedded default's generated problems: deterministic, solvable by the calculator."""

import re

from hypothesis import given
from hypothesis import strategies as st

from lowwater.envs.arithmetic import problem, problems
from lowwater.envs.calculator import evaluate, format_result


@given(st.integers(0, 2**32), st.integers(0, 10_000))
def test_problems_are_deterministic_and_consistent(seed, index):
    p = problem(seed, index)
    assert p == problem(seed, index)
    assert p.task_id == f"arith-{seed}-{index}"
    annotations = re.findall(r"<<([^=>]*)=([^>]*)>>", p.solution)
    assert [a for a, _ in annotations] == list(p.steps)
    assert 2 <= len(p.steps) <= 4
    for expr, value in annotations:
        assert format_result(evaluate(expr)) == value
    assert p.solution.splitlines()[-1] == f"A: {p.answer}"
    assert p.answer == annotations[-1][1]
    # Every number a step uses comes from the question or an earlier step.
    known = set(re.findall(r"\d+(?:\.\d+)?", p.question)) | {"100"}  # percentages
    for expr, value in annotations:
        assert set(re.findall(r"\d+(?:\.\d+)?", expr)) <= known, (expr, known)
        known.add(value)


def test_seeds_differ_and_stream_lazily():
    a = [p.question for p in problems(0, 20)]
    b = [p.question for p in problems(1, 20)]
    assert a != b and len(set(a)) == 20
