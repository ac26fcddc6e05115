"""The calculator tool: arithmetic only, bounded, never eval."""

import json
import math
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given

from lowwater.envs.calculator import CalculatorError, evaluate, format_result
from lowwater.harness import AGENT_PROGRAM, run_calculator

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "example_model_solutions.jsonl"


@pytest.mark.parametrize(
    "expr, value",
    [
        ("48/2", 24),
        ("16-3-4", 9),
        ("3*(2+1.5)", 10.5),
        ("2**10", 1024),
        ("-5+2", -3),
        ("7//2", 3),
        ("7%4", 3),
        ("250+150+1,050+180", 1630),
        (".5*4", 2),
        ("1,000,000/4", 250000),
    ],
)
def test_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os')",
        "a+1",
        "[1]*3",
        "2**1000",
        "1/0",
        "9**9**9",
        "abs(-1)",
        "x" * 300,
        "1e308*10",
        "",
        "2:15+2:38",
        "(1).real",
    ],
)
def test_refuses_everything_else(expr):
    with pytest.raises(CalculatorError):
        evaluate(expr)


@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6), st.sampled_from("+-*"))
def test_matches_python_on_integers(a, b, op):
    assert evaluate(f"{a}{op}({b})") == {"+": a + b, "-": a - b, "*": a * b}[op]


def test_format_result():
    assert [format_result(v) for v in (24, 24.0, 2.5, 1 / 3)] == ["24", "24", "2.5", "0.3333333333"]


@pytest.mark.skipif(
    not GSM8K.exists(),
    reason="GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)",
)
def test_recorded_gsm8k_annotations_mostly_agree():
    """The recorded annotations' results match the calculator except for the
    dataset's known glitches (its README: about 1 % calculator errors)."""
    total = agree = 0
    for line in GSM8K.read_text().splitlines():
        row = json.loads(line)
        for col, val in row.items():
            text = val if col == "ground_truth" else val["solution"] if isinstance(val, dict) else ""
            for ann in __import__("re").findall(r"<<([^=>]*)=([^>]*)>>", text):
                total += 1
                try:
                    got = evaluate(ann[0])
                    agree += math.isclose(float(got), float(ann[1].replace(",", "")), rel_tol=1e-3, abs_tol=1e-2)
                except (CalculatorError, ValueError):
                    pass
    assert total > 20_000 and agree / total > 0.99  # measured: 99.56 %


# --- one bounded evaluator for both agents ----------------------------------------

HOSTILE = [
    "((9**99)**99)**99",
    "(((9**99)**99)**99)**99",
    "9**99",
    "2**100",
    "(10**16)**2",
    "99999999999999999999999999999999",
    "99999999999999999999999999999*99999999999999999999999999999*999999999999999999999999999",
    "-" * 200 + "1",
    "1+" * 60 + "1",
    "(" * 300 + "1" + ")" * 300,
    "\x00",
    "1\x00+1",
]


@pytest.mark.parametrize("expr", HOSTILE)
def test_refuses_hostile_expressions_before_computing_them(expr):
    with pytest.raises(CalculatorError):
        evaluate(expr)
    assert run_calculator(json.dumps({"expression": expr})).startswith("error: ")


def test_tool_answers_and_bad_arguments():
    assert run_calculator('{"expression": "1,050 + 2**10"}') == "2074"
    assert run_calculator('{"expression": "2**-2"}') == "0.25"
    for bad in ("not json", "[1]", '"x"', "{}", "[" * 100_000, '{"expression": 1/0}'):
        assert run_calculator(bad) == "error: arguments must be a JSON object with an 'expression' string"


PROGRAM_CHILD = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("agent_program", sys.argv[1])
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)
answers = [program.calculator(json.dumps({"expression": e})) for e in json.loads(sys.stdin.read())]
assert not any(m == "lowwater" or m.startswith("lowwater.") for m in sys.modules), "the program imported lowwater"
print(json.dumps(answers))
"""


def test_the_agent_program_uses_the_same_bounded_evaluator():
    """The program agent (stdlib only, no lowwater) answers exactly as the in-process one."""
    expressions = [*HOSTILE, "48/2", "3*(2+1.5)", "250+150+1,050+180", "2**10", "x+1"]
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM_CHILD, str(AGENT_PROGRAM)],
        input=json.dumps(expressions),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout)
    assert answers == [run_calculator(json.dumps({"expression": e})) for e in expressions]
    assert all(a.startswith("error: ") for a in answers[: len(HOSTILE)])
    assert answers[len(HOSTILE) :] == ["24", "10.5", "1630", "1024", "error: unsupported element Name in arithmetic"]
