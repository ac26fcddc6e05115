"""Registers the built-in ``subprocess`` runtime (an ordinary plugin of the ``lowwater`` group)."""

from __future__ import annotations

from typing import Any

from lowwater.hookspecs import hookimpl


@hookimpl
def register_runtimes(register: Any) -> None:
    from lowwater.runtime.subprocess import SubprocessRuntime  # lazy: listing plugins stays cheap

    register("subprocess", SubprocessRuntime)
