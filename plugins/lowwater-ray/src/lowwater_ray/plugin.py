"""The plugin's hooks: the ``ray`` backend and the ``ray`` shard transport."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowwater.hookspecs import hookimpl


@hookimpl
def register_backends(register: Callable[[str, Any], None]) -> None:
    from lowwater_ray.backend import RayBackend

    register("ray", RayBackend)


@hookimpl
def register_shard_transports(register: Callable[[str, Any], None]) -> None:
    from lowwater_ray.transport import RayTransport

    register("ray", RayTransport.instance)
