"""Registers the built-in wire protocols (an ordinary plugin of the ``lowwater`` group)."""

from __future__ import annotations

from typing import Any

from lowwater.hookspecs import hookimpl


@hookimpl
def register_protocols(register: Any) -> None:
    from lowwater.interception.protocols import builtin_protocols

    for protocol in builtin_protocols():
        register(protocol)
