"""Scoring rollouts: a cold interpreter per score against pooled runtimes with warm workers.

docs/design.md#incidents: a peer paid a 0.2 s import per rollout by scoring in a
fresh interpreter.  Both modes score the same rollouts, in the same run, with
the same real verifier (``benches/scoring_script.py``: math-verify on GSM8K,
recorded ``A: N`` solutions of four GPT-3 models from
``../shared/data/gsm8k/example_model_solutions.jsonl`` against the
``#### N`` references of ``test.jsonl``; rollout ``i`` is question ``i // 4``
answered by model ``i % 4``), with ``--concurrency`` rollouts in flight:

* **cold**: each rollout starts an ephemeral ``SubprocessRuntime`` and runs
  ``python scoring_script.py SOLUTION REFERENCE``.  At most
  ``--cold-processes`` interpreters run at once (default: the core count):
  each spends about half a second of CPU importing math-verify, so more
  would only queue on the cores and multiply memory;
* **warm**: each rollout takes a persistent runtime from a ``RuntimePool``
  (``--warm-runtimes``, default: the core count) and calls
  ``run_script(..., warm=True)``; the pool resets the runtime on release.
  The phase's wall time includes the pool's start (runtimes and the warm
  workers' imports) and its ``aclose``.

An untimed cold run first warms the page cache for both.  Both modes must
agree on every score, and the scores must match the recorded ``is_correct``
labels.  Target: ``speedup_ratio`` (cold wall / warm wall) >= 50.

Usage: ``python benches/scoring.py [--quick] [--rollouts 1000]
[--concurrency 128] [--cold-processes N] [--warm-runtimes N]``.  The last
line of stdout is the JSON object described in benches/README.md#output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import psutil
import trio

from _common import MIB, emit, params_of, progress, target
from _gsm8k import DATA
from lowwater.runtime import RuntimeConfig, RuntimePool, SubprocessRuntime

SCRIPT = Path(__file__).with_name("scoring_script.py")
MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def load_rollouts(n: int, data: Path) -> list[tuple[str, str, bool]]:
    """``(solution, reference, recorded is_correct)`` for the first ``n`` rollouts."""
    out: list[tuple[str, str, bool]] = []
    with (
        open(data / "example_model_solutions.jsonl", encoding="utf-8") as sols,
        open(data / "test.jsonl", encoding="utf-8") as refs,
    ):
        for sol_line, ref_line in zip(sols, refs):
            sol, ref = json.loads(sol_line), json.loads(ref_line)
            if sol["question"] != ref["question"]:
                raise ValueError("solutions and test set are not aligned")
            for model in MODELS:
                out.append((sol[model]["solution"], ref["answer"], bool(sol[model]["is_correct"])))
                if len(out) == n:
                    return out
    if len(out) < n:
        raise ValueError(f"only {len(out)} rollouts in {data}")
    return out


async def run_all(rollouts: list, concurrency: int, score_one) -> tuple[list[str], float]:
    """Score every rollout with ``concurrency`` in flight; ``(scores, wall_s)``."""
    scores: list[str] = [""] * len(rollouts)
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            solution, reference, _ = rollouts[i]
            scores[i] = await score_one([solution, reference])

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(rollouts)):
            nursery.start_soon(one, i)
    return scores, time.perf_counter() - start


async def cold_phase(
    rollouts: list, concurrency: int, processes: int, config: RuntimeConfig
) -> tuple[list[str], float]:
    procs = trio.CapacityLimiter(processes)

    async def score(args: list[str]) -> str:
        async with SubprocessRuntime(config) as rt:  # ephemeral: one per rollout
            async with procs:
                return await rt.run_script(SCRIPT, args)

    return await run_all(rollouts, concurrency, score)


async def warm_phase(
    rollouts: list, concurrency: int, runtimes: int, config: RuntimeConfig
) -> tuple[list[str], float, dict]:
    extra: dict = {}
    start = time.perf_counter()
    pool = RuntimePool(max_size=runtimes)
    try:

        async def score(args: list[str]) -> str:
            async with pool.acquire(config) as rt:
                return await rt.run_script(SCRIPT, args, warm=True)

        scores, _ = await run_all(rollouts, concurrency, score)
        workers = [c for c in psutil.Process().children() if "_warm_worker.py" in " ".join(c.cmdline())]
        extra["warm_workers_count"] = len(workers)
        extra["warm_workers_rss_mb"] = sum(w.memory_info().rss for w in workers) / MIB
        extra |= {f"pool_{k}_count": v for k, v in pool.stats().items() if k in ("created", "replaced")}
    finally:
        await pool.aclose()
    wall = time.perf_counter() - start
    stats = pool.stats()
    extra["pool_left_after_close_count"] = stats["idle"] + stats["in_use"]
    return scores, wall, extra


async def bench(a: argparse.Namespace) -> tuple[dict, dict]:
    rollouts = load_rollouts(a.rollouts, Path(a.data))
    cold_cfg = RuntimeConfig()
    warm_cfg = RuntimeConfig(persistent=True)
    progress("warming the page cache (one untimed cold score)")
    async with SubprocessRuntime(cold_cfg) as rt:
        await rt.run_script(SCRIPT, [rollouts[0][0], rollouts[0][1]])

    progress(f"cold: {a.rollouts} rollouts, {a.concurrency} in flight, at most {a.cold_processes} interpreters")
    cold, cold_s = await cold_phase(rollouts, a.concurrency, a.cold_processes, cold_cfg)
    progress(f"cold: {cold_s:.1f} s")
    progress(f"warm: {a.rollouts} rollouts, {a.concurrency} in flight, pool of {a.warm_runtimes} runtimes")
    warm, warm_s, extra = await warm_phase(rollouts, a.concurrency, a.warm_runtimes, warm_cfg)
    progress(f"warm: {warm_s:.2f} s")

    leftovers = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    labels = [r[2] for r in rollouts]
    results = {
        "cold_wall_s": cold_s,
        "warm_wall_s": warm_s,
        "speedup_ratio": cold_s / warm_s,
        "cold_per_score_ms": 1000 * cold_s / len(rollouts),
        "warm_per_score_ms": 1000 * warm_s / len(rollouts),
        "rollouts_count": len(rollouts),
        "correct_count": sum(s == "1" for s in warm),
        "cold_warm_mismatch_count": sum(c != w for c, w in zip(cold, warm)),
        "label_agreement_ratio": sum((w == "1") == lab for w, lab in zip(warm, labels)) / len(rollouts),
        **extra,
        "leftover_processes_count": len(leftovers),
    }
    targets = {
        "speedup_ratio": target(results["speedup_ratio"], min=50.0),
        "cold_warm_mismatch_count": target(results["cold_warm_mismatch_count"], max=0),
        "label_agreement_ratio": target(results["label_agreement_ratio"], min=0.99),
        "pool_left_after_close_count": target(results["pool_left_after_close_count"], max=0),
        "leftover_processes_count": target(results["leftover_processes_count"], max=0),
    }
    return results, targets


def main() -> None:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--rollouts", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=128, help="rollouts in flight")
    p.add_argument("--cold-processes", type=int, default=cores, help="cold interpreters at once (default: cores)")
    p.add_argument("--warm-runtimes", type=int, default=cores, help="pooled runtimes (default: cores)")
    p.add_argument("--data", default=str(DATA), help="the GSM8K directory")
    a = p.parse_args()
    if a.quick:
        a.rollouts, a.concurrency = 24, 16
    results, targets = trio.run(bench, a)
    emit("scoring", params_of(a, omit=("data",), cores=cores), results, targets)


if __name__ == "__main__":
    main()
