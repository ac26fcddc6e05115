"""``lowwater serve-model``: argument errors are one line and exit 2; the server prints its URL and stops on Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import httpx
import pytest

from lowwater.cli import UsageError
from lowwater.commands import serve_model as command

from ._client import SOLUTIONS, requires_data

# Runs the real ``lowwater`` entry point, registering the subcommand if cli.py does not yet.
MAIN = (
    "import sys; from lowwater import cli; "
    "name = 'lowwater.commands.serve_model'; "
    "cli.SUBCOMMANDS.append(name) if name not in cli.SUBCOMMANDS else None; "
    "sys.exit(cli.main())"
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowwater")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve-model", *argv])


@requires_data
def test_bad_input_is_a_usage_error(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "c": "s"}\n{"question": "r", "c": "t"\n')
    cases = [
        (["--replay", str(tmp_path / "missing.jsonl") + "#c"], "cannot read"),
        (["--replay", f"{SOLUTIONS}#175b"], "unknown column '175b' (columns: ground_truth, 6b_finetuning"),
        (["--replay", f"{broken}#c"], f"{broken}:2: malformed JSON line"),
        (["--replay", str(SOLUTIONS)], "wants PATH#COLUMN"),
        (["--replay", f"{SOLUTIONS}#"], "wants PATH#COLUMN"),
        (["--scripted", "--port", "70000"], "--port must be between 0 and 65535"),
        (["--scripted", "--latency-ms", "-1"], "--latency-ms must be >= 0"),
        (["--scripted", "--completion-tokens", "0"], "--completion-tokens must be >= 1"),
        (["--scripted", "--payload-bytes", "-5"], "--payload-bytes must be >= 0"),
    ]
    for argv, message in cases:
        with pytest.raises(UsageError) as info:
            command.build_model(parse(*argv))
        assert message in str(info.value) and "\n" not in str(info.value), (argv, info.value)


@requires_data
def test_models_from_arguments():
    model = command.build_model(
        parse("--scripted", "--latency-ms", "250", "--completion-tokens", "9", "--payload-bytes", "64")
    )
    assert (model.latency_s, model.completion_tokens, model.payload_bytes) == (0.25, 9, 64)
    model = command.build_model(parse("--replay", f"{SOLUTIONS}#6b_verification", "--payload-bytes", "8"))
    assert model.name == "replay:6b_verification" and len(model.solutions) == 1319 and model.payload_bytes == 8
    with pytest.raises(SystemExit):  # argparse: exactly one mode
        parse("--scripted", "--replay", f"{SOLUTIONS}#ground_truth")


def test_errors_through_the_entry_point_are_one_line_exit_2():
    for argv, message in [
        (["--replay", "/nonexistent/solutions.jsonl#x"], "cannot read /nonexistent/solutions.jsonl"),
        (["--scripted", "--host", "256.0.0.1"], "cannot bind 256.0.0.1:0"),
    ]:
        done = subprocess.run(
            [sys.executable, "-c", MAIN, "serve-model", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("lowwater serve-model: error: ") and message in done.stderr
        assert done.stderr.count("\n") == 1 and done.stdout == ""


@requires_data
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_serves_until_ctrl_c_or_sigterm(stop):
    with subprocess.Popen(
        [sys.executable, "-c", MAIN, "serve-model", "--replay", f"{SOLUTIONS}#175b_verification"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:"), url
            r = httpx.get(url + "/v1/models", timeout=10)
            assert r.json()["data"][0]["id"] == "replay:175b_verification"
            if stop == signal.SIGINT:
                busy = subprocess.run(
                    [sys.executable, "-c", MAIN, "serve-model", "--scripted", "--port", url.rsplit(":", 1)[1]],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert busy.returncode == 2 and "cannot bind" in busy.stderr
            proc.send_signal(stop)
            assert proc.wait(timeout=20) == 0
            err = proc.stderr.read()
            assert "1319 questions" in err and "stopped" in err and "Traceback" not in err
        finally:
            if proc.poll() is None:
                proc.kill()
