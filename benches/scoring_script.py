"""GSM8K scorer used by benches/scoring.py: math-verify on the final answers.

``main([solution, reference]) -> "1" | "0"``: the number after the last
``A:`` line of a recorded model solution against the number after the last
``####`` line of the GSM8K reference, compared by math-verify (the real
verifier, and the real 0.5 s import a cold interpreter pays).  Thousands
separators are removed first: GSM8K writes ``1,000``, which math-verify
would read as a tuple.

Runs cold as ``python scoring_script.py SOLUTION REFERENCE`` (the result on
stdout) or warm in a lowwater warm worker (``main`` called in-process).
"""

import re
import sys

from math_verify import parse, verify


def final_answer(text: str, marker: str) -> str:
    """The text after the last line starting with ``marker``, or ``""``."""
    matches = list(re.finditer(rf"(?m)^\s*{re.escape(marker)}\s*(.*?)\s*$", text))
    return matches[-1].group(1).replace(",", "") if matches else ""


def main(argv: list[str]) -> str:
    solution, reference = argv
    predicted, gold = final_answer(solution, "A:"), final_answer(reference, "####")
    if not predicted or not gold:
        return "0"
    return "1" if verify(parse(gold), parse(predicted)) else "0"


if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1:]))
