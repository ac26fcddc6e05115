"""The data plane and ``serve-model`` listen with backlogs a burst of agents fits in.

Agents connect in bursts (every rollout of a group at once; 256 in the
interception bench).  With Rust std's backlog of 128 and hypercorn's 100
the accept queues overflowed and the kernel dropped or SYN-cookied
handshakes, which surfaced as 502s through the proxy.  ``ss`` reads a
listening socket's backlog (its ``Send-Q`` column) from the kernel.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import trio

from lowwater._native import DataPlane
from lowwater.serve_model import MODEL_BACKLOG, ScriptedModel, serve_model

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")


def backlog_of(port: int) -> int:
    """The backlog of the socket listening on loopback ``port`` (``ss -ltn``)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert len(rows) == 1, out
    return int(rows[0][2])


def somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def test_the_data_plane_listens_with_a_backlog_of_4096() -> None:
    plane = DataPlane("http://127.0.0.1:9/v1")
    try:
        port = int(plane.address.rsplit(":", 1)[1])
        assert backlog_of(port) == min(4096, somaxconn())
    finally:
        plane.close()


def test_serve_model_listens_with_uvicorns_backlog() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_model, ScriptedModel(), "127.0.0.1", 0)
            port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
            backlog = await trio.to_thread.run_sync(backlog_of, port)
            assert backlog == min(MODEL_BACKLOG, somaxconn()) == min(2048, somaxconn())
            nursery.cancel_scope.cancel()

    trio.run(main)
