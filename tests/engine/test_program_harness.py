"""The generic program harness: task on stdin, SDK variables in the environment,
the last JSON line as the answer, and a program that cannot start stopping the
run at start-up as an environment error (not a model error per rollout)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import orjson
import pytest
import trio

from lowwater.eval import EvalConfig, run_eval
from lowwater.eval.results import read_rows
from lowwater.program_harness import ProgramStartError, last_json_line, parse_program, start_failure

# Stdlib only: what the program sees, and a chat call through the slot.
AGENT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    task = json.load(sys.stdin)
    seen = {k: bool(os.environ.get(k)) for k in
            ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "LOWWATER_MODEL")}
    assert all(seen.values()), seen
    assert "answer" not in task, "the reference answer must not reach the agent"
    body = json.dumps({"model": os.environ["LOWWATER_MODEL"],
                       "messages": [{"role": "user", "content": task["prompt"]}]}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
        headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    reply = json.load(urllib.request.urlopen(request))
    print("a log line that is not the answer")
    print(json.dumps(reply["choices"][0]["message"]["content"]))
    """
)


def test_last_json_line_and_start_failures():
    assert last_json_line('log\n{"a": 1}\nnot json\n') == (True, {"a": 1})
    assert last_json_line("no json here\n") == (False, None)
    assert last_json_line('"text"\n\n') == (True, "text")
    tb = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'openai'\n"
    assert start_failure(1, tb) == "ModuleNotFoundError: No module named 'openai'"
    assert start_failure(1, "ValueError: bad\n") is None
    assert start_failure(127, "lowwater: cannot run 'nope': No such file or directory\n") == (
        "cannot run 'nope': No such file or directory"
    )
    assert parse_program("python 'my agent.py' --x 1") == ("python", "my agent.py", "--x", "1")
    with pytest.raises(ValueError):
        parse_program("  ")


def _config(tmp_path: Path, program: str, **kw) -> EvalConfig:
    return EvalConfig(
        rollouts=3,
        harness="program",
        program=program,
        out=tmp_path / "r.jsonl",
        persistent=False,
        concurrency=2,
        **kw,
    )


def test_program_agent_answers_through_the_slot(tmp_path: Path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    config = _config(tmp_path, f"{sys.executable} {agent}")
    report = trio.run(run_eval, config)
    assert report.summary["errors"] == 0, report.summary["top_errors"]
    assert report.summary["accuracy"] == 1.0
    header = orjson.loads((tmp_path / "r.jsonl").read_bytes().splitlines()[0])
    assert header["program"] == config.program
    assert header["harness"] == "program"
    _header, rows, _torn = read_rows(tmp_path / "r.jsonl")
    assert len(rows) == 3 and all(row["turns"] >= 1 for row in rows)


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ("{python} {bad}", "ModuleNotFoundError: No module named 'no_such_module_lowwater'"),
        ("no-such-program-lowwater --flag", "cannot run 'no-such-program-lowwater'"),
    ],
)
def test_program_that_cannot_start_is_an_environment_error_at_start(tmp_path: Path, program: str, message: str):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_lowwater\n")
    config = _config(tmp_path, program.format(python=sys.executable, bad=bad))
    with pytest.raises(ProgramStartError, match="environment error") as info:
        trio.run(run_eval, config)
    assert message in str(info.value)
    assert not (tmp_path / "r.jsonl").exists()  # nothing ran: no results file


def test_import_failing_inside_a_rollout_is_environment(tmp_path: Path):
    # Imports only when it has a task: the preflight (empty stdin) passes.
    late = tmp_path / "late.py"
    late.write_text("import sys\nif sys.stdin.read():\n    import no_such_module_lowwater\n")
    report = trio.run(run_eval, _config(tmp_path, f"{sys.executable} {late}", max_error_rate=1.0))
    assert report.errors_by_class.get("environment") == 3
    assert "No module named 'no_such_module_lowwater'" in report.summary["top_errors"][0]["message"]
