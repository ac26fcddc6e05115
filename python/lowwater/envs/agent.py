"""Moved to :mod:`lowwater.harness` (public and stable); this path warns and
goes away in the next release."""

from __future__ import annotations

import warnings

from lowwater.harness import CALCULATOR_TOOL, SYSTEM_PROMPT, chat_tool_loop, run_calculator

__all__ = ["CALCULATOR_TOOL", "SYSTEM_PROMPT", "chat_tool_loop", "run_calculator"]

warnings.warn(
    "lowwater.envs.agent moved to lowwater.harness; the old path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
