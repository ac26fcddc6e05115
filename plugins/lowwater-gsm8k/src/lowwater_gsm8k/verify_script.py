"""Score one GSM8K answer with math-verify: ``main([answer, reference]) -> "1" | "0"``.

A lowwater runtime script: a warm worker imports it once (math-verify's
import is the expensive part, about 0.5 s) and calls ``main`` per rollout;
cold, ``python verify_script.py ANSWER REFERENCE`` prints the same result.
Thousands separators are dropped first (math-verify would read ``1,050``
as a tuple).
"""

from __future__ import annotations

import sys

from math_verify import parse, verify


def main(argv: list[str]) -> str:
    answer, reference = (argv + ["", ""])[:2]
    gold = parse(reference.replace(",", ""), parsing_timeout=None)
    guess = parse(answer.replace(",", ""), parsing_timeout=None)
    return "1" if verify(gold, guess, timeout_seconds=None) else "0"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
