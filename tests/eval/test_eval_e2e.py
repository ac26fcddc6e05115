"""End to end: ``lowwater eval`` on the embedded default and on a GSM8K slice
with replay, resume after a kill, bad input, and emptiness of every table."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import orjson
import pytest
import trio

from lowwater.eval import SUMMARY_KEYS, EvalConfig, run_eval
from lowwater.upstream.spec import ModelSpec

from ._cli import lowwater, rows_of, start_eval, wait_for_lines

GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K / "test.jsonl").is_file(),
    reason="GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)",
)


def test_embedded_default_in_process(tmp_path):
    config = EvalConfig(rollouts=6, concurrency=3, out=tmp_path / "r.jsonl")
    report = trio.run(run_eval, config)
    s = report.summary
    assert tuple(s) == SUMMARY_KEYS
    assert s["rollouts"] == 6 and s["completed"] == 6 and s["errors"] == 0
    assert s["accuracy"] == 1.0 and s["turns_mean"] > 2  # several calculator turns each
    # Every per-rollout structure ended empty: registry, intercept table, runtimes.
    assert report.leftovers == {
        "in_flight": 0,
        "runtimes": 0,
        "trajectories": 0,
        "groups": 0,
        "turns": 0,
        "intercepts": 0,
    }
    rows = rows_of(config.out)
    assert sorted(r["task_id"] for r in rows) == list(range(6))
    assert all(r["metrics"]["correct"] and r["turns"] >= 3 for r in rows)


def test_groups_write_a_row_per_member(tmp_path):
    config = EvalConfig(rollouts=2, group_size=3, out=tmp_path / "g.jsonl")
    report = trio.run(run_eval, config)
    rows = rows_of(config.out)
    assert len(rows) == 6 and report.summary["rollouts"] == 6
    assert len({r["group_id"] for r in rows}) == 2 and all(r["group_id"] for r in rows)
    assert report.leftovers["trajectories"] == 0 and report.leftovers["groups"] == 0


def test_cli_writes_summary_json_and_memory_plot(tmp_path):
    out = lowwater(
        "eval", "-n", "4", "--out", "r.jsonl", "--summary-json", "s.json", "--memory-plot", "m.png", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    summary = orjson.loads((tmp_path / "s.json").read_bytes())
    assert tuple(summary) == SUMMARY_KEYS and summary["completed"] == 4
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "accuracy" in out.stdout and "RSS baseline / peak / resting" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "nope"], "unknown environment 'nope'"),
        (["eval", "gsm8k"], "gsm8k needs --data"),
        (["eval", "gsm8k", "--data", "missing.jsonl"], "not found: missing.jsonl"),
        (["eval", "--model", "NAME", "--model-url", "http://127.0.0.1:9/v1"], "unreachable"),
        (["eval", "--model", "replay:nothing.jsonl#col"], "no such file"),
        (["eval", "-c", "0"], "concurrency must be >= 1"),
        (["eval", "--resume"], "--resume needs --out"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    out = lowwater(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr


def test_malformed_data_line_names_its_number(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": oops}\n')
    out = lowwater("eval", "gsm8k", "--data", str(data), "--out", "r.jsonl", cwd=tmp_path)
    assert out.returncode == 2 and "line 2" in out.stderr and "Traceback" not in out.stderr


def test_existing_results_are_not_overwritten(tmp_path):
    assert lowwater("eval", "-n", "2", "--out", "r.jsonl", cwd=tmp_path).returncode == 0
    before = (tmp_path / "r.jsonl").read_bytes()
    out = lowwater("eval", "-n", "2", "--out", "r.jsonl", cwd=tmp_path)
    assert out.returncode == 2 and "--resume" in out.stderr
    assert (tmp_path / "r.jsonl").read_bytes() == before


def test_resume_after_sigkill_has_one_row_per_task(tmp_path):
    out = tmp_path / "r.jsonl"
    n = 40
    proc = start_eval(
        "-n", str(n), "-c", "2", out=out, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_lines(out, 4)
        os.killpg(proc.pid, signal.SIGKILL)  # the eval and its serve-model child
    finally:
        proc.wait()
    partial = out.read_bytes().count(b"\n") - 1
    assert 3 <= partial < n, "the kill should land mid-run"
    # Simulate the worst case too: a torn last line.
    with open(out, "ab") as f:
        f.write(b'{"task_id": 99, "rollout_id": "r-torn", "rew')
    done = lowwater(
        "eval", "-n", str(n), "-c", "4", "--out", "r.jsonl", "--resume", "--summary-json", "s.json", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    rows = rows_of(out)
    assert sorted(r["task_id"] for r in rows) == list(range(n))  # no loss, no duplicates
    assert orjson.loads((tmp_path / "s.json").read_bytes())["rollouts"] == n


@needs_gsm8k
@pytest.mark.parametrize(("harness", "n"), [("inprocess", 40), ("program", 6)])
def test_gsm8k_replay_matches_recorded_labels(tmp_path, harness, n):
    column = "175b_verification"
    config = EvalConfig(
        env="gsm8k",
        env_options={"data": str(GSM8K / "test.jsonl")},
        rollouts=n,
        concurrency=8,
        harness=harness,
        model=ModelSpec(
            "replay", f"replay-{column}", replay_path=GSM8K / "example_model_solutions.jsonl", replay_column=column
        ),
        out=tmp_path / "g.jsonl",
    )
    from lowwater.plugins import load

    plugins = load(disabled=())
    if "gsm8k" not in plugins.environments:
        pytest.skip("lowwater-gsm8k is not installed (pip install -e plugins/lowwater-gsm8k)")
    report = trio.run(lambda: run_eval(config, plugins=plugins))
    labels = []
    with open(GSM8K / "example_model_solutions.jsonl", "rb") as f:
        for _, line in zip(range(n), f):
            labels.append(orjson.loads(line)[column]["is_correct"])
    rows = {r["task_id"]: r for r in rows_of(config.out)}
    assert sorted(rows) == list(range(n))
    assert all(r["error"] is None for r in rows.values()), [r["error"] for r in rows.values() if r["error"]][:3]
    agree = sum(rows[i]["metrics"]["correct"] == labels[i] for i in range(n))
    assert agree == n
    assert report.summary["accuracy"] == sum(labels) / n
    assert report.leftovers["trajectories"] == 0 and report.leftovers["intercepts"] == 0
    assert all(r["turns"] >= 1 for r in rows.values())


@needs_gsm8k
def test_gsm8k_in_workers_looks_tasks_up_by_id(tmp_path):
    """A pooled eval hands workers task ids only; GSM8K finds each row with one seek."""
    column = "6b_verification"
    n = 24
    config = EvalConfig(
        env="gsm8k",
        env_options={"data": str(GSM8K / "test.jsonl")},
        rollouts=n,
        concurrency=8,
        workers=2,
        model=ModelSpec(
            "replay", f"replay-{column}", replay_path=GSM8K / "example_model_solutions.jsonl", replay_column=column
        ),
        out=tmp_path / "w.jsonl",
    )
    from lowwater.plugins import load

    if "gsm8k" not in load(disabled=()).environments:
        pytest.skip("lowwater-gsm8k is not installed (pip install -e plugins/lowwater-gsm8k)")
    report = trio.run(run_eval, config)
    with open(GSM8K / "example_model_solutions.jsonl", "rb") as f:
        labels = [orjson.loads(line)[column]["is_correct"] for _, line in zip(range(n), f)]
    rows = {r["task_id"]: r for r in rows_of(config.out)}
    assert sorted(rows) == list(range(n)) and all(r["error"] is None for r in rows.values())
    assert [rows[i]["metrics"]["correct"] for i in range(n)] == labels
    assert report.pool["tasks"] == n


@needs_gsm8k
def test_gsm8k_task_by_id_matches_the_stream(tmp_path):
    pytest.importorskip("lowwater_gsm8k")
    from lowwater_gsm8k.env import DataError, GSM8KEnvironment

    env = GSM8KEnvironment(GSM8K / "test.jsonl")
    tasks = list(env.tasks())
    assert len(tasks) == 1319
    for task in tasks[:20] + tasks[-20:]:
        assert env.task(task.id) == task
    for bad in (1319, -1, "x"):
        with pytest.raises(KeyError):
            env.task(bad)
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "#### 1"}\n\n{"question": 3}\n')
    env = GSM8KEnvironment(data)
    assert env.task(0).answer == "1"
    with pytest.raises(DataError, match="line 3"):
        env.task(1)


@pytest.mark.parametrize(("signum", "workers"), [(signal.SIGINT, 0), (signal.SIGTERM, 0), (signal.SIGINT, 2)])
def test_signal_cancels_the_run_and_resume_completes_it(tmp_path, signum, workers):
    """Ctrl-C (or SIGTERM) mid-run: exit 130 (143), no traceback, every line of the
    results file whole, in-flight rows written as cancelled; --resume re-runs
    the cancelled and unstarted tasks, one row per task."""
    out = tmp_path / "r.jsonl"
    n = 60
    proc = start_eval(
        "-n", str(n), "-c", "2", "--workers", str(workers), out=out, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_lines(out, 4)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err, err
    lines = out.read_bytes().splitlines()
    rows = [orjson.loads(line) for line in lines[1:]]  # every line parses: nothing torn
    assert 3 <= len(rows) < n, "the signal should land mid-run"
    done = lowwater(
        "eval", "-n", str(n), "-c", "4", "--out", "r.jsonl", "--resume", "--workers", str(workers), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert sorted(r["task_id"] for r in rows_of(out)) == list(range(n))
    assert all(r.get("error") is None for r in rows_of(out))


def test_sigkill_of_the_eval_takes_its_serve_model_child_with_it(tmp_path):
    # finally blocks do not run on SIGKILL: the child must die by the kernel's
    # parent-death signal (it kept running after 12 of 12 kills before).
    import psutil

    out = tmp_path / "r.jsonl"
    proc = start_eval(
        "-n", "400", "-c", "2", out=out, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_lines(out, 3)

        def serve_model_children() -> list[psutil.Process]:
            found = []
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "serve-model" in child.cmdline():
                        found.append(child)
                except psutil.Error:  # a runtime or warm worker that just exited (zombie)
                    pass
            return found

        children = serve_model_children()
        assert len(children) == 1
        proc.kill()  # the eval alone, not its process group
        proc.wait()
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == [], f"serve-model outlived its eval: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_n_beyond_the_taskset_says_so(tmp_path):
    out = lowwater("eval", "-n", "9", "--env-option", "size=4", "--out", "r.jsonl", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "-n 9 asked for more tasks than the arithmetic taskset has; ran all 4" in out.stderr
    assert len(rows_of(tmp_path / "r.jsonl")) == 4
    out = lowwater("eval", "-n", "3", "--env-option", "size=4", "--out", "s.jsonl", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0 and "asked for more tasks" not in out.stderr
