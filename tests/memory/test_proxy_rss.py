"""RSS gate: a long-lived ``lowwater proxy`` comes back down after bursts of rollouts.

A real ``python -m lowwater proxy`` forwards to a real ``lowwater serve-model
--scripted``; this process drives bursts of rollouts through it (open, one
16 KiB chat call, close; 64 at a time).  Measured in the proxy process
(``/proc/PID/statm``) at rest, once its upstream pool is pruned and the
trim that follows has run:

* the tables and registries are empty after each burst (counts from
  ``/lowwater/stats``: deterministic);
* the resting RSS after a burst of 1,500 stays within ``FIRST_BURST_BOUND``
  of the resting RSS after a warm-up burst of 500 (pymalloc keeps arenas
  that a few survivors pin, docs/interception.md: about 5 MiB here, so the
  bound is generous);
* a second burst of 1,500 adds less than ``SECOND_BURST_BOUND``: the
  memory of a burst is reused, not leaked (under 1 MiB here, 118 B per
  rollout in benches/README.md; keeping each rollout's 16 KiB turn adds
  about 28 MiB).

The failing control runs the same gate against a proxy that keeps every
recorded turn (tests/memory/leaky_proxy.py) and asserts that the gate
catches it; the tables' counts are empty there too, which is why RSS is
measured at all.
"""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from ._proc import HERE, MIB, Child, child_env, serve_model, wait_until

# 3-6 minutes each on a loaded 2-core machine: twice the suite's 600 s default.
pytestmark = [pytest.mark.memory, pytest.mark.timeout(1200)]

WARMUP = 500
BURST = 1500
CONCURRENCY = 64
#: The proxy's admin key (given, so no key file is generated).
ADMIN = {"x-api-key": "memory-gate"}
#: Resting RSS after the first full burst, over the warm-up's resting RSS (bytes).
FIRST_BURST_BOUND = 24 * MIB
#: Resting RSS added by a second burst of the same size (bytes).
SECOND_BURST_BOUND = 8 * MIB
#: The request body's user message: an agent's history resent, of the size that matters.
MESSAGE = "what is 2 plus 2? " + "context " * 2048  # about 16 KiB


async def burst(url: str, n: int, tag: str) -> None:
    """``n`` rollouts through the proxy at ``url``, ``CONCURRENCY`` at a time: open, one call, close."""
    body = {"model": "m", "messages": [{"role": "user", "content": MESSAGE}]}
    limits = httpx.Limits(max_connections=2 * CONCURRENCY, max_keepalive_connections=2 * CONCURRENCY)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=ADMIN) as http:
        gate = trio.Semaphore(CONCURRENCY)

        async def one(i: int) -> None:
            async with gate:
                rollout_id = f"{tag}-{i}"
                r = await http.post(f"{url}/lowwater/rollouts", json={"rollout_id": rollout_id})
                assert r.status_code == 200, r.text
                opened = r.json()
                r = await http.post(
                    opened["base_url"] + "/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {opened['api_key']}"},
                )
                assert r.status_code == 200, r.text
                r = await http.delete(f"{url}/lowwater/rollouts/{rollout_id}")
                assert r.status_code == 200 and r.json()["turns"] == 1, r.text

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)


def resting(proxy: Child, url: str, written: int) -> int:
    """The proxy's RSS at rest after a burst (bytes), once its counts say it holds nothing.

    At rest means: every rollout closed and written, the intercept table
    empty, no call active and no agent connection left in the data plane,
    and the idle upstream connections closed by the plane's pool (after
    their 5 s idle timeout); the proxy trims after closes, at most once a
    second, so the RSS is read after that trim had its chance.
    """

    def stats() -> dict:
        return httpx.get(f"{url}/lowwater/stats", timeout=30, headers=ADMIN).json()

    def quiet() -> dict | bool:
        s = stats()
        return s["plane"]["active_calls"] <= 1 and s["open_rollouts"] == 0 and s  # <= 1: this stats call

    s = wait_until(quiet, "the burst's calls gone")
    assert (s["open_rollouts"], s["waiting_handlers"], s["written"]) == (0, 0, written), s
    table = s["intercepts"]
    assert (table["entries"], table["bytes"], table["live_bytes"], table["open_rollouts"]) == (0, 0, 0, 0), table
    # The upstream pool's idle timeout (5 s) closes the burst's upstream
    # connections; then the trim loop's pass (it sleeps 1 s between passes).
    time.sleep(8.0)
    samples = []
    for _ in range(3):
        samples.append(proxy.rss())
        time.sleep(0.2)
    return min(samples)


def run_gate(tmp_path, proxy_argv: list[str]) -> dict[str, int]:
    """Warm-up burst, then two bursts of ``BURST``; the resting RSS after each (bytes)."""
    upstream, upstream_url = serve_model(tmp_path)
    proxy = Child(
        [*proxy_argv, "--upstream", upstream_url, "--listen", "127.0.0.1:0", "--out", str(tmp_path / "out")],
        tmp_path / "proxy.log",
        env=child_env(LOWWATER_ADMIN_KEY=ADMIN["x-api-key"]),
    )
    try:
        url = proxy.wait_for_log(r"listening on (http://\S+) ->", "the proxy's address").group(1)
        figures = {"start": proxy.rss()}
        trio.run(burst, url, WARMUP, "warm")
        figures["warm"] = resting(proxy, url, WARMUP)
        trio.run(burst, url, BURST, "first")
        figures["first"] = resting(proxy, url, WARMUP + BURST)
        trio.run(burst, url, BURST, "second")
        figures["second"] = resting(proxy, url, WARMUP + 2 * BURST)
        return figures
    finally:
        proxy.stop()
        upstream.stop()


def violations(f: dict[str, int]) -> list[str]:
    """The gate's failed bounds, as messages (empty: the gate passes)."""
    out = []
    if f["first"] - f["warm"] > FIRST_BURST_BOUND:
        out.append(f"first burst: resting {(f['first'] - f['warm']) / MIB:.1f} MiB over the warm-up's")
    if f["second"] - f["first"] > SECOND_BURST_BOUND:
        out.append(f"second burst: added {(f['second'] - f['first']) / MIB:.1f} MiB")
    return out


def describe(f: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in f.items())


def test_proxy_rests_near_its_baseline_after_bursts(tmp_path, record_property):
    figures = run_gate(tmp_path, ["-m", "lowwater", "proxy"])
    record_property("rss", describe(figures))
    assert violations(figures) == [], describe(figures)


def test_control_a_proxy_that_keeps_turns_fails_the_gate(tmp_path, record_property):
    figures = run_gate(tmp_path, [str(HERE / "leaky_proxy.py")])
    record_property("rss", describe(figures))
    found = violations(figures)
    assert any(v.startswith("second burst") for v in found), f"the leak went unseen: {describe(figures)}"
