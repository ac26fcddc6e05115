"""The standalone data-plane process of benches/interception.py and tests/memory/test_plane_rss.py.

One process as the data plane will run, configured as ``InterceptionServer``
configures it: a :class:`lowwater._native.DataPlane` serving calls on its
tokio threads (``release_when_readable``: a call whose answer is JSON gets
its end once its record is queued), and a Trio control plane that drains
its records into one :class:`~lowwater.trajectory.Trajectory` per open
rollout (:class:`~lowwater.interception.dataplane.Records`,
:func:`~lowwater.interception.dataplane.turn_of`), applies what is queued
before it counts turns, and drops a rollout's trajectory when it closes.

Usage: ``python benches/_plane_child.py UPSTREAM [--no-trim] [--no-ack]``
(the upstream's base URL, ending ``/v1``; ``--no-trim``: the plane's
``trim_when_idle`` off, glibc keeping what a burst freed; ``--no-ack``: the
plane's ``hold_for_ack`` off and no record drained, so no Python runs per
call: the Rust side's own cost, for benches/interception.py's
``plane_no_ack`` series; its records pile up, so only for short runs).  It prints the plane's ``http://host:port`` as its first
stdout line, then serves a control channel kept off the measured path: one
JSON object per stdin line, one JSON reply per stdout line, in order:

* ``{"op": "open", "rollouts": [[rollout_id, secret], ...]}`` ->
  ``{"opened": n}``: registers each rollout and opens its trajectory.
* ``{"op": "close", "ids": [...]}`` -> ``{"closed": n, "turns": t,
  "cancelled": c}``: unregisters each rollout and drops its trajectory
  (``t`` turns were recorded in them; ``c`` calls were cancelled).
* ``{"op": "stats"}`` -> the plane's ``stats()`` and ``trajectories``
  (open), ``turns`` (recorded in all), ``orphans`` (records of rollouts
  already closed), ``heap_in_use_bytes`` (glibc's ``mallinfo2``: bytes
  allocated and not freed, mmapped blocks included; -1 without glibc) and
  ``python_objects`` (objects the garbage collector tracks): what a burst
  left allocated, told apart from pages glibc kept.

At end of input the plane is closed and the process exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys
from typing import Any

import orjson
import trio

from lowwater._native import DataPlane, TurnRecord
from lowwater.interception.dataplane import Records, turn_of
from lowwater.trajectory import Trajectory


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, loaded once, or ``None`` without it."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _Mallinfo2
    return fn


def heap_in_use_bytes() -> int:
    """Bytes glibc has handed out and not taken back (``uordblks + hblkhd``), or -1."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return -1
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def main(upstream: str, trim_when_idle: bool, ack: bool) -> None:
    # Each open rollout holds a client socket and, at the gate, an upstream one.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    plane = DataPlane(upstream, retries=0, trim_when_idle=trim_when_idle, hold_for_ack=ack, release_when_readable=True)
    trajectories: dict[str, Trajectory] = {}
    counts = {"turns": 0, "orphans": 0}

    def on_record(record: TurnRecord) -> None:
        trajectory = trajectories.get(record.rollout_id)
        if trajectory is None:
            counts["orphans"] += 1
            return
        trajectory.add_turn(turn_of(record, trajectory))
        counts["turns"] += 1

    records = Records(plane, on_record)

    def handle(request: dict) -> dict:
        op = request["op"]
        if ack:
            records.flush()  # the turns of calls already answered, before they are counted
        if op == "open":
            for rollout_id, secret in request["rollouts"]:
                plane.register(rollout_id, secret)
                trajectories[rollout_id] = Trajectory(rollout_id)
            return {"opened": len(request["rollouts"])}
        if op == "close":
            cancelled = sum(plane.unregister(rollout_id) for rollout_id in request["ids"])
            if ack:
                records.flush()  # what unregister left queued: calls it did not cancel
            turns = sum(len(trajectories.pop(rollout_id).turns) for rollout_id in request["ids"])
            return {"closed": len(request["ids"]), "turns": turns, "cancelled": cancelled}
        if op == "stats":
            return {
                **plane.stats(),
                "trajectories": len(trajectories),
                **counts,
                "heap_in_use_bytes": heap_in_use_bytes(),
                "python_objects": len(gc.get_objects()),
            }
        raise ValueError(f"unknown op {op!r}")

    async def control(cancel: trio.CancelScope) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buf = bytearray()
        while True:
            while (eol := buf.find(b"\n")) < 0:
                data = await stdin.receive_some(1 << 20)
                if not data:
                    cancel.cancel()
                    return
                buf += data
            line = bytes(buf[:eol])
            del buf[: eol + 1]
            sys.stdout.buffer.write(orjson.dumps(handle(orjson.loads(line))) + b"\n")
            sys.stdout.buffer.flush()

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            if ack:
                nursery.start_soon(records.serve)
            await control(nursery.cancel_scope)

    print(f"http://{plane.address}", flush=True)
    try:
        trio.run(run)
    finally:
        plane.close()


if __name__ == "__main__":
    main(sys.argv[1], "--no-trim" not in sys.argv[2:], "--no-ack" not in sys.argv[2:])
