"""lowwater's built-in shard transport, registered like any plugin's: ``"http"``
(:class:`~lowwater.trainer.transport.HttpTransport`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowwater.hookspecs import hookimpl


@hookimpl
def register_shard_transports(register: Callable[[str, Any], None]) -> None:
    from lowwater.trainer.transport import HttpTransport

    register("http", HttpTransport)
