"""FetchBuffer against the design peers use: a Python dict guarded by a threading.Lock.

Measured in the same run (interleaved rounds, medians):

* small-shard put/get/pop throughput (1 KiB by default) and its ratio to the dict;
* get latency of a large shard (64 MiB): a zero-copy view against a ``bytes`` copy,
  and the view's latency against a 1 KiB view's (O(1) means a ratio near 1);
* RSS after putting and clearing 1 GiB in 4 MiB shards, each variant in its own
  fresh child process so neither inherits the other's heap.

Usage: ``python benches/tables.py [--quick] [--small-bytes N] [--ops N]
[--large-mib N] [--total-mib N] [--shard-mib N] [--rounds N]``.  The last
line of stdout is the JSON object described in benches/README.md#output.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import lowwater
from _common import MIB, emit, params_of, progress, rss_bytes, target


class LockedDict:
    """The peers' fetch buffer: ``dict[str, bytes]`` behind one lock."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data) -> None:
        payload = bytes(data)
        with self._lock:
            self._d[key] = payload

    def get(self, key: str):
        with self._lock:
            return self._d.get(key)

    def pop(self, key: str):
        with self._lock:
            return self._d.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


def small_ops(small_bytes: int, ops: int) -> dict[str, float]:
    """ops/s of put, get and pop for both designs, one round."""
    # A bytearray, as a payload arrives from a socket: ``bytes(data)`` then
    # really copies (``bytes(some_bytes)`` would return the same object).
    data = bytearray(bytes(range(256)) * (small_bytes // 256) + bytes(small_bytes % 256))
    keys = [f"shard-{i}" for i in range(ops)]
    shape = (small_bytes,)
    out: dict[str, float] = {}
    fb = lowwater.FetchBuffer()
    ld = LockedDict()
    put = fb.put
    t0 = time.perf_counter()
    for k in keys:
        put(k, data, dtype="uint8", shape=shape)
    out["fetch_put"] = ops / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in keys:
        ld.put(k, data)
    out["dict_put"] = ops / (time.perf_counter() - t0)
    for name, fn in (("fetch_get", fb.get), ("dict_get", ld.get), ("fetch_pop", fb.pop), ("dict_pop", ld.pop)):
        t0 = time.perf_counter()
        for k in keys:
            fn(k)
        out[name] = ops / (time.perf_counter() - t0)
    assert len(fb) == 0
    return out


def large_get(large_bytes: int, reps: int) -> dict[str, float]:
    """Median microseconds to get a large shard as a view, and as a bytes copy."""
    fb = lowwater.FetchBuffer()
    fb.put("large", bytearray(large_bytes), dtype="uint8", shape=(large_bytes,))
    fb.put("small", bytes(1024), dtype="uint8", shape=(1024,))

    def view_latency_us(shard_id: str) -> float:
        t0 = time.perf_counter()
        v = fb.get(shard_id)
        m = memoryview(v)
        elapsed = (time.perf_counter() - t0) * 1e6
        del m, v
        return elapsed

    def copy_latency_us() -> float:
        t0 = time.perf_counter()
        b = bytes(fb.get("large"))
        elapsed = (time.perf_counter() - t0) * 1e6
        del b
        return elapsed

    # Separate loops: a 64 MiB copy just before a timed view would charge the
    # view for the copy's cache and page-table churn.
    view_us = [view_latency_us("large") for _ in range(reps)]
    small_us = [view_latency_us("small") for _ in range(reps)]
    copy_us = [copy_latency_us() for _ in range(reps)]
    fb.clear()
    return {
        "view": statistics.median(view_us),
        "copy": statistics.median(copy_us),
        "small_view": statistics.median(small_us),
    }


def rss_child(kind: str, total_bytes: int, shard_bytes: int) -> dict[str, float]:
    """Run in a fresh process: put total_bytes in shards, clear, report RSS (MiB).

    Two fills: glibc raises its dynamic mmap threshold after the first large
    free, so the dict's second generation of payloads comes from the heap.
    Between puts the process keeps a small object alive (per-step bookkeeping,
    as a trainer has), which pins the heap around freed payloads.
    """
    chunk = bytearray(shard_bytes)
    n = total_bytes // shard_bytes
    keep: list[bytes] = []
    gc.collect()
    base = rss_bytes()
    store = lowwater.FetchBuffer() if kind == "fetch" else LockedDict()
    peak = 0
    for fill in range(2):
        for i in range(n):
            if kind == "fetch":
                store.put(f"s{i}", chunk, dtype="uint8", shape=(shard_bytes,))
            else:
                store.put(f"s{i}", chunk)
            keep.append(bytearray(2048 + fill))
        peak = max(peak, rss_bytes())
        store.clear()
        gc.collect()
    resting = rss_bytes()
    return {"baseline_mb": base / MIB, "peak_mb": peak / MIB, "resting_mb": resting / MIB}


def run_rss_child(kind: str, total_bytes: int, shard_bytes: int) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--_rss-child",
            kind,
            "--total-mib",
            str(total_bytes // MIB),
            "--shard-mib",
            str(shard_bytes / MIB),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--small-bytes", type=int, default=1024)
    p.add_argument("--ops", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--large-mib", type=int, default=64)
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--shard-mib", type=float, default=4)
    p.add_argument("--_rss-child", dest="rss_child", choices=["fetch", "dict"], help=argparse.SUPPRESS)
    a = p.parse_args()
    shard_bytes = int(a.shard_mib * MIB)
    if a.rss_child:
        print(json.dumps(rss_child(a.rss_child, a.total_mib * MIB, shard_bytes)))
        return
    if a.quick:
        a.ops, a.rounds, a.large_mib, a.total_mib = 2000, 2, 8, 64

    progress(f"small ops: {a.rounds} rounds x {a.ops} ops of {a.small_bytes} B")
    rounds = [small_ops(a.small_bytes, a.ops) for _ in range(a.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratios = {op: med[f"fetch_{op}"] / med[f"dict_{op}"] for op in ("put", "get", "pop")}
    progress(f"large get: {a.large_mib} MiB")
    lg = large_get(a.large_mib * MIB, reps=5 if a.quick else 21)
    progress(f"rss: {a.total_mib} MiB in {a.shard_mib} MiB shards, fresh process each")
    rss = {kind: run_rss_child(kind, a.total_mib * MIB, shard_bytes) for kind in ("fetch", "dict")}

    results = {
        "small_put_per_s": med["fetch_put"],
        "small_get_per_s": med["fetch_get"],
        "small_pop_per_s": med["fetch_pop"],
        "dict_small_put_per_s": med["dict_put"],
        "dict_small_get_per_s": med["dict_get"],
        "dict_small_pop_per_s": med["dict_pop"],
        "small_put_ratio": ratios["put"],
        "small_get_ratio": ratios["get"],
        "small_pop_ratio": ratios["pop"],
        "small_min_ratio": min(ratios.values()),
        "large_get_view_us": lg["view"],
        "large_get_copy_us": lg["copy"],
        "large_view_vs_copy_ratio": lg["view"] / lg["copy"],
        "large_vs_small_view_ratio": lg["view"] / lg["small_view"],
        "rss_baseline_mb": rss["fetch"]["baseline_mb"],
        "rss_peak_mb": rss["fetch"]["peak_mb"],
        "rss_resting_mb": rss["fetch"]["resting_mb"],
        "rss_resting_over_baseline_mb": rss["fetch"]["resting_mb"] - rss["fetch"]["baseline_mb"],
        "dict_rss_baseline_mb": rss["dict"]["baseline_mb"],
        "dict_rss_peak_mb": rss["dict"]["peak_mb"],
        "dict_rss_resting_mb": rss["dict"]["resting_mb"],
        "dict_rss_resting_over_baseline_mb": rss["dict"]["resting_mb"] - rss["dict"]["baseline_mb"],
    }
    targets = {
        "small_min_ratio": target(results["small_min_ratio"], min=0.8),
        # O(1): a 64 MiB view costs about what a 1 KiB view costs (slack for noise).
        "large_vs_small_view_ratio": target(results["large_vs_small_view_ratio"], max=3.0),
        "rss_resting_over_baseline_mb": target(results["rss_resting_over_baseline_mb"], max=16.0),
    }
    emit("tables", params_of(a, omit=("rss_child",)), results, targets)


if __name__ == "__main__":
    main()
