"""The interception proxy against calling the model server directly, same load generator, same run.

Three child processes: ``lowwater serve-model --scripted`` (the upstream),
``lowwater proxy`` in front of it, and for the hold-open phase a *gate*
upstream (this script in ``--_gate-child`` mode) that holds every request
until released.  The load generator (this process) is a minimal raw-socket
HTTP/1.1 client on Trio, so the figures measure the servers, not a heavy
client; it sends non-streamed chat completions.

* **Added latency** at concurrency 1: sequential calls on one keep-alive
  connection, direct and through the proxy, interleaved in rounds; p50 and
  p99 of each, and the difference.
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
  RSS per open rollout.
* **Interceptor hooks** (``--phases interceptor``): the same sequential
  calls through two proxies, one plain and one with a trivial
  ``intercept_request`` and ``intercept_response`` installed, alternating
  call by call; p50/p99 of each and the difference (the hooks' cost; the
  plain proxy is the "no interceptor" side, where the path is skipped).

Usage: ``python benches/interception.py [--quick] [--latency-calls 2000]
[--concurrency 256] [--calls-per-worker 20] [--rounds 2] [--rollouts 16384]
[--phases latency,throughput,hold,interceptor]``.
The last stdout line is the JSON object benches/README.md#output describes.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import trio

sys.path.insert(0, str(Path(__file__).parent))
from _common import MIB, emit, params_of, progress, rss_bytes, target

ADMIN_KEY = "bench-admin"
# The proxy's entry point (a variable so a diagnostic driver can wrap it).
PROXY_MAIN = "import sys; from lowwater import cli; sys.exit(cli.main(sys.argv[1:]))"
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
sys.exit(cli.main(sys.argv[1:]))
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


def auth(rollout: dict | None) -> bytes:
    return f"authorization: Bearer {rollout['api_key']}\r\n".encode() if rollout else b""


# --- phases ---------------------------------------------------------------------------


async def alternating_round(sides: dict[str, tuple[Target, dict | None]], calls: int) -> dict[str, list[float]]:
    """``calls`` sequential calls per side (ms each), alternating call by call
    between the sides (each ``(target, rollout or None for no proxy)``), so
    every series sees the same moments of a noisy host (blocks of 1000 each
    way put host slowdowns on one side: added p50 read 2.18 and 3.04 ms in two
    runs an hour apart)."""
    conns = {k: (Conn(t.host, t.port), t.path, auth(r)) for k, (t, r) in sides.items()}
    out: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(calls + 5):
        for side, (conn, path, headers) in conns.items():
            t0 = time.perf_counter()
            status, _ = await conn.request("POST", path, REQUEST, headers)
            if i >= 5:  # the first calls warm the connections
                out[side].append((time.perf_counter() - t0) * 1000)
            assert status == 200, status
    for conn, _, _ in conns.values():
        await conn.aclose()
    return out


async def latency_percentiles(sides: dict[str, tuple[str, bool]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Per side ``(base url, is a proxy)``, the 99 percentiles (ms; ``[49]`` is
    p50, ``[98]`` p99) of ``calls`` alternating chat calls, made in ``rounds``
    rounds on fresh connections; on a proxy through one rollout, opened first
    and closed after."""
    rollouts = {side: (await open_rollouts(url, 1))[0] if proxy else None for side, (url, proxy) in sides.items()}
    targets = {side: (Target(url, "/v1/chat/completions"), rollouts[side]) for side, (url, _) in sides.items()}
    lat: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, times in (await alternating_round(targets, calls // rounds)).items():
            lat[side] += times
    for side, (url, proxy) in sides.items():
        if proxy:
            await close_rollouts(url, [rollouts[side]])
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
            status, _ = await conn.request("POST", target.path, REQUEST, headers)
            assert status == 200, status

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for conn, rollout in zip(conns, rollouts):
            nursery.start_soon(worker, conn, rollout)
    elapsed = time.perf_counter() - t0
    for c in conns:
        await c.aclose()
    return len(conns) * calls_per_worker / elapsed


async def hold_open(proxy_url: str, gate_url: str, proxy_pid: int, n: int) -> dict:
    host, port = split_url(proxy_url)
    gate = Conn(*split_url(gate_url))
    ctl = Conn(host, port)
    # Warm the proxy's path once, then close the gate.
    warm = await open_rollouts(proxy_url, 1)
    assert (await Conn(host, port).request("POST", "/v1/chat/completions", REQUEST, auth(warm[0])))[0] == 200
    await close_rollouts(proxy_url, warm)
    await gate.request("POST", "/gate/hold", idempotent=True)
    rss_base = rss_bytes(proxy_pid)
    t_open = time.perf_counter()
    rollouts = await open_rollouts(proxy_url, n)
    open_s = time.perf_counter() - t_open
    rss_registered = rss_bytes(proxy_pid)
    progress(f"  {n} rollouts opened in {open_s:.1f} s; sending one call each")

    conns = [Conn(host, port) for _ in range(n)]
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
    all_open_s = float("nan")
    rss_open = 0
    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(256)
        for conn, rollout in zip(conns, rollouts):
            nursery.start_soon(agent, conn, rollout, limiter)
        while True:  # until the proxy holds every call
            await trio.sleep(0.25)
            stats = await admin(ctl, "GET", "/lowwater/stats")
            if stats["waiting_handlers"] >= n:
                all_open_s = time.perf_counter() - t_flood
                rss_open = rss_bytes(proxy_pid)
                held_intercepts = stats["intercepts"]["entries"]
                break
        progress(f"  all {n} calls open at the proxy after {all_open_s:.1f} s; releasing the gate")
        t_release = time.perf_counter()
        released.set()
        await gate.request("POST", "/gate/release", idempotent=True)
    done = [t for status, t in results if status == 200]
    rss_peak = max(rss_open, rss_bytes(proxy_pid))
    await close_rollouts(proxy_url, rollouts)
    # Resting: once the upstream connections the burst left idle are pruned
    # (keep-alive expiry, 5 s, then the next pruning pass) and the trim after
    # them has run; the proxy trims at most once a second.
    trims = (await admin(ctl, "GET", "/lowwater/stats"))["trims"]
    with trio.move_on_after(30):
        while True:
            stats = await admin(ctl, "GET", "/lowwater/stats")
            if stats["upstream"]["connections_idle"] == 0 and stats["trims"] > trims:
                break
            await trio.sleep(0.5)
    await trio.sleep(1.5)
    stats = await admin(ctl, "GET", "/lowwater/stats")
    await ctl.aclose()
    await gate.aclose()
    return {
        "hold_rollouts_count": n,
        "hold_open_rollouts_s": open_s,
        "hold_all_calls_open_s": all_open_s,
        "hold_intercepts_held_count": held_intercepts,
        "hold_first_response_s": min(done) if done else float("nan"),
        "hold_all_complete_s": max(done) if done else float("nan"),
        "hold_failed_count": n - len(done),
        "hold_rss_per_open_rollout_bytes": (rss_open - rss_base) / n,
        "hold_rss_per_registered_rollout_bytes": (rss_registered - rss_base) / n,
        "hold_intercepts_after_close_count": stats["intercepts"]["entries"],
        "hold_upstream_idle_after_close_count": stats["upstream"]["connections_idle"],
        "rss_baseline_mb": rss_base / MIB,
        "rss_peak_mb": rss_peak / MIB,
        "rss_resting_mb": rss_bytes(proxy_pid) / MIB,
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
            address = await nursery.start(serve, app)
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


def start_proxy(
    upstream: str, out_dir: str, pythonmalloc: str | None = None, main: str = PROXY_MAIN
) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "LOWWATER_ADMIN_KEY": ADMIN_KEY}
    if pythonmalloc:
        env["PYTHONMALLOC"] = pythonmalloc
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
        "--pythonmalloc",
        default=None,
        help="PYTHONMALLOC for the proxies (e.g. 'malloc': glibc instead of pymalloc's 1 MiB arenas)",
    )
    p.add_argument(
        "--phases",
        default="latency,throughput,hold",
        help="comma-separated subset of latency, throughput, hold, interceptor (default: the first three)",
    )
    p.add_argument("--_gate-child", dest="gate_child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    phases = set(a.phases.split(","))
    if a.gate_child:
        return gate_child()
    if a.quick:
        a.latency_calls, a.concurrency, a.calls_per_worker, a.rounds, a.rollouts = 100, 32, 4, 1, 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    out_dir = tempfile.mkdtemp(prefix="lowwater-bench-")
    model, model_url = start([sys.executable, "-m", "lowwater", "serve-model", "--scripted"], url_on="stdout")
    proxy, proxy_url = start_proxy(model_url + "/v1", out_dir, a.pythonmalloc)
    gate, gate_url = start([sys.executable, __file__, "--_gate-child"], url_on="stdout")
    gated, gated_url = start_proxy(gate_url + "/v1", out_dir, a.pythonmalloc)
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
            if "hold" in phases:
                progress(f"hold-open: {a.rollouts} rollouts, one call each, held at a gated upstream")
                results.update(await hold_open(gated_url, gate_url, gated.pid, a.rollouts))
            if "interceptor" in phases:
                await interceptor_phase()

        async def interceptor_phase() -> None:
            progress(
                f"interceptor: {a.rounds} x {a.latency_calls // a.rounds} calls each way, no hook vs trivial hooks"
            )
            sides = {"plain": (proxy_url, True), "hooked": (hooked_url, True)}
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
                f"latency: {a.rounds} x {a.latency_calls // a.rounds} sequential calls each way, alternating call by call"
            )
            sides = {"direct": (model_url, False), "proxy": (proxy_url, True)}
            q = await latency_percentiles(sides, a.rounds, a.latency_calls)
            results.update(
                {
                    "direct_p50_ms": q["direct"][49],
                    "direct_p99_ms": q["direct"][98],
                    "proxy_p50_ms": q["proxy"][49],
                    "proxy_p99_ms": q["proxy"][98],
                    "added_p50_ms": q["proxy"][49] - q["direct"][49],
                    "added_p99_ms": q["proxy"][98] - q["direct"][98],
                }
            )

        async def throughput_phase() -> None:
            direct = Target(model_url, "/v1/chat/completions")
            through = Target(proxy_url, "/v1/chat/completions")
            progress(
                f"throughput: concurrency {a.concurrency}, {a.calls_per_worker} calls per worker, "
                f"{a.rounds} interleaved rounds (+1 warm-up)"
            )
            rollouts = await open_rollouts(proxy_url, a.concurrency)
            rates = {"direct": [], "proxy": []}
            for r in range(a.rounds + 1):
                d = await throughput_round(direct, [None] * a.concurrency, a.calls_per_worker)
                x = await throughput_round(through, rollouts, a.calls_per_worker)
                progress(f"  round {r}: direct {d:.0f}/s, proxy {x:.0f}/s")
                if r:  # round 0 warms both servers (connections, pools, allocator)
                    rates["direct"].append(d)
                    rates["proxy"].append(x)
            await close_rollouts(proxy_url, rollouts)
            results.update(
                {
                    "direct_turns_per_s": statistics.median(rates["direct"]),
                    "proxy_turns_per_s": statistics.median(rates["proxy"]),
                }
            )
            results["throughput_ratio"] = results["proxy_turns_per_s"] / results["direct_turns_per_s"]

        trio.run(run)
    finally:
        for proc in (hooked, gated, gate, proxy, model):
            if proc is not None:
                stop(proc)
    params = params_of(
        a,
        omit=("gate_child",),
        phases=sorted(phases),
        request_bytes=len(REQUEST),
        cores=os.cpu_count(),
        pythonmalloc=a.pythonmalloc or "default (pymalloc)",
    )
    limits = {
        "added_p50_ms": {"max": 3.0},
        "throughput_ratio": {"min": 0.4},
        "hold_first_response_s": {"max": 5.0},
        "hold_failed_count": {"max": 0},
        "hold_rss_per_open_rollout_bytes": {"max": 32 * 1024},
    }
    targets = {key: target(results[key], **bound) for key, bound in limits.items() if key in results}
    emit("interception", params, results, targets)


if __name__ == "__main__":
    main()
