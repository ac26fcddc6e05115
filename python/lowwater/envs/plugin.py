"""Registers the built-in environments (an ordinary plugin of the ``lowwater`` group)."""

from __future__ import annotations

from typing import Any

from lowwater.hookspecs import hookimpl


@hookimpl
def register_environments(register: Any) -> None:
    from lowwater.envs import default  # lazy: listing plugins stays cheap

    register("arithmetic", default.make)
