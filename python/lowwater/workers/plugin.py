"""lowwater's built-in worker backend, registered like any plugin's: ``"local"``
(:class:`~lowwater.workers.backend.LocalBackend`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowwater.hookspecs import hookimpl
from lowwater.workers.backend import LocalBackend


@hookimpl
def register_backends(register: Callable[[str, Any], None]) -> None:
    register("local", LocalBackend)
