"""``lowwater proxy`` under test: in this process over a scripted upstream
(:func:`with_proxy`), or as the command in a child process (:func:`proxy_process`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from lowwater.http import serve
from lowwater.interception.proxy import ProxyConfig, serve_proxy
from lowwater.trainer.sessions import SessionConfig

from ._harness import GUARD_S
from .upstream import Upstream

ADMIN = {"x-api-key": "adm"}
#: ``python -c MAIN proxy ...`` runs the ``lowwater`` command.
MAIN = "import sys; from lowwater import cli; sys.exit(cli.main(sys.argv[1:]))"


async def with_proxy(
    tmp_path: Any, fn: Callable[[str, httpx.AsyncClient], Awaitable[None]], upstream: Any = None, **config: Any
) -> None:
    """``await fn(url, http)`` against an in-process proxy writing to ``tmp_path``.

    The proxy forwards to ``upstream`` (an ASGI app; a scripted
    :class:`Upstream` by default) with admin key ``adm`` (``http`` sends it),
    no retries and sessions on; ``config`` adds or replaces ``ProxyConfig``
    fields.  After ``fn`` the proxy shuts down (its open rollouts are written)
    while the upstream still runs; all of it under the :data:`GUARD_S` deadline.
    """
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve, upstream or Upstream())
        fields = {"admin_key": "adm", "retries": 0, "sessions": SessionConfig()} | config
        proxy_config = ProxyConfig(upstream=f"http://{address}/v1", port=0, out_dir=tmp_path, **fields)
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as proxy_nursery:
                url = await proxy_nursery.start(serve_proxy, proxy_config)
                async with httpx.AsyncClient(timeout=GUARD_S, headers=ADMIN) as http:
                    await fn(url, http)
                proxy_nursery.cancel_scope.cancel()  # shutdown: open rollouts are written
        nursery.cancel_scope.cancel()


@attrs.define
class ProxyProcess:
    process: trio.Process
    url: str
    http: httpx.AsyncClient  # sends the admin key, if the environment named one
    stderr: bytes  # what the proxy wrote to stderr so far (its banner, at first)

    async def open(self, rollout_id: str | None = None) -> dict[str, Any]:
        """Open a rollout (named ``rollout_id``, or by the proxy): the admin
        answer (``rollout_id``, ``base_url``, ``api_key``)."""
        body = None if rollout_id is None else {"rollout_id": rollout_id}
        return (await self.http.post(f"{self.url}/lowwater/rollouts", json=body)).json()

    async def call(self, opened: dict[str, Any], request: dict[str, Any]) -> httpx.Response:
        """POST the chat ``request`` through the slot of the rollout ``opened``."""
        return await self.http.post(
            opened["base_url"] + "/chat/completions",
            json=request,
            headers={"authorization": f"Bearer {opened['api_key']}"},
        )

    async def terminate(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum`` to the proxy and wait for it; the rest of its stderr
        is added to ``stderr``.  Returns its exit status."""
        self.process.send_signal(signum)
        status = await self.process.wait()
        while chunk := await self.process.stderr.receive_some():
            self.stderr += chunk
        return status


@asynccontextmanager
async def proxy_process(
    args: list[str], env: dict[str, str], *, banner_lines: int = 1, **popen: Any
) -> AsyncIterator[ProxyProcess]:
    """``lowwater proxy ARGS --listen 127.0.0.1:0`` as a child process with
    environment ``env`` (``LOWWATER_ADMIN_KEY`` in it is sent as the admin
    key), yielded once its stderr holds the whole ``listening on`` line and at
    least ``banner_lines`` lines; ``popen`` goes to ``trio.lowlevel.open_process``.
    Killed on exit if still running; the body runs under the :data:`GUARD_S`
    deadline."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", MAIN, "proxy", *args, "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        env=env,
        **popen,
    )
    try:
        with trio.fail_after(GUARD_S):
            err = b""
            while b"listening on" not in err or not err.endswith(b"\n") or err.count(b"\n") < banner_lines:
                err += await process.stderr.receive_some()
            url = err.split(b"listening on ")[1].split(b" ")[0].decode()
            key = env.get("LOWWATER_ADMIN_KEY")
            async with httpx.AsyncClient(timeout=GUARD_S, headers={"x-api-key": key} if key else {}) as http:
                yield ProxyProcess(process, url, http, err)
    finally:
        if process.returncode is None:
            process.kill()
        await process.stderr.aclose()
