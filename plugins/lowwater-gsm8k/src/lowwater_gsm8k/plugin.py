"""The plugin module named by the ``lowwater`` entry point ``gsm8k``."""

from __future__ import annotations

from typing import Any

from lowwater.hookspecs import hookimpl


@hookimpl
def register_environments(register: Any) -> None:
    from lowwater_gsm8k.env import make

    register("gsm8k", make)
