"""The 30-worker evaluation incident's workload, through the real stack.

docs/design.md#incidents: an evaluation's env workers grew until the job was
OOM-killed; its agents' requests carried the whole growing history with a
base64 image per turn, and every intercepted body stayed alive until its
rollout ended.  The peer's figures after its fix: 275 MB peak and 155 MB
resting per worker.

This bench runs ``--rollouts`` rollouts in ``--workers`` env worker
processes (:class:`lowwater.workers.WorkerPool` with its defaults: forkserver
start, allocator hygiene, trim at quiescence), ``--concurrency`` at a time
per worker.  Each worker runs the real rollout engine and interception
server (:func:`lowwater.assembly.open_engine`) against ``lowwater serve-model
--scripted`` (one model server for all workers, as ``lowwater eval
--workers`` does).  A rollout is ``--turns`` chat-completions calls; turn
``t`` appends a user message with a base64 image of ``--image-kb`` random
bytes (before encoding) and sends the whole history, as the incident's
agents did; the model's answer is appended too.

Every ``--sample-every`` rollouts the bench holds delivery until every
worker is idle and settled (collected and trimmed) and samples each
worker's resting RSS.  Baseline: a worker's RSS when ready.  Peak: the
largest RSS sampled every 50 ms.  Resting: the last settled sample.  Slope:
least-squares fit of resting RSS against the worker's finished rollouts
over the second half of the samples, worst worker.  Live set: the largest
number of bytes a worker legitimately held at once, summed over its
in-flight rollouts: each one's images twice (the agent's history and the
trajectory's message deltas, which hold each image once), plus, during a
call, its request body on the agent side and the same body held in the
intercept table.

Targets (issue "Env worker processes"): peak - baseline <= 3 x live set;
resting - baseline <= 16 MB; slope < 1 KB per rollout.  A worker's
settled RSS wobbles by about +-0.7 MB on its plateau (glibc's placement of
a few pages), which a fit over the 250 rollouts per worker of a default
run's second half reads as -1.4 to +2.4 KB per rollout: judge the slope
with ``--rollouts 2000`` or more (benches/README.md, "churn").

Usage: ``python benches/churn.py [--quick] [--workers 2] [--concurrency 4]
[--turns 45] [--image-kb 150] [--rollouts 1000] [--sample-every 20]``.
The last line of stdout is the JSON object described in
benches/README.md#output.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import orjson
import trio

from _common import MIB, emit, params_of, progress, settle_and_sample, slope_bytes_per_rollout, target
from _common import pid_rss_bytes as _rss
from lowwater import plugins as plugins_mod
from lowwater.assembly import EngineConfig
from lowwater.environment import Environment, HarnessContext, Score, Task
from lowwater.eval.job import EvalJob
from lowwater.rollout import Rollout, RolloutFailed
from lowwater.upstream.spec import ModelSpec, model_server
from lowwater.workers import JobSpec, WorkerPool

# Workers import this file by module name (they never import __main__).
FACTORY = f"{Path(__file__).stem}:ChurnJob"


class ChurnEnvironment(Environment):
    """Multimodal rollouts whose every request resends the whole history."""

    name = "churn"

    def __init__(self, turns: int, image_kb: int) -> None:
        self.turns = turns
        self.image_kb = image_kb
        self.live = 0
        self.live_peak = 0

    def tasks(self) -> Iterator[Task]:
        raise NotImplementedError("the bench hands out task ids")

    def task(self, task_id: str | int) -> Task:
        return Task(task_id, f"rollout {task_id}", "")

    def _hold(self, n: int) -> None:
        self.live += n
        self.live_peak = max(self.live_peak, self.live)

    async def harness(self, ctx: HarnessContext) -> None:
        history: list[dict[str, Any]] = [{"role": "system", "content": "Describe each image in one line."}]
        held = 0  # this rollout's history bytes, counted in the live set
        url = f"{ctx.base_url}/chat/completions"
        headers = {"authorization": f"Bearer {ctx.api_key}", "content-type": "application/json"}
        try:
            for turn in range(self.turns):
                image = base64.b64encode(os.urandom(self.image_kb * 1024)).decode()
                history.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": f"{ctx.task.prompt}, turn {turn}: what is in this image?"},
                            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                        ],
                    }
                )
                # Held twice by design: in the agent's history and, once, in
                # the rollout's trajectory (the turn's message delta).
                self._hold(2 * len(image))
                held += 2 * len(image)
                body = orjson.dumps({"model": ctx.model, "messages": history})
                self._hold(2 * len(body))  # the agent's body and the intercept table's copy
                try:
                    response = await ctx.http.post(url, content=body, headers=headers)
                finally:
                    self.live -= 2 * len(body)
                del body
                if response.status_code != 200:
                    raise RolloutFailed("model", f"model call answered {response.status_code}")
                history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        finally:
            self.live -= held
        ctx.rollout.state["turns_sent"] = self.turns

    async def score(self, rollout: Rollout) -> Score:
        return Score(1.0, {"correct": rollout.state.get("turns_sent") == self.turns})


class ChurnJob(EvalJob):
    """The eval worker's job with :class:`ChurnEnvironment` built in place."""

    def __init__(self, config: dict[str, Any], upstream_url: str, turns: int, image_kb: int) -> None:
        super().__init__(config, upstream_url)
        self.turns, self.image_kb = turns, image_kb

    async def setup(self) -> None:
        self.plugins = plugins_mod.load()
        self.env = ChurnEnvironment(self.turns, self.image_kb)
        await self.nursery.start(self._hold)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "live_bytes": self.env.live, "live_peak_bytes": self.env.live_peak}


