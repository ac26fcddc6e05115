"""lowwater's pytest plugin (entry point ``pytest11: lowwater``), for plugin authors.

Fixtures (each runs its servers on a background Trio loop, so sync tests,
``trio.run`` tests and asyncio tests can all use them; everything is torn
down at the end of the test):

* ``lowwater_upstream`` — a scripted OpenAI/Anthropic-compatible model
  (``lowwater serve-model --scripted``); its base URL, ending in ``/v1``.
* ``lowwater_interceptor`` — a running interception server forwarding to
  ``lowwater_upstream``: :class:`InterceptorHandle` with ``open_rollout()``
  (returns a slot: ``base_url``, ``secret``) and the live ``table``.
* ``lowwater_runtime`` — a started built-in subprocess runtime (stopped at
  teardown); drive it with ``lowwater_trio.run(runtime.run, [...])``.
* ``lowwater_trio`` — the background loop itself (:class:`BackgroundTrio`).

Hypothesis strategies live in :mod:`lowwater.testing.strategies`; the runtime
conformance state machine in :mod:`lowwater.testing.runtime`.

Imports are lazy: this module is loaded by every pytest run in an
environment where lowwater is installed, and must cost nothing there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


class InterceptorHandle:
    """A running interception server for tests.

    Attributes:
        server: the :class:`lowwater.interception.InterceptionServer`.
        url: its root URL (``http://127.0.0.1:PORT``).
        table: its :class:`lowwater.InterceptTable`.
    """

    def __init__(self, loop: Any, server: Any, url: str) -> None:
        self._loop = loop
        self.server = server
        self.url = url
        self.table = server.table
        self.trajectories: dict[str, Any] = {}

    def open_rollout(self, rollout_id: str) -> Any:
        """Register a rollout; returns its slot (``base_url`` ending ``/v1``, ``secret``)."""
        from lowwater.trajectory import Trajectory

        trajectory = Trajectory(rollout_id)
        self.trajectories[rollout_id] = trajectory
        return self._loop.run_sync(self.server.register, trajectory)

    def close_rollout(self, rollout_id: str) -> int:
        """Unregister; returns how many undelivered intercepts were swept."""
        return self._loop.run_sync(self.server.unregister, rollout_id)


@pytest.fixture
def lowwater_trio() -> Iterator[Any]:
    from lowwater.testing.background import BackgroundTrio

    loop = BackgroundTrio()
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture
def lowwater_upstream(lowwater_trio: Any) -> str:
    from lowwater.serve_model import ScriptedModel, serve_model

    url = lowwater_trio.start(serve_model, ScriptedModel())
    return f"{url}/v1"


@pytest.fixture
def lowwater_interceptor(lowwater_trio: Any, lowwater_upstream: str) -> Iterator[InterceptorHandle]:
    from lowwater.interception import InterceptionServer
    from lowwater.upstream.client import ModelClient

    client = ModelClient(lowwater_upstream)
    server = InterceptionServer(client)
    url = lowwater_trio.start(server.run)
    try:
        yield InterceptorHandle(lowwater_trio, server, url)
    finally:
        lowwater_trio.run(client.aclose)


@pytest.fixture
def lowwater_runtime(lowwater_trio: Any) -> Iterator[Any]:
    from lowwater.runtime import RuntimeConfig, SubprocessRuntime

    runtime = SubprocessRuntime(RuntimeConfig())
    lowwater_trio.run(runtime.start)
    try:
        yield runtime
    finally:
        lowwater_trio.run(runtime.stop)
