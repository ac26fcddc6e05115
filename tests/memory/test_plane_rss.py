"""RSS gate: a long-lived data-plane process comes back down after bursts of open rollouts.

The process is benches/_plane_child.py: a ``DataPlane`` (Rust, its own
tokio threads) and the Trio control plane draining its records into one
trajectory per rollout, as the plane runs standalone.  This test opens
rollouts over the child's stdin/stdout and sends one call per rollout
through the plane to a *gate* upstream (benches/interception.py's, in its
own process), which holds every call until all of them are open at once,
then answers them all.
Measured in the plane's process (``/proc/PID/statm``) at rest: every
rollout closed, and the plane's stats and sockets back to what they were.

* the plane's tables are empty after each burst and every call recorded
  one turn (counts: deterministic);
* the resting RSS after a burst of ``BURST`` open rollouts stays within
  ``FIRST_BURST_BOUND`` of the resting RSS after a warm-up burst (without
  the plane's idle trim, glibc kept 255 MiB of a 16,384-rollout burst's
  freed pages; docs/dataplane.md#the-allocator);
* a second burst adds less than ``SECOND_BURST_BOUND``;
* while the second burst's calls are all held, the plane costs at most
  ``PER_OPEN_ROLLOUT_BOUND`` per open rollout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from lowwater.interception.proxy import raise_open_file_limit

from ._proc import MIB, Child, child_env, end_input_and_wait, rss_of, wait_until

pytestmark = [pytest.mark.memory, pytest.mark.timeout(1200)]

BENCHES = Path(__file__).resolve().parents[2] / "benches"
PLANE_CHILD = BENCHES / "_plane_child.py"
WARMUP = 500
BURST = 3000
#: Resting RSS after the first full burst, over the warm-up's resting RSS (bytes).
FIRST_BURST_BOUND = 16 * MIB
#: Resting RSS added by a second burst of the same size (bytes).
SECOND_BURST_BOUND = 8 * MIB
#: RSS per open rollout while the second burst's calls are all held (bytes).
#: A third of them hold an upstream connection too (the plane's concurrency
#: bound is 1,024), the rest only the agent's: 10.5 KB measured with hyper's
#: buffers on pages of their own, about 20 KB expected without (14.3 KB per
#: queued and 32.8 KB per upstream-held call on glibc's heap in
#: examples/held_alloc.rs; docs/dataplane.md#per-open-rollout).
PER_OPEN_ROLLOUT_BOUND = 14 * 1024
BODY = {"model": "m", "messages": [{"role": "user", "content": "what is 2 plus 2?"}]}
#: The plane's stats that are 0 when it holds nothing.
BUSY = ("open_rollouts", "secrets", "in_flight", "active_calls", "connections", "queued", "awaiting_ack")


class Plane:
    """The plane child and its control channel (one JSON line each way)."""

    def __init__(self, upstream: str, log: Path) -> None:
        self.log = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(PLANE_CHILD), upstream],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=child_env(),
        )
        self.url = self.proc.stdout.readline().decode().strip()
        assert self.url.startswith("http://"), f"the plane printed {self.url!r}"
        self.lock = threading.Lock()

    def call(self, request: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(orjson.dumps(request) + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, f"the plane exited with {self.proc.poll()} during {request['op']}"
        return orjson.loads(line)

    def sockets(self) -> int:
        """The plane process's open sockets (fds that close while counted are skipped)."""
        n = 0
        for fd in Path(f"/proc/{self.proc.pid}/fd").iterdir():
            try:
                n += os.readlink(fd).startswith("socket:")
            except FileNotFoundError:
                pass  # closed between the listing and the read (it failed CI so)
        return n

    def stop(self) -> None:
        end_input_and_wait(self.proc)  # the child closes the plane and exits
        self.log.close()


