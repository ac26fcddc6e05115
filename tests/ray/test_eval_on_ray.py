"""lowwater eval on the ray backend: one node pool per node, one row per
task, a node pool SIGKILLed mid-eval, GSM8K replay rows against the labels,
and a loopback-only model server refused."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import trio

from lowwater.eval import EvalConfig, run_eval
from lowwater.http.exposure import ExposureError

pytestmark = pytest.mark.ray

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "rollout_id" in r]


def _ray_eval(cluster, out: Path, **overrides) -> EvalConfig:
    """An eval of 64 rollouts, 8 at a time, on the ray backend of ``cluster``
    (one worker per node pool, served on every interface), rows to ``out``,
    no transcripts; ``overrides`` replace any of those."""
    fields = {
        "rollouts": 64,
        "concurrency": 8,
        "workers": 1,
        "backend": "ray",
        "address": cluster.address,
        "bind": "0.0.0.0",
        "out": out,
        "samples": False,
    }
    return EvalConfig(**(fields | overrides))


def test_64_arithmetic_rollouts_over_two_node_pools(ray_cluster, admin_key, tmp_path):
    out = tmp_path / "r.jsonl"
    config = _ray_eval(ray_cluster, out)
    report = trio.run(lambda: run_eval(config))
    rows = _rows(out)
    assert Counter(r["task_id"] for r in rows) == Counter(range(64))  # one row per task
    assert report.summary["errors"] == 0 and report.summary["accuracy"] == 1.0
    pool = report.pool
    assert pool["node_pools"] == 2 and pool["nodes"] == 2 and pool["node_pool_crashes"] == 0
    assert len(pool["tasks_per_node"]) == 2 and all(n > 0 for n in pool["tasks_per_node"].values())
    assert sum(pool["tasks_per_node"].values()) == 64
    assert pool["workers_started"] == 2 and pool["object_store_peak_mb"] >= 0 and pool["shmem_peak_mb"] > 0


def test_a_loopback_model_server_is_refused_for_the_ray_backend(tmp_path):
    config = EvalConfig(rollouts=1, workers=1, backend="ray", address="127.0.0.1:1", out=tmp_path / "r.jsonl")
    with pytest.raises(ExposureError, match=r"backend 'ray' runs env workers on other hosts.*--bind 0.0.0.0"):
        trio.run(lambda: run_eval(config))


def _node_pool_pids(cluster) -> list[int]:
    """Node pool actors among the processes the test cluster started (Ray
    titles an actor's process ``ray::NodePool...``)."""
    import psutil

    pids = []
    for pid in cluster.remember():
        try:
            title = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "NodePool" in title:
            pids.append(pid)
    return pids


def test_a_node_pool_sigkilled_mid_eval_leaves_one_row_per_task(ray_cluster, admin_key, tmp_path):
    out = tmp_path / "r.jsonl"
    killed: list[int] = []

    def on_progress(totals, rss):
        if totals.this_run >= 8 and not killed:
            pids = _node_pool_pids(ray_cluster)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    config = _ray_eval(ray_cluster, out)
    report = trio.run(lambda: run_eval(config, on_progress=on_progress))
    rows = _rows(out)
    assert killed
    assert Counter(r["task_id"] for r in rows) == Counter(range(64))  # exactly one row per task
    retried = [r for r in rows if r.get("retried")]
    pool = report.pool
    assert pool["node_pool_crashes"] == 1 and pool["node_pools"] == 3  # the dead one was replaced
    assert len(retried) == pool["retried_tasks"] >= 1
    assert all(r["attempts"] == 2 and not r.get("error") for r in retried)
    assert report.summary["errors"] == 0


@pytest.mark.skipif(
    not (DATA / "test.jsonl").is_file(),
    reason="GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)",
)
def test_gsm8k_replay_rows_through_ray_agree_with_the_labels(ray_cluster, admin_key, tmp_path):
    from lowwater.upstream.spec import parse_model

    tasks, column = 64, "175b_verification"
    out = tmp_path / "gsm8k.jsonl"
    config = _ray_eval(
        ray_cluster,
        out,
        env="gsm8k",
        env_options={"data": str(DATA / "test.jsonl"), "seed": 0},
        model=parse_model(f"replay:{DATA / 'example_model_solutions.jsonl'}#{column}"),
        rollouts=tasks,
        concurrency=16,
    )
    report = trio.run(lambda: run_eval(config))
    labels = []
    with open(DATA / "example_model_solutions.jsonl", "rb") as f:
        for _, line in zip(range(tasks), f):
            labels.append(json.loads(line)[column]["is_correct"])
    by_task = {r["task_id"]: r for r in _rows(out)}
    assert sorted(by_task) == list(range(tasks)) and report.summary["errors"] == 0
    disagree = [i for i, label in enumerate(labels) if bool(by_task[i]["metrics"].get("correct")) != label]
    assert not disagree, disagree
    assert report.pool["node_pools"] == 2 and all(n > 0 for n in report.pool["tasks_per_node"].values())
