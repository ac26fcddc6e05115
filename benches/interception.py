"""The interception proxy and the Rust data plane against calling the model server directly, same load generator, same run.

Child processes: ``lowwater serve-model --scripted`` (the upstream),
``lowwater proxy`` in front of it, the data plane in front of it
(benches/_plane_child.py: a ``DataPlane`` with the Trio control plane
draining its records into one trajectory per rollout, the rollouts opened
and closed over the child's stdin/stdout, off the measured path), and for
the hold-open phase a *gate* upstream (this script in ``--_gate-child``
mode) that holds every request until released, with a proxy and a plane in
front of it.  ``--servers`` picks the series beside direct (default both);
``--previous CHECKOUT`` adds a third, the ``lowwater proxy`` of a commit
before the data plane (the Python server on the call path), for the
side-by-side.  ``--forwarder`` adds a minimal hyper forwarder
(``rust/dataplane/examples/forwarder.rs``, built with cargo) to the latency
phase: the cost of an extra loopback hop on this host, on the plane's own
HTTP stack, with none of lowwater's work.  ``--plane-no-ack`` adds the
plane with no control plane on the answer's path (``hold_for_ack`` off, no
record drained) to the latency phase: the Rust side's own cost, so the
plane's added latency splits into the hop, the Rust work and the control
plane's wakeup and ack.  The load generator (this process) is a minimal raw-socket
HTTP/1.1 client on Trio, so the figures measure the servers, not a heavy
client; it sends non-streamed chat completions.

* **Added latency** at concurrency 1: sequential calls on one keep-alive
  connection, direct and through the proxy, alternating call by call in a
  shuffled order (seeded), in rounds; p50 and p99 of each, and the
  difference.  With ``--forwarder`` also the
  forwarder's, and the plane's p50 beyond it (what lowwater's work per call
  adds over the hop).  With ``--plane-no-ack`` also the plane without its
  control plane on the answer's path, and the plane's p50 beyond it (what
  holding the answer for the ack costs).
* **Throughput** at concurrency ``--concurrency`` (one rollout and one
  connection per worker): turns/s direct and through the proxy,
  interleaved rounds, medians, and their ratio.
* **Hold-open**: ``--rollouts`` rollouts opened through the admin API,
  each sends one call to the proxy in front of the gate, so every call is
  held open (1024 at the gate, the rest in the proxy's upstream limiter).
  Once the proxy reports all of them waiting, the gate is released.
  Reported: seconds until all were open, seconds from release to the first
  response and to the last, failures, and the proxy's current RSS
  (baseline, with every call open, after closing every rollout), giving
  RSS per open rollout.  The plane goes through the same burst twice
  (``plane_`` keys): resting RSS is read once the plane reports no
  connection, call or record left and its process holds no more sockets
  than at baseline (the idle upstream connections closed), and the
  second burst's resting RSS minus the first's is what a burst leaves.
* **Interceptor hooks** (``--phases interceptor``): the same sequential
  calls through two proxies, one plain and one with a trivial
  ``intercept_request`` and ``intercept_response`` installed, alternating
  call by call; p50/p99 of each and the difference (the hooks' cost; the
  plain proxy is the "no interceptor" side, where the path is skipped).

With ``--history-kib N`` the latency, throughput and interceptor phases send
a long rollout's request instead (N KiB of earlier turns resent every call,
:func:`with_history`): what the plane's parse, hashes, body table and copy
cost per byte.  Its figures are reported, not judged (the latency and
throughput targets are for the default 191-byte request).

Usage: ``python benches/interception.py [--quick] [--latency-calls 2000]
[--concurrency 256] [--calls-per-worker 20] [--rounds 2] [--rollouts 16384]
[--phases latency,throughput,hold,interceptor] [--servers proxy,plane]
[--plane-env NAME=VALUE] [--plane-no-trim] [--previous CHECKOUT]
[--forwarder] [--plane-no-ack] [--history-kib N]``.
The last stdout line is the JSON object benches/README.md#output describes.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import trio

sys.path.insert(0, str(Path(__file__).parent))
from _common import MIB, emit, params_of, progress, rss_bytes, target

ADMIN_KEY = "bench-admin"
# The seed of the latency phases' per-cycle order of the sides (alternating_round).
ORDER_SEED = 20261127
# The proxy's entry point (a variable so a diagnostic driver can wrap it):
# main() with no argv, as the `lowwater` script calls it, so the proxy
# re-executes itself on glibc's allocator as it does for users
# (lowwater.commands.allocator; the -c code runs again in the new image).
PROXY_MAIN = "import sys; from lowwater import cli; sys.exit(cli.main())"
# The proxy with a trivial interceptor on each hook (lowwater proxy loads no
# plugins, so the child installs them on every server it builds).
HOOKED_PROXY_MAIN = """
import sys
from lowwater import cli
from lowwater.interception import server as s
from lowwater.interception.hooks import Interceptors

async def on_request(call):
    pass

async def on_response(call, response):
    pass

_init = s.InterceptionServer.__init__

