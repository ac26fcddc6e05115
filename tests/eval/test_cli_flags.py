"""What eval users expect of the command line: no abbreviated flags, "did
you mean", ``--version``, help on every flag, a probe that catches a base
URL without ``/v1``, an honest exit status, task selection, option checks."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import orjson
import pytest

from lowwater.cli import build_parser
from lowwater.eval.results import read_rows, read_summary

from ._cli import lowwater, start_eval, wait_for_lines


def test_misspelt_and_abbreviated_flags_are_refused_with_a_suggestion(tmp_path):
    out = lowwater("eval", "--modle", "x", cwd=tmp_path)
    assert out.returncode == 2 and "did you mean --model?" in out.stderr
    out = lowwater("eval", "--harnes", "program", "--out", "r.jsonl", cwd=tmp_path)
    assert out.returncode == 2 and "did you mean --harness?" in out.stderr
    assert not (tmp_path / "r.jsonl").exists()  # nothing ran


def test_version_and_help_on_every_flag():
    out = subprocess.run([sys.executable, "-m", "lowwater", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and re.match(r"lowwater \S+", out.stdout)
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(choice.help for choice in subs._choices_actions)
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"lowwater {name} {action.option_strings or action.dest} has no help"


@pytest.fixture
def serve_model(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowwater", "serve-model", "--scripted"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        root = proc.stdout.readline().strip()
        yield root, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_base_url_without_v1_fails_at_start_with_a_hint(tmp_path, serve_model):
    root, proc = serve_model
    started = time.monotonic()
    out = lowwater("eval", "--model", "scripted", "--model-url", root, "--out", "r.jsonl", cwd=tmp_path)
    assert out.returncode == 2 and f"did you mean {root}/v1?" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.jsonl").exists()
    # serve-model's pasteable line works as is
    proc.terminate()
    err = proc.stderr.read()
    pasted = re.search(r"use it: +lowwater eval (.*)", err).group(1).split()
    assert pasted[-1] == f"{root}/v1"
    assert time.monotonic() - started < 600  # a guard against a hang, not a timing claim


def test_replay_with_a_model_url_says_replay_is_served_in_process(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    out = lowwater("eval", "--model", f"replay:{data}#col", "--model-url", "http://127.0.0.1:9/v1", cwd=tmp_path)
    assert out.returncode == 2 and "served in-process" in out.stderr and "names the model" in out.stderr


def test_errors_above_max_error_rate_exit_1_with_the_common_message(tmp_path):
    args = ("eval", "-n", "3", "--timeout", "0.001", "--no-progress", "--summary-json")
    out = lowwater(*args, "s.json", "--out", "r.jsonl", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "3 of 3 rollouts (100.0 %) ended in an error, above --max-error-rate 0" in out.stderr
    summary = orjson.loads((tmp_path / "s.json").read_bytes())
    assert summary["error_rate"] == 1.0
    assert summary["top_errors"][0]["class"] == "timeout" and summary["top_errors"][0]["count"] == 3
    assert "rollout deadline" in out.stdout  # the summary table lists the messages
    ok = lowwater(*args, "t.json", "--out", "t.jsonl", "--max-error-rate", "1", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert lowwater("eval", "--max-error-rate", "2", cwd=tmp_path).returncode == 2


def test_the_readme_default_command_exits_0(tmp_path):
    out = lowwater("eval", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("args", "ids"),
    [
        (["--limit", "3"], [0, 1, 2]),
        (["--limit", "5-7"], [4, 5, 6]),
        (["--task-ids", "9,2,30"], [2, 9, 30]),
    ],
)
def test_task_selection(tmp_path, args, ids):
    out = lowwater("eval", *args, "--out", "r.jsonl", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    header, rows, _ = read_rows(tmp_path / "r.jsonl")
    assert sorted(r["task_id"] for r in rows) == ids
    assert read_summary(tmp_path / "r.jsonl")["summary"]["rollouts"] == len(ids)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "7-5"], "START <= END"),
        (["--limit", "x"], "expected N or START-END"),
        (["--limit", "3", "-n", "2"], "both select tasks"),
        (["--task-ids", "3,999"], "--task-ids: arithmetic has no task 999"),
        (["--env-option", "sise=3"], "has no option 'sise'; did you mean 'size'?"),
        (["--data", "x.jsonl"], "has no option 'data'"),
        (["-S", "novalue"], "expected KEY=VALUE"),
    ],
)
def test_bad_selection_and_options_are_one_line(tmp_path, args, message):
    out = lowwater("eval", *args, "--out", "r.jsonl", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_sampling_flags_are_recorded_in_the_header(tmp_path):
    out = lowwater(
        "eval", "-n", "2", "--temperature", "0.5", "--top-p", "0.9", "--max-tokens", "64", "-S", "seed=3",
        "-S", "stop=[\"x\"]", "-S", "note=plain", "--out", "r.jsonl", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    header, _, _ = read_rows(tmp_path / "r.jsonl")
    assert header["sampling"] == {
        "max_tokens": 64, "note": "plain", "seed": 3, "stop": ["x"], "temperature": 0.5, "top_p": 0.9,
    }  # fmt: skip


def test_a_model_server_dying_mid_run_ends_the_run_at_once(tmp_path):
    import psutil

    def cmdline_of(p: psutil.Process) -> list[str]:
        # A short-lived child (a worker that already exited, not yet reaped)
        # has no command line: not the model server.
        try:
            return p.cmdline()
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            return []

    out = tmp_path / "r.jsonl"
    proc = start_eval(
        "-n", "400", "-c", "2", out=out, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_lines(out, 3)
        (child,) = [c for c in psutil.Process(proc.pid).children() if "serve-model" in cmdline_of(c)]
        child.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert "serve-model exited mid-run" in err and "Traceback" not in err
    rows = read_rows(out)[1]
    assert len(rows) < 400  # it stopped, rather than failing every remaining rollout
    assert all(r["error"] is None or r["error"]["class"] in ("cancelled", "model") for r in rows)
