"""A Ray cluster of several nodes on one machine, for tests, benches and the
walk-through in docs/ray.md: ``ray start --head`` plus ``ray start
--address`` per extra node, each with its own ports and a custom resource
(``node1``, ``node2``...) so work can be pinned to a simulated node.

Each node is a ``ray start --block`` process of its own session: stopping it
(SIGTERM) stops every process that node started, and :meth:`LocalCluster.stop`
then checks, by pid, that none is left (never ``ray stop``, which kills every
Ray process of the machine, other users' included).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """Nodes started with the ``ray`` CLI next to this Python.

    Args:
        log_dir: where each node's ``ray start`` output goes.
        object_store_mb: each node's object store cap (MiB).
        env: extra environment for the nodes (token authentication is off
            by default here: a cluster on one machine for tests).
    """

    def __init__(self, log_dir: Path, *, object_store_mb: int = 256, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.object_store_mb = object_store_mb
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **(env or {})}
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.address = ""
        self._nodes: list[subprocess.Popen[bytes]] = []
        self._pids: set[int] = set()

    def _start(self, args: list[str], name: str, resources: dict[str, float], num_cpus: int) -> None:
        import orjson

        log = open(self.log_dir / f"{name}.log", "wb")
        argv = [
            self.ray,
            "start",
            "--block",
            *args,
            f"--num-cpus={num_cpus}",
            f"--resources={orjson.dumps(resources).decode()}",
            f"--object-store-memory={self.object_store_mb * MIB}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
        ]
        # Its own session: a Ctrl-C meant for the caller does not reach the node.
        self._nodes.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )
        log.close()

    def start_head(self, *, num_cpus: int = 2, resources: dict[str, float] | None = None) -> str:
        """Start the head node; returns its address (``IP:PORT``)."""
        port = free_port()
        self._start(
            ["--head", f"--port={port}", "--include-dashboard=false"], "head", resources or {"node1": 1}, num_cpus
        )
        self.address = f"{_node_ip()}:{port}"
        return self.address

    def add_node(self, *, num_cpus: int = 2, resources: dict[str, float] | None = None) -> None:
        """Start one more node joining the head."""
        n = len(self._nodes) + 1
        self._start([f"--address={self.address}"], f"node{n}", resources or {f"node{n}": 1}, num_cpus)

    def wait(self, nodes: int, timeout_s: float = 120.0) -> None:
        """Wait until ``nodes`` nodes are alive (the caller is connected with ``ray.init``).

        Raises:
            TimeoutError: not within ``timeout_s`` (each node's log is in :attr:`log_dir`).
        """
        import ray

        deadline = time.monotonic() + timeout_s
        while len([n for n in ray.nodes() if n.get("Alive")]) < nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nodes} Ray nodes not alive within {timeout_s} s (logs in {self.log_dir})")
            self._check_running()
            time.sleep(0.2)
        self.remember()

    def connect(self, timeout_s: float = 120.0) -> None:
        """``ray.init`` this process into the cluster, retrying while the head starts."""
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            self._check_running()
            try:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
                return
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _check_running(self) -> None:
        for node in self._nodes:
            if node.poll() is not None:
                raise RuntimeError(f"a ray start process exited with {node.returncode} (logs in {self.log_dir})")

    def remember(self) -> set[int]:
        """Record the pids of every process the nodes started so far (workers included)."""
        import psutil

        for node in self._nodes:
            try:
                root = psutil.Process(node.pid)
                self._pids |= {root.pid, *(p.pid for p in root.children(recursive=True))}
            except psutil.Error:
                pass
        return set(self._pids)

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """Stop every node (extra nodes first); returns the pids still alive
        afterwards (killed by pid; empty when the nodes stopped cleanly)."""
        import psutil

        self.remember()
        for node in reversed(self._nodes):
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in reversed(self._nodes):
            try:
                node.wait(timeout_s)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        left = []
        for pid in sorted(self._pids):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
                    proc.kill()
            except psutil.Error:
                pass
        self._nodes.clear()
        return left

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _node_ip() -> str:
    """The address Ray gives this machine's nodes (its default route's)."""
    from lowwater.http.exposure import primary_address

    return primary_address()


__all__ = ["LocalCluster", "free_port"]