def _hooked(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.interceptors = Interceptors([("bench", on_request, ("call",))], [("bench", on_response, ("call", "response"))])

s.InterceptionServer.__init__ = _hooked
sys.exit(cli.main())
"""
REQUEST = orjson.dumps(
    {
        "model": "bench",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Answer briefly."},
            {"role": "user", "content": "Tell me something about the weather on a quiet afternoon."},
        ],
    }
)

# The body of the latency, throughput and interceptor phases' calls: REQUEST,
# or with --history-kib a long rollout's (main() sets it).
CALL = REQUEST


def with_history(history_bytes: int) -> bytes:
    """REQUEST with at least ``history_bytes`` of earlier turns between its
    system and user messages: alternating user and assistant messages of
    about 50 KB of text each, as a long agent rollout resends its whole
    history every call (the plane parses, hashes, holds and forwards it)."""
    request = orjson.loads(REQUEST)
    system, user = request["messages"]
    history: list[dict] = []
    while sum(len(m["content"]) for m in history) < history_bytes:
        role = "assistant" if len(history) % 2 else "user"
        words = min(10_000, max(1, (history_bytes - sum(len(m["content"]) for m in history)) // 5))
        history.append({"role": role, "content": "word " * words})
    request["messages"] = [system, *history, user]
    return orjson.dumps(request)


# --- the load generator: a minimal HTTP/1.1 client ---------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection; requests are sent one at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stream: trio.SocketStream | None = None
        self.buf = bytearray()
        self.closing = False

    async def connect(self) -> None:
        self.stream = await trio.open_tcp_stream(self.host, self.port)

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: bytes = b"", *, idempotent: bool = False
    ) -> tuple[int, bytes]:
        if self.closing:
            await self.aclose()
            self.stream, self.closing = None, False
            self.buf.clear()
        if self.stream is None:
            await self.connect()
        assert self.stream is not None
        head = (
            (
                f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n"
            ).encode()
            + headers
            + b"\r\n"
        )
        try:
            await self.stream.send_all(head + body)
            return await self._response()
        except (ConnectionError, trio.BrokenResourceError):
            # A keep-alive connection idle past the server's keep-alive timeout
            # (hypercorn: 5 s) is closed under us; a GET that got no reply is
            # safe to send again on a fresh connection, as HTTP clients do;
            # so are the gate's POSTs (a slow flood left the gate's control
            # connection idle past 5 s and its release was lost).
            if not (idempotent or method == "GET") or self.buf:
                raise
            await self.aclose()
            self.buf.clear()
            await self.connect()
            await self.stream.send_all(head + body)
            return await self._response()

    async def _fill(self) -> None:
        assert self.stream is not None
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    async def _response(self) -> tuple[int, bytes]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
        status = int(lines[0].split(b" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        if headers.get(b"connection", b"").lower() == b"close":
            # hypercorn closes a connection after keep_alive_max_requests (1000): reconnect next time.
            self.closing = True
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            while len(self.buf) < n:
                await self._fill()
            body = bytes(self.buf[:n])
            del self.buf[:n]
            return status, body
        chunks = []  # chunked
        while True:
            while (eol := self.buf.find(b"\r\n")) < 0:
                await self._fill()
            size = int(bytes(self.buf[:eol]).split(b";")[0], 16)
            while len(self.buf) < eol + 2 + size + 2:
                await self._fill()
            chunks.append(bytes(self.buf[eol + 2 : eol + 2 + size]))
            del self.buf[: eol + 2 + size + 2]
            if size == 0:
                return status, b"".join(chunks)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return host, int(port)


class Target:
    """Where calls go: the upstream directly, or the proxy with a rollout's key."""

    def __init__(self, url: str, path: str) -> None:
        self.host, self.port = split_url(url)
        self.path = path


async def admin(conn: Conn, method: str, path: str, body: bytes = b"") -> dict:
    status, raw = await conn.request(method, path, body, f"authorization: Bearer {ADMIN_KEY}\r\n".encode())
    if status != 200:
        raise RuntimeError(f"admin {method} {path}: {status} {raw[:200]!r}")
    return orjson.loads(raw)


async def open_rollouts(proxy_url: str, n: int, workers: int = 32) -> list[dict]:
    host, port = split_url(proxy_url)
    out: list[dict] = []

    async def worker(count: int) -> None:
        conn = Conn(host, port)
        for _ in range(count):
            out.append(await admin(conn, "POST", "/lowwater/rollouts"))
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(workers):
            nursery.start_soon(worker, n // workers + (i < n % workers))
    return out


async def close_rollouts(proxy_url: str, rollouts: list[dict], workers: int = 32) -> None:
    host, port = split_url(proxy_url)
    pending = list(rollouts)

    async def worker() -> None:
        conn = Conn(host, port)
        while pending:
            await admin(conn, "DELETE", f"/lowwater/rollouts/{pending.pop()['rollout_id']}")
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)


class ProxyRollouts:
    """Rollouts of a ``lowwater proxy``: opened and closed through its admin API."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def open(self, n: int) -> list[dict]:
        return await open_rollouts(self.url, n)

    async def close(self, rollouts: list[dict]) -> None:
        await close_rollouts(self.url, rollouts)


class PlaneChild:
    """The data-plane process (benches/_plane_child.py) and its control channel.

    Control messages go over the child's stdin/stdout, one JSON line each
    way, from a worker thread (:meth:`acall`) so the load generator's Trio
    loop keeps running while the child answers.
    """

    def __init__(self, upstream: str, env: dict[str, str] | None = None, trim: bool = True, ack: bool = True) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).parent / "_plane_child.py"),
                upstream,
                *([] if trim else ["--no-trim"]),
                *([] if ack else ["--no-ack"]),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("http://"):
            self.proc.kill()
            raise RuntimeError(f"the plane child did not report a URL: {line!r}")
        self.url = line.strip()
        self.pid = self.proc.pid
        self.lock = threading.Lock()
        self.serial = 0

    def call(self, request: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(orjson.dumps(request) + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the plane child exited ({self.proc.poll()}) during {request['op']}")
        return orjson.loads(line)

    async def acall(self, request: dict) -> dict:
        return await trio.to_thread.run_sync(self.call, request)

    async def open(self, n: int) -> list[dict]:
        rollouts = []
        for _ in range(n):
            self.serial += 1
            rollouts.append({"rollout_id": f"bench-{self.serial}", "api_key": f"lw-{secrets.token_hex(16)}"})
        await self.acall({"op": "open", "rollouts": [[r["rollout_id"], r["api_key"]] for r in rollouts]})
        return rollouts

    async def close(self, rollouts: list[dict]) -> dict:
        return await self.acall({"op": "close", "ids": [r["rollout_id"] for r in rollouts]})

    def stop(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()  # end of input: the child closes its plane and exits
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def sockets_of(pid: int) -> int:
    """Sockets process ``pid`` holds open (its ``/proc/PID/fd`` links to ``socket:``)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed while listing
            pass
    return count


def auth(rollout: dict | None) -> bytes:
    return f"authorization: Bearer {rollout['api_key']}\r\n".encode() if rollout else b""


# --- phases ---------------------------------------------------------------------------


async def alternating_round(
    sides: dict[str, tuple[Target, dict | None]], calls: int, rng: random.Random
) -> dict[str, list[float]]:
    """``calls`` sequential calls per side (ms each), alternating call by call
    between the sides (each ``(target, rollout or None for no proxy)``), so
    every series sees the same moments of a noisy host (blocks of 1000 each
    way put host slowdowns on one side: added p50 read 2.18 and 3.04 ms in two
    runs an hour apart).  Each cycle visits the sides in a fresh order from
    ``rng``: in a fixed order a side's periodic background work lands at the
    same point of every cycle, so it is charged to the same side every time
    (the plane drains its records 5 ms after a call, about one cycle of five
    sides: in ten runs of 2026-11-27 in a fixed order the plane added
    0.30-0.40 ms p50 and the same plane with its records left queued
    0.16-0.24; in five shuffled runs 0.23-0.29 and 0.22-0.30)."""
    conns = {k: (Conn(t.host, t.port), t.path, auth(r)) for k, (t, r) in sides.items()}
    out: dict[str, list[float]] = {k: [] for k in sides}
    order = list(conns)
    for i in range(calls + 5):
        rng.shuffle(order)
        for side in order:
            conn, path, headers = conns[side]
            t0 = time.perf_counter()
            status, _ = await conn.request("POST", path, CALL, headers)
            if i >= 5:  # the first calls warm the connections
                out[side].append((time.perf_counter() - t0) * 1000)
            assert status == 200, status
    for conn, _, _ in conns.values():
        await conn.aclose()
    return out


async def latency_percentiles(
    sides: dict[str, tuple[str, ProxyRollouts | PlaneChild | None]], rounds: int, calls: int
) -> dict[str, list[float]]:
    """Per side ``(base url, its rollouts' opener or None for direct calls)``,
    the 99 percentiles (ms; ``[49]`` is p50, ``[98]`` p99) of ``calls``
    alternating chat calls, made in ``rounds`` rounds on fresh connections;
    through a proxy or plane on one rollout, opened first and closed after.
    The sides' order in each cycle is shuffled with a fixed seed
    (:data:`ORDER_SEED`), so reruns visit them alike."""
    rng = random.Random(ORDER_SEED)
    rollouts = {side: (await ctl.open(1))[0] if ctl else None for side, (_, ctl) in sides.items()}
    targets = {side: (Target(url, "/v1/chat/completions"), rollouts[side]) for side, (url, _) in sides.items()}
    lat: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, times in (await alternating_round(targets, calls // rounds, rng)).items():
            lat[side] += times
    for side, (_, ctl) in sides.items():
        if ctl:
            await ctl.close([rollouts[side]])
    return {k: statistics.quantiles(v, n=100) for k, v in lat.items()}


async def throughput_round(target: Target, rollouts: list[dict | None], calls_per_worker: int) -> float:
    conns = [Conn(target.host, target.port) for _ in rollouts]
    for i in range(0, len(conns), 32):  # connect before timing, in batches (listen backlogs are small)
        async with trio.open_nursery() as nursery:
            for c in conns[i : i + 32]:
                nursery.start_soon(c.connect)

    async def worker(conn: Conn, rollout: dict | None) -> None:
        headers = auth(rollout)
        for _ in range(calls_per_worker):
            status, _ = await conn.request("POST", target.path, CALL, headers)
            assert status == 200, status

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for conn, rollout in zip(conns, rollouts):
            nursery.start_soon(worker, conn, rollout)
    elapsed = time.perf_counter() - t0
    for c in conns:
        await c.aclose()
    return len(conns) * calls_per_worker / elapsed


async def flood(
    host: str, port: int, rollouts: list[dict], all_held: Callable[[], Awaitable[bool]], gate: Conn
) -> tuple[list[tuple[int, float]], float]:
    """One call per rollout to ``host:port``, each on its own connection,
    held at the closed gate; once ``all_held()`` (polled every 0.25 s) says
    the server holds every call, the gate is released.  Returns each call's
    ``(status, seconds from the release to its response)`` (status 0: the
    connection broke) and the seconds until every call was held."""
    conns = [Conn(host, port) for _ in rollouts]
    results: list[tuple[int, float]] = []
    released = trio.Event()
    t_release = 0.0

    async def agent(conn: Conn, rollout: dict, sent: trio.CapacityLimiter) -> None:
        async with sent:  # bound concurrent connects, not open calls
            await conn.connect()
            assert conn.stream is not None
            body = REQUEST
            head = (
                (
                    f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n"
                ).encode()
                + auth(rollout)
                + b"\r\n"
            )
            await conn.stream.send_all(head + body)
        try:
            status, _ = await conn._response()
        except (ConnectionError, trio.BrokenResourceError):
            status = 0
        results.append((status, time.perf_counter() - t_release if released.is_set() else -1.0))
        await conn.aclose()

    t_flood = time.perf_counter()
    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(256)
        for conn, rollout in zip(conns, rollouts):
            nursery.start_soon(agent, conn, rollout, limiter)
        while True:  # until the server holds every call
            await trio.sleep(0.25)
            if await all_held():
                all_open_s = time.perf_counter() - t_flood
                break
        progress(f"  all {len(rollouts)} calls open after {all_open_s:.1f} s; releasing the gate")
        t_release = time.perf_counter()
        released.set()
        await gate.request("POST", "/gate/release", idempotent=True)
    return results, all_open_s


async def proxy_burst(proxy_url: str, gate: Conn, proxy_pid: int, n: int) -> dict:
    """One hold-open burst of ``n`` rollouts through a ``lowwater proxy``;
    figures of this burst, RSS in bytes (``base`` before it, ``resting``
    after it)."""
    host, port = split_url(proxy_url)
    ctl = Conn(host, port)
    await gate.request("POST", "/gate/hold", idempotent=True)
    rss_base = rss_bytes(proxy_pid)
    t_open = time.perf_counter()
    rollouts = await open_rollouts(proxy_url, n)
    open_s = time.perf_counter() - t_open
    rss_registered = rss_bytes(proxy_pid)
    progress(f"  {n} rollouts opened in {open_s:.1f} s; sending one call each")

    async def all_held() -> bool:
        nonlocal rss_open, held_intercepts
        stats = await admin(ctl, "GET", "/lowwater/stats")
        if stats["waiting_handlers"] < n:
            return False
        rss_open = rss_bytes(proxy_pid)
        held_intercepts = stats["intercepts"]["entries"]
        return True

    rss_open = held_intercepts = 0
    results, all_open_s = await flood(host, port, rollouts, all_held, gate)
    done = [t for status, t in results if status == 200]
    rss_peak = max(rss_open, rss_bytes(proxy_pid))
    await close_rollouts(proxy_url, rollouts)
    # Resting: once the data plane's two trims after the burst have run (one
    # when it went quiet, one once the idle upstream connections could
    # close) and the proxy's own trim after the closes; bounded, as a trim
    # that came before the counters were read would not be seen again.  A
    # proxy before the data plane (--previous) has only its own trim.
    before = await admin(ctl, "GET", "/lowwater/stats")
    with trio.move_on_after(30):
        while True:
            stats = await admin(ctl, "GET", "/lowwater/stats")
            plane_trimmed = "plane" not in stats or stats["plane"]["trims"] >= before["plane"]["trims"] + 2
            if plane_trimmed and stats["trims"] > before["trims"]:
                break
            await trio.sleep(0.5)
    await trio.sleep(1.5)
    stats = await admin(ctl, "GET", "/lowwater/stats")
    await ctl.aclose()
    return {
        "open_s": open_s,
        "all_open_s": all_open_s,
        "held_intercepts": held_intercepts,
        "first_s": min(done) if done else float("nan"),
        "all_s": max(done) if done else float("nan"),
        "failed": n - len(done),
        "base": rss_base,
        "registered": rss_registered,
        "open": rss_open,
        "peak": rss_peak,
        "resting": rss_bytes(proxy_pid),
        "intercepts_after": stats["intercepts"]["entries"],
        "in_flight_after": stats["plane"]["in_flight"] if "plane" in stats else stats["waiting_handlers"],
    }


async def hold_open(proxy_url: str, gate_url: str, proxy_pid: int, n: int, prefix: str = "") -> dict:
    """Two hold-open bursts through a ``lowwater proxy`` (the first after one
    warm-up call); ``{prefix}hold_`` figures: the first burst's, and what the
    second adds."""
    host, port = split_url(proxy_url)
    gate = Conn(*split_url(gate_url))
    warm = await open_rollouts(proxy_url, 1)
    assert (await Conn(host, port).request("POST", "/v1/chat/completions", REQUEST, auth(warm[0])))[0] == 200
    await close_rollouts(proxy_url, warm)
    first = await proxy_burst(proxy_url, gate, proxy_pid, n)
    progress(f"  first burst: resting {first['resting'] / MIB:.1f} MiB (baseline {first['base'] / MIB:.1f})")
    second = await proxy_burst(proxy_url, gate, proxy_pid, n)
    progress(f"  second burst: resting {second['resting'] / MIB:.1f} MiB")
    await gate.aclose()
    figures = {
        "hold_rollouts_count": n,
        "hold_open_rollouts_s": first["open_s"],
        "hold_all_calls_open_s": first["all_open_s"],
        "hold_intercepts_held_count": first["held_intercepts"],
        "hold_first_response_s": first["first_s"],
        "hold_all_complete_s": first["all_s"],
        "hold_failed_count": first["failed"] + second["failed"],
        "hold_second_first_response_s": second["first_s"],
        "hold_rss_per_open_rollout_bytes": (first["open"] - first["base"]) / n,
        "hold_rss_per_registered_rollout_bytes": (first["registered"] - first["base"]) / n,
        "hold_intercepts_after_close_count": first["intercepts_after"] + second["intercepts_after"],
        "hold_calls_in_flight_after_close_count": first["in_flight_after"] + second["in_flight_after"],
        "rss_baseline_mb": first["base"] / MIB,
        "rss_peak_mb": max(first["peak"], second["peak"]) / MIB,
        "rss_resting_mb": first["resting"] / MIB,
        "rss_resting_after_second_burst_mb": second["resting"] / MIB,
        "hold_rss_resting_minus_baseline_bytes": first["resting"] - first["base"],
        "hold_second_burst_added_bytes": second["resting"] - first["resting"],
    }
    return {prefix + key: value for key, value in figures.items()}


async def plane_burst(plane: PlaneChild, gate: Conn, n: int, trim: bool) -> dict:
    """One hold-open burst of ``n`` rollouts through the plane (``trim``: the
    plane's ``trim_when_idle`` is on); figures of this burst, RSS in bytes
    (``base`` before it, ``resting`` after it)."""
    host, port = split_url(plane.url)
    await gate.request("POST", "/gate/hold", idempotent=True)
    heap_base = (await plane.acall({"op": "stats"}))["heap_in_use_bytes"]
    rss_base = rss_bytes(plane.pid)
    sockets_base = sockets_of(plane.pid)
    t_open = time.perf_counter()
    rollouts = await plane.open(n)
    open_s = time.perf_counter() - t_open
    rss_registered = rss_bytes(plane.pid)
    progress(f"  {n} rollouts opened in {open_s:.1f} s; sending one call each")
    rss_open = 0

    async def all_held() -> bool:
        nonlocal rss_open
        if (await plane.acall({"op": "stats"}))["in_flight"] < n:
            return False
        rss_open = rss_bytes(plane.pid)
        return True

    results, all_open_s = await flood(host, port, rollouts, all_held, gate)
    done = [t for status, t in results if status == 200]
    rss_peak = max(rss_open, rss_bytes(plane.pid))
    closed = await plane.close(rollouts)
    # Resting: the plane holds no connection, call or record, and its process
    # no more sockets than before the burst (the idle upstream connections
    # close up to twice their 5 s idle timeout after their last call); with
    # trim_when_idle, once the plane's second trim after the burst (a quiet
    # second after the last call, then after the upstream connections could
    # close) has run.  Bounded: a trim that came before `trims` was read is
    # not waited for twice.
    trims = (await plane.acall({"op": "stats"}))["trims"]
    settled = {}
    with trio.move_on_after(60):
        while True:
            settled = await plane.acall({"op": "stats"})
            busy = [settled[k] for k in ("connections", "active_calls", "in_flight", "queued", "awaiting_ack")]
            if not any(busy) and sockets_of(plane.pid) <= sockets_base:
                break
            await trio.sleep(0.5)
    with trio.move_on_after(30 if trim else 0):
        while (await plane.acall({"op": "stats"}))["trims"] < trims + 2:
            await trio.sleep(0.5)
    await trio.sleep(1.0)
    samples = []
    for _ in range(3):
        samples.append(rss_bytes(plane.pid))
        await trio.sleep(0.2)
    rested = await plane.acall({"op": "stats"})
    return {
        "heap_base": heap_base,
        "heap": rested["heap_in_use_bytes"],
        "objects": rested["python_objects"],
        "open_s": open_s,
        "all_open_s": all_open_s,
        "first_s": min(done) if done else float("nan"),
        "all_s": max(done) if done else float("nan"),
        "failed": n - len(done),
        "turns": closed["turns"],
        "base": rss_base,
        "registered": rss_registered,
        "open": rss_open,
        "peak": rss_peak,
        "resting": min(samples),
        "sockets_left": sockets_of(plane.pid) - sockets_base,
        "settled": settled,
    }


async def hold_plane(plane: PlaneChild, gate_url: str, n: int, trim: bool = True) -> dict:
    """Two hold-open bursts through the plane (the first after one warm-up
    call); ``plane_`` figures: the first burst's, and what the second adds."""
    gate = Conn(*split_url(gate_url))
    warm = await plane.open(1)
    assert (await Conn(*split_url(plane.url)).request("POST", "/v1/chat/completions", REQUEST, auth(warm[0])))[0] == 200
    await plane.close(warm)
    first = await plane_burst(plane, gate, n, trim)
    progress(
        f"  first burst: resting {first['resting'] / MIB:.1f} MiB (baseline {first['base'] / MIB:.1f});"
        f" heap in use {first['heap'] / MIB:.2f} MiB, {first['objects']} Python objects"
    )
    second = await plane_burst(plane, gate, n, trim)
    progress(
        f"  second burst: resting {second['resting'] / MIB:.1f} MiB;"
        f" heap in use {second['heap'] / MIB:.2f} MiB, {second['objects']} Python objects"
    )
    await gate.aclose()
    s = first["settled"]
    return {
        "plane_hold_open_rollouts_s": first["open_s"],
        "plane_hold_all_calls_open_s": first["all_open_s"],
        "plane_hold_first_response_s": first["first_s"],
        "plane_hold_all_complete_s": first["all_s"],
        "plane_hold_failed_count": first["failed"] + second["failed"],
        "plane_hold_turns_recorded_count": first["turns"] + second["turns"],
        "plane_hold_second_first_response_s": second["first_s"],
        "plane_rss_per_open_rollout_bytes": (first["open"] - first["base"]) / n,
        "plane_rss_per_registered_rollout_bytes": (first["registered"] - first["base"]) / n,
        "plane_rss_baseline_mb": first["base"] / MIB,
        "plane_rss_peak_mb": max(first["peak"], second["peak"]) / MIB,
        "plane_rss_resting_mb": first["resting"] / MIB,
        "plane_rss_resting_after_second_burst_mb": second["resting"] / MIB,
        "plane_rss_resting_minus_baseline_bytes": first["resting"] - first["base"],
        "plane_second_burst_added_bytes": second["resting"] - first["resting"],
        "plane_first_burst_heap_added_bytes": first["heap"] - first["heap_base"],
        "plane_second_burst_heap_added_bytes": second["heap"] - first["heap"],
        "plane_second_burst_python_objects_added_count": second["objects"] - first["objects"],
        "plane_sockets_left_after_close_count": second["sockets_left"],
        "plane_connections_after_close_count": s["connections"] + second["settled"]["connections"],
    }


# --- child processes --------------------------------------------------------------------


def gate_child() -> None:
    """An upstream that answers chat completions at once, or holds them while the gate is closed."""
    from lowwater.http import handle, read_body, send_json, serve
    from lowwater.interception.proxy import raise_open_file_limit

    raise_open_file_limit()
    answer = {
        "id": "chatcmpl-gate",
        "object": "chat.completion",
        "created": 0,
        "model": "gate",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The gate opened."},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24},
    }
    state = {"open": trio.Event()}
    state["open"].set()

    async def route(scope, receive, send):
        path = scope["path"]
        await read_body(scope, receive, 1 << 20)
        if path == "/gate/hold":
            state["open"] = trio.Event()
        elif path == "/gate/release":
            state["open"].set()
        else:
            await state["open"].wait()
        await send_json(send, 200, answer)

    async def app(scope, receive, send):
        await handle(scope, receive, send, route)

    async def main():
        async with trio.open_nursery() as nursery:
            # Keep-alive past its clients' idle prune (5 s): a connection the
            # gate closed just as a client reused it failed the call (502 from
            # the plane, which the bench runs with retries=0).
            # A backlog for the flood: a server in front opens up to 1,024
            # upstream connections at once, and past a backlog of 100 the
            # kernel completed handshakes (syncookies) the gate never
            # accepted, then reset them once the request came (a 502 each,
            # tens per burst in CI).  4096 is the kernel's default somaxconn.
            address = await nursery.start(functools.partial(serve, app, keep_alive_s=60.0, backlog=4096))
            print(f"http://{address}", flush=True)

    trio.run(main)


def start(argv: list[str], *, url_on: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start a child; its URL is the first ``http://`` word on stdout or stderr."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE if url_on == "stdout" else subprocess.DEVNULL,
        stderr=subprocess.PIPE if url_on == "stderr" else None,
        env=env,
        text=True,
    )
    stream = proc.stdout if url_on == "stdout" else proc.stderr
    assert stream is not None
    line = stream.readline()
    words = [w for w in line.split() if w.startswith("http://")]
    if not words:
        proc.kill()
        raise RuntimeError(f"{argv[:4]} did not report a URL: {line!r}")
    # Keep draining the pipe: a child whose log fills the 64 KiB pipe buffer
    # would block mid-request and the bench would measure the stall.
    threading.Thread(target=lambda: [sys.stderr.write(rest) for rest in stream], daemon=True).start()
    return proc, words[0].rstrip(";")


def build_forwarder() -> str:
    """Build ``rust/dataplane/examples/forwarder.rs`` with the extension's
    own profile (``dist``: fat LTO, one codegen unit; Cargo.toml), so the
    floor and the plane are compiled alike, and return its executable's path.

    Raises:
        RuntimeError: cargo is missing, failed, or named no executable.
    """
    root = Path(__file__).resolve().parent.parent
    progress("building the forwarder (cargo build --profile dist --example forwarder)")
    if shutil.which("cargo") is None:
        raise RuntimeError("--forwarder needs cargo (the Rust toolchain) on PATH")
    built = subprocess.run(
        [
            "cargo",
            "build",
            "--profile",
            "dist",
            "--quiet",
            "-p",
            "lowwater-dataplane",
            "--no-default-features",
            "--example",
            "forwarder",
            "--message-format=json",
        ],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise RuntimeError(f"building the forwarder failed (exit {built.returncode}): {built.stderr[-2000:]}")
    for line in built.stdout.splitlines():
        message = orjson.loads(line)
        if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "forwarder":
            if message.get("executable"):
                return str(message["executable"])
    raise RuntimeError("cargo built the forwarder but named no executable")


def start_proxy(
    upstream: str,
    out_dir: str,
    pythonmalloc: str | None = None,
    main: str = PROXY_MAIN,
    previous: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """``lowwater proxy`` in front of ``upstream``; ``previous``: the
    checkout whose ``python/`` is imported instead of this one's."""
    env = {**os.environ, "LOWWATER_ADMIN_KEY": ADMIN_KEY}
    if pythonmalloc:
        env["PYTHONMALLOC"] = pythonmalloc
    if previous:
        env["PYTHONPATH"] = str(Path(previous) / "python")
    return start(
        [
            sys.executable,
            "-c",
            main,
            "proxy",
            "--upstream",
            upstream,
            "--listen",
            "127.0.0.1:0",
            "--out",
            out_dir,
            "--retries",
            "0",
        ],
        url_on="stderr",
        env=env,
    )


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--latency-calls", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--calls-per-worker", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=16384)
    p.add_argument(
        "--history-kib",
        type=int,
        default=0,
        help="pad the latency, throughput and interceptor phases' request with this many KiB of earlier "
        "turns (default 0: a 191-byte chat request; the plane's latency and throughput targets are for it)",
    )
    p.add_argument(
        "--pythonmalloc",
        default=None,
        help="PYTHONMALLOC for the proxies (default: unset, so lowwater proxy picks glibc's 'malloc' itself; "
        "'pymalloc' measures pymalloc's 1 MiB arenas)",
    )
    p.add_argument(
        "--phases",
        default="latency,throughput,hold",
        help="comma-separated subset of latency, throughput, hold, interceptor (default: the first three)",
    )
    p.add_argument(
        "--servers",
        default="proxy,plane",
        help="comma-separated series measured beside direct calls: proxy (lowwater proxy), plane (the Rust data plane)",
    )
    p.add_argument(
        "--plane-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment of the plane processes (e.g. MALLOC_ARENA_MAX=2; repeatable)",
    )
    p.add_argument(
        "--plane-no-trim",
        action="store_true",
        help="the plane's trim_when_idle off (glibc keeps the pages a burst freed)",
    )
    p.add_argument(
        "--previous",
        default=None,
        metavar="CHECKOUT",
        help="a checkout of a commit before the data plane (e.g. bfe7b28, the Python server on the call path) "
        "with its extension built into CHECKOUT/python/lowwater/: adds its proxy as the `previous` series",
    )
    p.add_argument(
        "--forwarder",
        action="store_true",
        help="add a minimal hyper forwarder (rust/dataplane/examples/forwarder.rs, built with cargo) "
        "to the latency phase as the `forwarder` series: an extra hop's floor on this host",
    )
    p.add_argument(
        "--plane-no-ack",
        action="store_true",
        help="add the plane with no control plane on the answer's path (hold_for_ack off, no record drained) "
        "to the latency phase as the `plane_no_ack` series: the Rust side's own cost",
    )
    p.add_argument("--_gate-child", dest="gate_child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    phases = set(a.phases.split(","))
    servers = set(a.servers.split(","))
    if a.gate_child:
        return gate_child()
    if a.history_kib < 0:
        p.error("--history-kib must be 0 or more")
    global CALL
    if a.history_kib:
        CALL = with_history(a.history_kib * 1024)
    if a.forwarder and "latency" not in phases:
        p.error("--forwarder adds a series to the latency phase: include latency in --phases")
    if a.plane_no_ack and ("latency" not in phases or "plane" not in servers):
        p.error("--plane-no-ack adds a series to the latency phase: include latency in --phases and plane in --servers")
    if a.quick:
        a.latency_calls, a.concurrency, a.calls_per_worker, a.rounds, a.rollouts = 100, 32, 4, 1, 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    out_dir = tempfile.mkdtemp(prefix="lowwater-bench-")
    plane_env = {**os.environ, **dict(kv.split("=", 1) for kv in a.plane_env)}
    use_proxy = "proxy" in servers or "interceptor" in phases
    model, model_url = start([sys.executable, "-m", "lowwater", "serve-model", "--scripted"], url_on="stdout")
    proxy, proxy_url = start_proxy(model_url + "/v1", out_dir, a.pythonmalloc) if use_proxy else (None, "")
    previous, previous_url = (
        start_proxy(model_url + "/v1", out_dir, a.pythonmalloc, previous=a.previous) if a.previous else (None, "")
    )
    plane = PlaneChild(model_url + "/v1", plane_env, not a.plane_no_trim) if "plane" in servers else None
    plane_no_ack = PlaneChild(model_url + "/v1", plane_env, not a.plane_no_trim, ack=False) if a.plane_no_ack else None
    # The forwarder serves the model server's own paths (/v1/...): its origin.
    forwarder, forwarder_url = start([build_forwarder(), model_url], url_on="stdout") if a.forwarder else (None, "")
    gate, gate_url = (
        start([sys.executable, __file__, "--_gate-child"], url_on="stdout") if "hold" in phases else (None, "")
    )
    gated, gated_url = (
        start_proxy(gate_url + "/v1", out_dir, a.pythonmalloc)
        if "hold" in phases and "proxy" in servers
        else (None, "")
    )
    gated_plane = (
        PlaneChild(gate_url + "/v1", plane_env, not a.plane_no_trim)
        if "hold" in phases and "plane" in servers
        else None
    )
    gated_previous, gated_previous_url = (
        start_proxy(gate_url + "/v1", out_dir, a.pythonmalloc, previous=a.previous)
        if "hold" in phases and a.previous
        else (None, "")
    )
    hooked, hooked_url = (
        start_proxy(model_url + "/v1", out_dir, a.pythonmalloc, HOOKED_PROXY_MAIN)
        if "interceptor" in phases
        else (None, "")
    )
    results: dict = {}
    try:

        async def run() -> None:
            if "latency" in phases:
                await latency_phase()
            if "throughput" in phases:
                await throughput_phase()
            if "hold" in phases and gated is not None:
                progress(f"hold-open: {a.rollouts} rollouts, one call each, held at a gated upstream")
                results.update(await hold_open(gated_url, gate_url, gated.pid, a.rollouts))
            if "hold" in phases and gated_plane is not None:
                progress(f"hold-open, plane: 2 bursts of {a.rollouts} rollouts, one call each, held at the gate")
                results.update(await hold_plane(gated_plane, gate_url, a.rollouts, not a.plane_no_trim))
            if "hold" in phases and gated_previous is not None:
                progress(f"hold-open, previous: 2 bursts of {a.rollouts} rollouts, one call each, held at the gate")
                results.update(
                    await hold_open(gated_previous_url, gate_url, gated_previous.pid, a.rollouts, "previous_")
                )
            if "interceptor" in phases:
                await interceptor_phase()

        async def interceptor_phase() -> None:
            progress(
                f"interceptor: {a.rounds} x {a.latency_calls // a.rounds} calls each way, no hook vs trivial hooks"
            )
            sides = {"plain": (proxy_url, ProxyRollouts(proxy_url)), "hooked": (hooked_url, ProxyRollouts(hooked_url))}
            q = await latency_percentiles(sides, a.rounds, a.latency_calls)
            results.update(
                {
                    "no_interceptor_p50_ms": q["plain"][49],
                    "trivial_interceptor_p50_ms": q["hooked"][49],
                    "interceptor_added_p50_ms": q["hooked"][49] - q["plain"][49],
                    "interceptor_added_p99_ms": q["hooked"][98] - q["plain"][98],
                }
            )

        async def latency_phase() -> None:
            progress(
                f"latency: {a.rounds} x {a.latency_calls // a.rounds} sequential calls each way, "
                "alternating call by call in a shuffled order"
            )
            sides: dict[str, tuple[str, ProxyRollouts | PlaneChild | None]] = {"direct": (model_url, None)}
            if "proxy" in servers:
                sides["proxy"] = (proxy_url, ProxyRollouts(proxy_url))
            if plane is not None:
                sides["plane"] = (plane.url, plane)
            if previous is not None:
                sides["previous"] = (previous_url, ProxyRollouts(previous_url))
            if plane_no_ack is not None:
                sides["plane_no_ack"] = (plane_no_ack.url, plane_no_ack)
            if forwarder is not None:
                sides["forwarder"] = (forwarder_url, None)
            q = await latency_percentiles(sides, a.rounds, a.latency_calls)
            results.update({"direct_p50_ms": q["direct"][49], "direct_p99_ms": q["direct"][98]})
            if "proxy" in q:
                results.update(
                    {
                        "proxy_p50_ms": q["proxy"][49],
                        "proxy_p99_ms": q["proxy"][98],
                        "added_p50_ms": q["proxy"][49] - q["direct"][49],
                        "added_p99_ms": q["proxy"][98] - q["direct"][98],
                    }
                )
            for side in ("plane", "previous", "forwarder", "plane_no_ack"):
                if side in q:
                    results.update(
                        {
                            f"{side}_p50_ms": q[side][49],
                            f"{side}_p99_ms": q[side][98],
                            f"{side}_added_latency_p50_ms": q[side][49] - q["direct"][49],
                            f"{side}_added_latency_p99_ms": q[side][98] - q["direct"][98],
                        }
                    )
            if "plane" in q and "forwarder" in q:
                # The hop's cost taken out: lowwater's own work per call.
                results["plane_beyond_forwarder_p50_ms"] = q["plane"][49] - q["forwarder"][49]
            if "plane" in q and "plane_no_ack" in q:
                # What holding each answer for the control plane's ack costs (its wakeup, drain, turn, ack).
                results["plane_beyond_no_ack_p50_ms"] = q["plane"][49] - q["plane_no_ack"][49]
            if "plane_no_ack" in q and "forwarder" in q:
                results["plane_no_ack_beyond_forwarder_p50_ms"] = q["plane_no_ack"][49] - q["forwarder"][49]

        async def throughput_phase() -> None:
            progress(
                f"throughput: concurrency {a.concurrency}, {a.calls_per_worker} calls per worker, "
                f"{a.rounds} interleaved rounds (+1 warm-up)"
            )
            sides: dict[str, tuple[Target, ProxyRollouts | PlaneChild | None]] = {
                "direct": (Target(model_url, "/v1/chat/completions"), None)
            }
            if "proxy" in servers:
                sides["proxy"] = (Target(proxy_url, "/v1/chat/completions"), ProxyRollouts(proxy_url))
            if plane is not None:
                sides["plane"] = (Target(plane.url, "/v1/chat/completions"), plane)
            if previous is not None:
                sides["previous"] = (Target(previous_url, "/v1/chat/completions"), ProxyRollouts(previous_url))
            rollouts = {
                side: await ctl.open(a.concurrency) if ctl else [None] * a.concurrency
                for side, (_, ctl) in sides.items()
            }
            rates: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(a.rounds + 1):
                line = []
                for side, (target_, _) in sides.items():
                    rate = await throughput_round(target_, rollouts[side], a.calls_per_worker)
                    line.append(f"{side} {rate:.0f}/s")
                    if r:  # round 0 warms every server (connections, pools, allocator)
                        rates[side].append(rate)
                progress(f"  round {r}: " + ", ".join(line))
            for side, (_, ctl) in sides.items():
                if ctl:
                    await ctl.close(rollouts[side])
            results["direct_turns_per_s"] = statistics.median(rates["direct"])
            if "proxy" in rates:
                results["proxy_turns_per_s"] = statistics.median(rates["proxy"])
                results["throughput_ratio"] = results["proxy_turns_per_s"] / results["direct_turns_per_s"]
            for side in ("plane", "previous"):
                if side in rates:
                    results[f"{side}_turns_per_s"] = statistics.median(rates[side])
                    results[f"{side}_vs_direct_throughput_ratio"] = (
                        results[f"{side}_turns_per_s"] / results["direct_turns_per_s"]
                    )

        trio.run(run)
    finally:
        for child in (gated_plane, plane, plane_no_ack):
            if child is not None:
                child.stop()
        for proc in (forwarder, hooked, gated_previous, gated, gate, previous, proxy, model):
            if proc is not None:
                stop(proc)
    params = params_of(
        a,
        omit=("gate_child",),
        phases=sorted(phases),
        request_bytes=len(CALL),
        cores=os.cpu_count(),
        pythonmalloc=a.pythonmalloc or "default (lowwater proxy: malloc, set by itself; an older --previous: pymalloc)",
        servers=sorted(servers),
        previous_commit=(
            subprocess.run(
                ["git", "-C", a.previous, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            if a.previous
            else None
        ),
    )
    limits = {
        "added_p50_ms": {"max": 3.0},
        "throughput_ratio": {"min": 0.4},
        "hold_first_response_s": {"max": 5.0},
        "hold_failed_count": {"max": 0},
        "hold_rss_per_open_rollout_bytes": {"max": 32 * 1024},
        # The long-lived proxy returns to its low-water mark (the plane's resting targets).
        "hold_rss_resting_minus_baseline_bytes": {"max": 16 * MIB},
        "hold_second_burst_added_bytes": {"max": 1 * MIB},
        # The data plane's targets (docs/dataplane.md, What remains; benches/README.md).
        "plane_added_latency_p50_ms": {"max": 0.25},
        "plane_added_latency_p99_ms": {"max": 1.0},
        "plane_vs_direct_throughput_ratio": {"min": 0.85},
        "plane_hold_first_response_s": {"max": 1.0},
        "plane_hold_failed_count": {"max": 0},
        "plane_rss_per_open_rollout_bytes": {"max": 8 * 1024},
        "plane_rss_resting_minus_baseline_bytes": {"max": 16 * MIB},
        "plane_second_burst_added_bytes": {"max": 1 * MIB},
    }
    if a.history_kib:
        # The latency and throughput targets are for the default request; a long history is reported, not judged.
        limits = {k: v for k, v in limits.items() if "latency" not in k and "added" not in k and "throughput" not in k}
    targets = {key: target(results[key], **bound) for key, bound in limits.items() if key in results}
    emit("interception", params, results, targets)


if __name__ == "__main__":
    main()
