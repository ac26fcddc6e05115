"""Moved to :mod:`lowwater.harness` (public and stable); this path warns and
goes away in the next release."""

from __future__ import annotations

import warnings

from lowwater.harness import final_answer, same_number, to_number

__all__ = ["final_answer", "same_number", "to_number"]

warnings.warn(
    "lowwater.envs.answers moved to lowwater.harness; the old path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
