"""``TrainerConfig(harness="program", program=...)``: a trainer step runs any
program as the agent (task on stdin, SDK variables pointing at the rollout's
slot, the last JSON line as the answer), in this process's engine and in env
workers, and its calls become the step's token shards."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from lowwater.http import serve
from lowwater.trainer import Lowwater, TrainerConfig
from lowwater.trainer.producer import SHARD_NAMES
from lowwater.trainer.shards import ShardConsumer
from lowwater.upstream.spec import ModelSpec

# Stdlib only: one chat call through the slot; each run appends its task id to argv[1].
AGENT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    if os.environ.get("LOWWATER_PREFLIGHT") == "1":
        sys.exit(0)  # the start-up check: nothing to log
    task = json.load(sys.stdin)
    body = json.dumps({"model": os.environ["LOWWATER_MODEL"],
                       "messages": [{"role": "user", "content": task["prompt"]}]}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
        headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    reply = json.load(urllib.request.urlopen(request))
    with open(sys.argv[1], "a") as log:
        log.write(f"{task['id']}\\n")
    print(json.dumps(reply["choices"][0]["message"]["content"]))
    """
)


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "env-worker"])
def test_a_trainer_step_runs_the_agent_program(tmp_path: Path, lowwater_upstream: str, workers: int):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    runs = tmp_path / "runs.log"
    config = TrainerConfig(
        model=ModelSpec("url", "scripted", lowwater_upstream),  # lowwater's pytest fixture: the scripted model
        group_size=2,
        concurrency=2,
        harness="program",
        program=f"{sys.executable} {agent} {runs}",
        workers=workers,
    )

    async def main():
        async with (
            Lowwater.open(config) as lw,
            httpx.AsyncClient(timeout=30) as client,
            trio.open_nursery() as nursery,
        ):
            consumer = ShardConsumer(client)
            address = await nursery.start(serve, consumer)
            batch = await lw.next_batch(2)
            assert batch.errors == 0
            assert batch.rewards == ((1.0, 1.0), (1.0, 1.0))  # the program's JSON answer was scored
            assert len(batch.refs) == 2 * len(SHARD_NAMES)
            views = await consumer.fetch(batch.refs)
            arrays = [np.frombuffer(v, v.dtype).reshape(v.shape) for v in views]
            for g in range(2):
                ids, _logprobs, mask, offsets = arrays[g * 6 : g * 6 + 4]
                # Each rollout's one call went through its slot: its tokens are the group's.
                assert len(offsets) == 3 and offsets[-1] == len(ids) == len(mask) > 0
            del views, arrays
            report = await lw.clear_batch(batch, consumers=[address])
            assert report.leaked_bytes == 0
            nursery.cancel_scope.cancel()
            return batch.task_ids

    task_ids = trio.run(main)
    ran = runs.read_text().split()
    assert sorted(ran) == sorted(str(t) for t in task_ids for _ in range(2))  # 2 groups x 2 rollouts, each once
