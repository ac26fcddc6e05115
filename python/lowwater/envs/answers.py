"""Final-answer extraction and numeric comparison shared by the built-in rubrics.

Recorded GSM8K solutions end in ``A: N`` and GSM8K references in ``#### N``
(see ``../shared/data/gsm8k``); agents are asked for ``A: N``.  Numbers may
carry ``$``, ``%``, thousands separators or a trailing period.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def final_answer(text: str | None) -> str | None:
    """The text after the last ``A:`` or ``####`` marker line, or ``None``."""
    if not text:
        return None
    matches = list(re.finditer(r"(?m)^\s*(?:A:|####)\s*(.*?)\s*$", text))
    return matches[-1].group(1) if matches else None


def to_number(text: str | None) -> Fraction | None:
    """The first number in ``text`` as an exact fraction, or ``None``."""
    if text is None:
        return None
    match = _NUMBER.search(text.replace("$", ""))
    if match is None:
        return None
    raw = match.group(0).replace(",", "")
    try:
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


def same_number(answer: str | None, reference: str | None) -> bool:
    """True if both contain a number and the numbers are equal (exactly)."""
    a, b = to_number(answer), to_number(reference)
    return a is not None and b is not None and a == b