async def burst(plane: Plane, gate: str, n: int, tag: str) -> int:
    """``n`` rollouts, each holding one call at the closed gate until all are
    held; then released and closed.  Returns the plane's RSS while all ``n``
    calls were held, over its RSS before the rollouts opened (bytes)."""
    before = rss_of(plane.proc.pid)
    held = 0
    rollouts = [(f"{tag}-{i}", f"secret-{tag}-{i}") for i in range(n)]
    await trio.to_thread.run_sync(plane.call, {"op": "open", "rollouts": rollouts})
    async with httpx.AsyncClient(timeout=60) as control:
        assert (await control.post(gate + "/gate/hold")).status_code == 200
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    statuses: list[int] = []
    failures: list[str] = []
    async with httpx.AsyncClient(timeout=300, limits=limits) as http, trio.open_nursery() as nursery:

        async def one(secret: str) -> None:
            r = await http.post(
                plane.url + "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {secret}"}
            )
            statuses.append(r.status_code)
            if r.status_code != 200:
                failures.append(r.text[:300])

        for _, secret in rollouts:
            nursery.start_soon(one, secret)
        # Every call begun at the plane (held at the gate or waiting for an upstream slot).
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: plane.call({"op": "stats"})["in_flight"] == n, "every call open", poll_s=0.5)
        )
        held = rss_of(plane.proc.pid) - before
        async with httpx.AsyncClient(timeout=60) as control:
            assert (await control.post(gate + "/gate/release")).status_code == 200
    assert statuses.count(200) == n, (len(failures), failures[:3])
    closed = await trio.to_thread.run_sync(plane.call, {"op": "close", "ids": [r for r, _ in rollouts]})
    assert (closed["closed"], closed["turns"], closed["cancelled"]) == (n, n, 0), closed
    return held


def resting(plane: Plane, sockets: int, trims: int) -> int:
    """The plane's RSS at rest (bytes): nothing held, no more sockets than
    ``sockets``, and both of the plane's trims after the burst's closes done
    (its stats counted ``trims`` once the rollouts were closed).

    The plane trims once nothing moved for a second (no call started, no
    connection ended, no rollout closed), and again once its idle upstream
    connections could close (11 s later); the closes moved it, so two trims
    follow them.  Reading the RSS after a fixed wait instead sampled it
    before the second trim (a second burst seen as +51 MiB).
    """

    last: dict = {}

    def idle() -> dict | None:
        s = plane.call({"op": "stats"})
        last.update(s, sockets=plane.sockets(), sockets_before=sockets, trims_before=trims)
        quiet = not any(s[k] for k in BUSY) and last["sockets"] <= sockets
        return s if quiet and s["trims"] >= trims + 2 else None

    try:
        s = wait_until(idle, "the plane at rest", poll_s=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {last}") from None
    assert (s["trajectories"], s["orphans"]) == (0, 0), s
    time.sleep(0.5)
    samples = []
    for _ in range(3):
        samples.append(rss_of(plane.proc.pid))
        time.sleep(0.2)
    return min(samples)


def describe(f: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in f.items())


def test_plane_rests_near_its_baseline_after_bursts(tmp_path, record_property):
    raise_open_file_limit()  # BURST client sockets and the gate's 1024 upstream ones
    figures: dict[str, int] = {}
    held: dict[str, int] = {}

    # The gate upstream of benches/interception.py, in its own process: it
    # answers at once, or holds every call between /gate/hold and /gate/release.
    gate = Child([str(BENCHES / "interception.py"), "--_gate-child"], tmp_path / "gate.log", stdout_pipe=True)
    gate_url = gate.proc.stdout.readline().decode().strip()
    assert gate_url.startswith("http://"), gate_url
    plane = Plane(gate_url + "/v1", tmp_path / "plane.log")

    async def main() -> None:
        plane.call({"op": "stats"})  # its Trio loop runs (and holds its wakeup sockets)
        sockets = plane.sockets()
        figures["start"] = rss_of(plane.proc.pid)
        for tag, n in (("warm", WARMUP), ("first", BURST), ("second", BURST)):
            held[tag] = await burst(plane, gate_url, n, tag)
            # Read after the closes: the trims that ran while the client was
            # still reading its answers (CI's was slow enough for both) came
            # before its connections and the rollouts were freed.
            trims = plane.call({"op": "stats"})["trims"]
            figures[tag] = await trio.to_thread.run_sync(resting, plane, sockets, trims)

    try:
        trio.run(main)
    finally:
        plane.stop()
        gate.stop()
    per_open = held["second"] / BURST
    record_property("rss", describe(figures) + f"; {per_open:.0f} bytes per open rollout")
    assert figures["first"] - figures["warm"] <= FIRST_BURST_BOUND, describe(figures)
    assert figures["second"] - figures["first"] <= SECOND_BURST_BOUND, describe(figures)
    assert per_open <= PER_OPEN_ROLLOUT_BOUND, f"{per_open:.0f} bytes per open rollout; {describe(figures)}"
