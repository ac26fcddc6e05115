"""lowwater on Ray (``plugins/lowwater-ray``) against lowwater on one machine.

Everything runs on a two-node Ray cluster simulated on this machine
(``lowwater_ray.cluster.LocalCluster``: ``ray start --head`` plus a second
``ray start`` with its own ports, 512 MiB object store each), started and
stopped by the bench:

* **eval**: the GSM8K replay eval (``--tasks``, default all 1319, replayed
  from ``../shared/data/gsm8k``) with ``--backend ray --workers 1`` (one env
  worker per node, two in all) against ``--backend local --workers 2``, same
  run, each ``lowwater eval`` in its own process, the same total of rollouts
  in flight (``--concurrency``): ``-c`` is per node on Ray, so the Ray run gets
  ``-c`` divided by the nodes; rollouts/s ratio and the agreement of each run's
  rows with the recorded labels.
* **shard**: one 64 MiB shard, fetched through the object store by a
  consumer actor on the same node and on the other node (``ray.get``, the
  zero-copy view summed), and through the HTTP transport by a consumer
  process: the store's bulk listener into the consumer's fetch buffer, and
  the hypercorn/httpx batch endpoint it replaced; medians of ``--rounds``.
* **steps**: ``--steps`` trainer steps over Ray (``TrainerConfig(backend=
  "ray", workers=1)``, 4 groups of 4 a step), each fetched by a consumer
  actor on the other node and released by ``clear_batch``: the consumer's
  RSS slope over the second half, and the objects left in the object
  stores after each drain.
* **memory**: the Ray daemons' PSS (every process the nodes started except
  the workers: GCS, raylets, agents), the host's Shmem high-water, and this
  process's RSS.

Targets (issue "Beyond one machine"): ``ray_vs_local_rollouts_per_s_ratio``
>= 0.7; HTTP fetch of 64 MiB >= 1 GB/s (``http_bulk_fetch_gbytes_per_s``);
consumer RSS slope < 64 KB per step; no object left after any drain.

Usage: ``python benches/ray_backend.py [--quick] [--tasks 1319] [--steps 200]
[--rounds 5]``.  Needs ``pip install -e plugins/lowwater-ray``.  The last line
of stdout is the JSON object described in benches/README.md#output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import MIB, emit, params_of, pid_rss_bytes, progress, rss_bytes, slope_bytes_per_rollout, target
from _gsm8k import DATA, add_replay_flags, eval_cmd, labels

SHARD_BYTES = 64 << 20
#: Nodes of the simulated cluster, and so node pools of the Ray run.
NODES = 2
#: Env workers: per node on Ray, in all locally (one env worker per node either way).
WORKERS = {"ray": 1, "local": NODES}
ENV = {"RAY_AUTH_MODE": "disabled", "LOWWATER_ADMIN_KEY": "bench-ray-backend"}


# -- eval ---------------------------------------------------------------------------


def rollouts_in_flight(concurrency: int, workers: int, pools: int) -> int:
    """Rollouts ``lowwater eval -c concurrency --workers workers`` keeps in flight
    over ``pools`` pools (1 locally, one per node on Ray), as its runner sizes them:
    ``ceil(concurrency / workers)`` tasks per worker of each pool, one rollout a task
    (the GSM8K eval's group size is 1)."""
    return pools * workers * max(1, -(-concurrency // workers))


def concurrencies(local: int) -> dict[str, int]:
    """The ``-c`` of each run: ``local`` for the local one, and for the Ray one the
    per-node value giving the same total in flight.  Passing ``local`` to both would
    put ``NODES`` times as many rollouts in flight on Ray (``-c`` is per node there),
    which is how the rows before this split were measured.

    Raises:
        ValueError: no per-node ``-c`` gives ``local``'s total (not the case for
            ``NODES`` == local workers, kept as a guard if either changes).
    """
    ray = -(-local // NODES)
    total = rollouts_in_flight(local, WORKERS["local"], 1)
    if rollouts_in_flight(ray, WORKERS["ray"], NODES) != total:
        raise ValueError(f"no per-node -c puts {total} rollouts in flight on {NODES} nodes")
    return {"local": local, "ray": ray}


def eval_run(a: argparse.Namespace, out_dir: Path, backend: str, concurrency: int, address: str | None) -> dict:
    out, summary = out_dir / f"{backend}.jsonl", out_dir / f"{backend}.summary.json"
    cmd = eval_cmd(
        a,
        out,
        summary,
        "--no-samples",
        "--backend",
        backend,
        "--workers",
        str(WORKERS[backend]),
        concurrency=concurrency,
    )
    if backend == "ray":
        cmd += ["--address", address or "", "--bind", "0.0.0.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV})
    if done.returncode != 0:
        sys.exit(f"lowwater eval --backend {backend} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_task = {r["task_id"]: r for r in rows if "rollout_id" in r}
    recorded = labels(a.column, a.tasks)
    agree = sum(bool(by_task.get(i, {}).get("metrics", {}).get("correct")) == label for i, label in enumerate(recorded))
    return {"summary": json.loads(summary.read_text()), "agreement": agree / a.tasks}


# -- one 64 MiB shard ---------------------------------------------------------------


def object_store_fetch(rounds: int) -> dict[str, float]:
    """ms to ``ray.get`` (and sum) a 64 MiB array on the same node and from the other."""
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Reader:
        def read(self, refs: list) -> tuple[float, float]:
            """ms for ``ray.get`` (a zero-copy view), then ms to touch every
            page of it (what a consumer pays to really read the bytes)."""
            started = time.perf_counter()
            array = ray.get(refs[0])
            got = time.perf_counter()
            total = float(array[::4096].sum())
            touched = time.perf_counter()
            del array, total
            return (got - started) * 1000, (touched - got) * 1000

    data = np.random.default_rng(0).integers(0, 255, SHARD_BYTES, dtype=np.uint8)
    same = Reader.options(resources={"node1": 0.01}).remote()
    other = Reader.options(resources={"node2": 0.01}).remote()
    out: dict[str, list[float]] = {k: [] for k in ("put", "same", "same_touch", "other", "other_touch")}
    for _ in range(rounds):
        started = time.perf_counter()
        ref = ray.put(data)  # this process is on node1's machine; the object's primary copy is there
        out["put"].append((time.perf_counter() - started) * 1000)
        for name, reader in (("same", same), ("other", other)):
            got, touched = ray.get(reader.read.remote([ref]))
            out[name].append(got)
            out[f"{name}_touch"].append(touched)
        del ref
    ray.kill(same)
    ray.kill(other)
    return {k: statistics.median(v) for k, v in out.items()}


def http_child(port: int, bulk: bool, rounds: int) -> None:
    """The consumer process: fetch shard ``s{i}`` from the store at ``port``; prints ms per round."""
    import httpx
    import trio

    from lowwater.trainer.shards import ShardConsumer, ShardRef

    async def main() -> list[float]:
        times = []
        async with httpx.AsyncClient(timeout=120) as client:
            consumer = ShardConsumer(client)
            if not bulk:
                consumer.http._bulk_addresses[f"127.0.0.1:{port}"] = None  # the hypercorn endpoint, as before
            for i in range(rounds):
                ref = ShardRef(f"s{i}", f"127.0.0.1:{port}", "uint8", (SHARD_BYTES,), SHARD_BYTES)
                started = time.perf_counter()
                (view,) = await consumer.fetch([ref])
                times.append((time.perf_counter() - started) * 1000)
                del view
                consumer.drain([ref.shard_id])
            await consumer.aclose()
        return times

    print(json.dumps(trio.run(main)))


def http_fetch(rounds: int) -> dict[str, float]:
    import numpy as np
    import trio

    from lowwater.trainer.shards import ShardStore

    data = np.random.default_rng(0).integers(0, 255, SHARD_BYTES, dtype=np.uint8)
    results: dict[str, float] = {}

    async def main() -> None:
        store = ShardStore()
        for i in range(rounds):
            store.put(f"s{i}", data, dtype="uint8", shape=(SHARD_BYTES,))
        async with trio.open_nursery() as nursery:
            address = await nursery.start(store.run)
            port = int(address.rpartition(":")[2])
            for mode in ("bulk", "asgi"):
                done = await trio.run_process(
                    [sys.executable, __file__, "--http-child", str(port), mode, str(rounds)],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                if done.returncode != 0:
                    sys.exit(f"HTTP consumer failed:\n{done.stderr.decode()[-3000:]}")
                results[mode] = statistics.median(json.loads(done.stdout.decode().strip().splitlines()[-1]))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return results


# -- trainer steps --------------------------------------------------------------------


def trainer_steps(steps: int, address: str) -> dict[str, float]:
    import ray
    import trio

    from lowwater.trainer import Lowwater, TrainerConfig
    from lowwater_ray.consumer import ConsumerActor
    from lowwater_ray.memory import object_store

    points: list[tuple[int, int]] = []
    left_after_drain: list[int] = []
    leaked: list[int] = []

    async def main() -> None:
        config = TrainerConfig(
            group_size=4, concurrency=4, workers=1, backend="ray", ray_address=address, bind="0.0.0.0"
        )
        consumer = ray.remote(ConsumerActor).options(num_cpus=0, resources={"node2": 0.01}).remote()
        drain_at = await trio.to_thread.run_sync(ray.get, consumer.address.remote())
        pid = await trio.to_thread.run_sync(ray.get, consumer.pid.remote())
        async with Lowwater.open(config) as lw:
            for step in range(steps):
                batch = await lw.next_batch(4)
                await trio.to_thread.run_sync(ray.get, consumer.fetch.remote(list(batch.refs)))
                report = await lw.clear_batch(batch, consumers=[drain_at])
                leaked.append(len(report.held))
                del batch
                # Objects are freed by RPC once the last reference drops: give it a moment.
                with trio.move_on_after(5):
                    while sum(s["objects"] for s in (await trio.to_thread.run_sync(object_store)).values()):
                        await trio.sleep(0.05)
                left_after_drain.append(sum(s["objects"] for s in object_store().values()))
                points.append((step, pid_rss_bytes(pid) or 0))
                if step % 20 == 0:
                    progress(f"  step {step}: consumer RSS {points[-1][1] / MIB:.1f} MiB")
        ray.kill(consumer)

    trio.run(main)
    return {
        "steps_consumer_rss_slope_bytes_per_step": slope_bytes_per_rollout(points),
        "steps_objects_left_after_drain_max_count": max(left_after_drain),
        "steps_leaks_reported_count": sum(leaked),
        "steps_consumer_rss_first_mb": points[0][1] / MIB,
        "steps_consumer_rss_last_mb": points[-1][1] / MIB,
    }


# -- memory ------------------------------------------------------------------------------


def daemons_pss_bytes(cluster) -> int:
    """PSS of the processes the nodes started, workers excluded (GCS, raylets, agents...)."""
    import psutil

    total = 0
    for pid in cluster.remember():
        try:
            proc = psutil.Process(pid)
            title = " ".join(proc.cmdline())
            if "ray::" in title or "default_worker.py" in title:
                continue  # a worker or an actor: the job's, not the daemons'
            total += proc.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 tasks, 20 steps, 2 rounds: a smoke run")
    add_replay_flags(
        p,
        concurrency_help="rollouts in flight in all, the same for both runs (default 32; "
        f"the Ray run gets -c of this divided by its {NODES} nodes, as -c is per node there)",
    )
    p.add_argument("--steps", type=int, default=200, help="trainer steps over Ray (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="64 MiB fetches per path; medians (default 5)")
    p.add_argument("--http-child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.http_child:
        port, mode, rounds = a.http_child
        return http_child(int(port), mode == "bulk", int(rounds))
    if a.quick:
        a.tasks, a.steps, a.rounds = min(a.tasks, 64), min(a.steps, 20), min(a.rounds, 2)
    try:
        import ray

        from lowwater_ray.cluster import LocalCluster
        from lowwater_ray.memory import shmem_bytes
    except ImportError:
        sys.exit("this bench needs the lowwater-ray plugin: pip install -e plugins/lowwater-ray")
    has_data = (DATA / "test.jsonl").is_file()
    try:
        concurrency = concurrencies(a.concurrency)
    except ValueError as e:
        sys.exit(str(e))
    os.environ.update(ENV)
    baseline = rss_bytes()
    shmem_before = shmem_bytes()
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", object_store_mb=512, env=ENV)
        try:
            progress("starting a two-node Ray cluster on this machine")
            started = time.perf_counter()
            cluster.start_head(num_cpus=2, resources={"node1": 1})
            cluster.connect()
            cluster.add_node(num_cpus=2, resources={"node2": 1})
            cluster.wait(NODES)
            results["cluster_start_s"] = time.perf_counter() - started
            results["ray_daemons_pss_mb"] = daemons_pss_bytes(cluster) / MIB

            progress(f"64 MiB shard, {a.rounds} rounds: object store (same node, other node), HTTP (bulk, ASGI)")
            store = object_store_fetch(a.rounds)
            http = http_fetch(a.rounds)
            results.update(
                {
                    "shard_object_store_put_ms": store["put"],
                    "shard_object_store_same_node_ms": store["same"],
                    "shard_object_store_same_node_touch_ms": store["same_touch"],
                    "shard_object_store_other_node_ms": store["other"],
                    "shard_object_store_other_node_touch_ms": store["other_touch"],
                    "shard_http_bulk_ms": http["bulk"],
                    "shard_http_asgi_ms": http["asgi"],
                    "http_bulk_fetch_gbytes_per_s": SHARD_BYTES / 1e9 / (http["bulk"] / 1000),
                    "http_bulk_vs_asgi_ratio": http["asgi"] / http["bulk"],
                }
            )
            progress(f"  {json.dumps({k: round(v, 2) for k, v in results.items() if k.startswith(('shard', 'http'))})}")

            if has_data:
                results["local_rollouts_in_flight_count"] = rollouts_in_flight(
                    concurrency["local"], WORKERS["local"], 1
                )
                results["ray_rollouts_in_flight_count"] = rollouts_in_flight(concurrency["ray"], WORKERS["ray"], NODES)
                with tempfile.TemporaryDirectory() as out_dir:
                    for backend in ("local", "ray"):
                        progress(
                            f"GSM8K replay eval, {a.tasks} tasks, --backend {backend} --workers {WORKERS[backend]}"
                            f" -c {concurrency[backend]} ({results[f'{backend}_rollouts_in_flight_count']} in flight)"
                        )
                        run = eval_run(a, Path(out_dir), backend, concurrency[backend], cluster.address)
                        s = run["summary"]
                        progress(
                            f"  {s['wall_s']:.1f} s, {s['rollouts_per_s']:.2f} rollouts/s, agreement {run['agreement']:.4f}"
                        )
                        results[f"eval_{backend}_rollouts_per_s"] = s["rollouts_per_s"]
                        results[f"eval_{backend}_wall_s"] = s["wall_s"]
                        results[f"eval_{backend}_agreement_ratio"] = run["agreement"]
                        results[f"eval_{backend}_errors_count"] = s["errors"]
                results["ray_vs_local_rollouts_per_s_ratio"] = (
                    results["eval_ray_rollouts_per_s"] / results["eval_local_rollouts_per_s"]
                )
            else:
                progress(f"{DATA} not found: the eval comparison is skipped")

            progress(f"{a.steps} trainer steps over Ray with drain")
            results.update(trainer_steps(a.steps, cluster.address))
            results["ray_daemons_pss_after_mb"] = daemons_pss_bytes(cluster) / MIB
            results["shmem_high_water_mb"] = shmem_bytes() / MIB
            results["shmem_before_mb"] = shmem_before / MIB
            results["bench_rss_baseline_mb"] = baseline / MIB
            results["bench_rss_mb"] = rss_bytes() / MIB
        finally:
            if ray.is_initialized():
                ray.shutdown()
            left = cluster.stop()
            if left:
                progress(f"Ray processes left after the cluster stopped (killed): {left}")
    results["ray_processes_left_count"] = len(left)
    targets = {
        "http_bulk_fetch_gbytes_per_s": target(results["http_bulk_fetch_gbytes_per_s"], min=1.0),
        "steps_consumer_rss_slope_bytes_per_step": target(
            results["steps_consumer_rss_slope_bytes_per_step"], max=64 * 1024
        ),
        "steps_objects_left_after_drain_max_count": target(results["steps_objects_left_after_drain_max_count"], max=0),
    }
    if "ray_vs_local_rollouts_per_s_ratio" in results:
        targets["ray_vs_local_rollouts_per_s_ratio"] = target(results["ray_vs_local_rollouts_per_s_ratio"], min=0.7)
    params = params_of(a, omit=("http_child",), ray_concurrency_per_node=concurrency["ray"], gsm8k_data=has_data)
    emit("ray_backend", params, results, targets)


if __name__ == "__main__":
    main()