async def churn(a: argparse.Namespace) -> dict[str, float]:
    baseline: dict[int, int] = {}
    peak: dict[int, int] = {}
    resting: dict[int, list[tuple[int, int]]] = {}
    delivered = errors = 0
    live_peak = 0

    def on_event(name: str, fields: dict) -> None:
        if name == "ready":
            baseline[fields["pid"]] = fields["rss"]

    async with model_server(ModelSpec("scripted", "scripted")) as upstream_url:
        config = EngineConfig(
            env="churn", concurrency=a.concurrency, max_turns=a.turns + 1, persistent=False, timeout_s=600.0
        )
        pool = WorkerPool(
            JobSpec(
                FACTORY,
                {"config": config.to_json(), "upstream_url": upstream_url, "turns": a.turns, "image_kb": a.image_kb},
            ),
            workers=a.workers,
            concurrency_per_worker=a.concurrency,
            max_tasks_per_worker=None,
            heartbeat_s=0.05,
            trim_interval_s=0.05,
            on_event=on_event,
        )

        async def on_rows(rows: list[dict], info: Any) -> None:
            nonlocal delivered, errors
            delivered += 1
            errors += sum(1 for r in rows if r.get("error"))
            if delivered % a.sample_every == 0 or delivered == a.rollouts:
                progress(f"  {delivered}/{a.rollouts} rollouts")
                await settle_and_sample(pool, resting)

        async def sampler() -> None:
            nonlocal live_peak
            while True:
                for w in pool.stats()["workers"].values():
                    rss = _rss(w["pid"]) if w["pid"] else None
                    if rss is not None:
                        peak[w["pid"]] = max(peak.get(w["pid"], 0), rss)
                    live_peak = max(live_peak, int((w.get("job") or {}).get("live_peak_bytes", 0) or 0))
                await trio.sleep(0.05)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            report = await pool.run(range(a.rollouts), on_rows)
            nursery.cancel_scope.cancel()
        wall = time.perf_counter() - started
    pids = [p for p in baseline if resting.get(p)]
    return {
        "rss_baseline_mb": statistics.fmean(baseline[p] for p in pids) / MIB,
        "rss_peak_mb": max(peak.values()) / MIB,
        "rss_resting_mb": max(resting[p][-1][1] for p in pids) / MIB,
        "peak_over_baseline_mb": max(peak.get(p, baseline[p]) - baseline[p] for p in pids) / MIB,
        "resting_over_baseline_mb": max(resting[p][-1][1] - baseline[p] for p in pids) / MIB,
        "live_set_mb": live_peak / MIB,
        "rss_slope_bytes_per_rollout": max(slope_bytes_per_rollout(resting[p]) for p in pids),
        # The spread of the settled samples the slope is fitted to (second half, worst worker).
        "resting_spread_mb": max(
            (
                max(y for _, y in resting[p][len(resting[p]) // 2 :])
                - min(y for _, y in resting[p][len(resting[p]) // 2 :])
            )
            for p in pids
        )
        / MIB,
        "rollouts_per_s": a.rollouts / wall,
        "wall_s": wall,
        "errors_count": errors,
        "retried_count": report.retried_tasks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="concurrent rollouts per worker (default 4)")
    p.add_argument("--turns", type=int, default=45)
    p.add_argument("--image-kb", type=int, default=150, help="image size before base64, KiB (default 150)")
    p.add_argument("--rollouts", type=int, default=1000)
    # 50 settled samples: with 20 per worker in the fit's half, a +-0.5 MB
    # wobble of the resting plateau read as a 1.6 KB/rollout slope.
    p.add_argument("--sample-every", type=int, default=20, help="rollouts between settled RSS samples (default 20)")
    a = p.parse_args()
    if a.quick:
        a.turns, a.image_kb, a.rollouts, a.sample_every = 8, 32, 24, 4
    progress(
        f"churn: {a.workers} workers x {a.concurrency} rollouts of {a.turns} turns, {a.image_kb} KiB images, "
        f"{a.rollouts} rollouts"
    )
    results = trio.run(churn, a)
    results["peak_over_live_set_ratio"] = (
        results["peak_over_baseline_mb"] / results["live_set_mb"] if results["live_set_mb"] else 0.0
    )
    params = params_of(a)
    targets = {
        "peak_over_live_set_ratio": target(results["peak_over_live_set_ratio"], max=3.0),
        "resting_over_baseline_mb": target(results["resting_over_baseline_mb"], max=16.0),
        "rss_slope_bytes_per_rollout": target(results["rss_slope_bytes_per_rollout"], max=1024.0),
        "errors_count": target(results["errors_count"], max=0),
    }
    emit("churn", params, results, targets)


if __name__ == "__main__":
    main()
