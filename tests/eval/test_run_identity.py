"""Runs that cannot be mixed: the header records everything that defines a
run, ``--resume`` with any of it different is refused with a one-line diff
(exit 2) and the file is left byte for byte as it was; a run that fails
before its first rollout leaves no file behind."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.header import DEFINING_KEYS, build_header, differences
from lowwater.eval.results import ResultsFileError, prepare, read_rows
from lowwater.upstream.spec import ModelSpec, UpstreamError

from ._cli import lowwater


def test_header_records_every_defining_setting(tmp_path):
    config = EvalConfig(
        env_options={"size": 8},
        sampling={"temperature": 0.5},
        group_size=2,
        max_turns=3,
        timeout_s=30,
        seed=4,
        harness="program",
        persistent=False,
        pass_env=("HF_*",),
        out=tmp_path / "r.jsonl",
    )
    header = build_header(config, "run")
    assert set(DEFINING_KEYS) <= set(header)
    assert header["sampling"] == {"temperature": 0.5} and header["seed"] == 4 and header["group_size"] == 2
    assert header["runtime"] == {"kind": "subprocess", "persistent": False, "pass_env": ["HF_*"]}
    assert header["max_turns"] == 3 and header["timeout_s"] == 30 and header["harness"] == "program"
    assert header["model"] == "scripted" and header["model_kind"] == "scripted"
    assert header["samples"] == "r.samples.jsonl"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"seed": 1}, "seed 0 -> 1"),
        ({"group_size": 4}, "group_size 1 -> 4"),
        ({"harness": "program"}, "harness 'inprocess' -> 'program'"),
        ({"max_turns": 3}, "max_turns 16 -> 3"),
        ({"timeout_s": 5.0}, "timeout_s 600.0 -> 5.0"),
        ({"sampling": {"temperature": 1.0}}, "sampling.temperature (unset) -> 1.0"),
        ({"env_options": {"size": 9}}, "env_options.size (unset) -> '9'"),
        ({"persistent": False}, "runtime.persistent True -> False"),
        ({"model": ModelSpec("url", "gpt", "http://h/v1")}, "model 'scripted' -> 'gpt'"),
    ],
)
def test_resume_with_a_different_setting_is_refused_and_the_file_untouched(tmp_path, change, expected):
    out = tmp_path / "r.jsonl"
    base = EvalConfig(out=out)
    prepare(out, build_header(base, "a"), resume=False, group_size=1, max_attempts=3)
    with open(out, "ab") as f:
        f.write(b'{"task_id": 0, "rollout_id": "r0", "error": null, "reward": 1.0}\n')
    before = out.read_bytes()
    changed = EvalConfig(out=out, resume=True, **change)
    with pytest.raises(ResultsFileError) as info:
        prepare(out, build_header(changed, "b"), resume=True, group_size=changed.group_size, max_attempts=3)
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert out.read_bytes() == before


def test_selection_and_execution_settings_may_change_on_resume(tmp_path):
    a = build_header(EvalConfig(rollouts=4, concurrency=2), "a")
    b = build_header(EvalConfig(rollouts=40, concurrency=32, workers=2, start=0), "b")
    assert differences(a, b) == []


def test_cli_resume_with_another_seed_exits_2_with_one_line(tmp_path):
    assert lowwater("eval", "-n", "2", "--out", "r.jsonl", "--no-progress", cwd=tmp_path).returncode == 0
    before = (tmp_path / "r.jsonl").read_bytes()
    samples_before = (tmp_path / "r.samples.jsonl").read_bytes()
    out = lowwater("eval", "-n", "4", "--out", "r.jsonl", "--resume", "--seed", "1", "--group-size", "2", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "seed 0 -> 1" in lines[0] and "group_size 1 -> 2" in lines[0]
    assert (tmp_path / "r.jsonl").read_bytes() == before
    assert (tmp_path / "r.samples.jsonl").read_bytes() == samples_before
    # the same settings resume fine, and a summary line does not count as a row
    done = lowwater("eval", "-n", "4", "--out", "r.jsonl", "--resume", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    header, rows, _ = read_rows(tmp_path / "r.jsonl")
    assert sorted(r["task_id"] for r in rows) == [0, 1, 2, 3]


def test_a_run_failing_before_its_first_rollout_leaves_no_file(tmp_path):
    out = tmp_path / "r.jsonl"
    config = EvalConfig(out=out, model=ModelSpec("url", "m", "http://127.0.0.1:9/v1"))
    with pytest.raises(UpstreamError):
        trio.run(run_eval, config)
    assert not out.exists() and not (tmp_path / "r.samples.jsonl").exists()
    cli = lowwater("eval", "--model", "m", "--model-url", "http://127.0.0.1:9/v1", "--out", "x.jsonl", cwd=tmp_path)
    assert cli.returncode == 2 and not (tmp_path / "x.jsonl").exists()


def test_a_failed_resume_keeps_the_file_it_resumed(tmp_path):
    out = tmp_path / "r.jsonl"
    trio.run(run_eval, EvalConfig(rollouts=2, out=out))
    config = EvalConfig(rollouts=4, out=out, resume=True, model=ModelSpec("url", "scripted", "http://127.0.0.1:9/v1"))
    with pytest.raises((UpstreamError, ResultsFileError)):
        trio.run(run_eval, config)
    assert out.exists()


def test_ctrl_c_before_the_first_rollout_leaves_no_file(tmp_path):
    import signal
    import socket
    import time

    # A server that accepts connections and never answers: the probe hangs there.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowwater", "eval", "--model", "m", "--model-url", url, "--out", "r.jsonl"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "r.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # the header is written before the model is probed
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        listener.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "before any rollout finished; nothing was written" in err
    assert not (tmp_path / "r.jsonl").exists()
