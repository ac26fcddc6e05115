"""The GSM8K replay the benches share: where the data lives (beside the
checkout, see the README's GSM8K section), the ``lowwater eval gsm8k`` command
over it, and the recorded labels its rows are compared with."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SOLUTIONS = DATA / "example_model_solutions.jsonl"


def replay_model(column: str) -> str:
    """The ``--model`` spec replaying the recorded solutions of ``column``."""
    return f"replay:{SOLUTIONS}#{column}"


def eval_cmd(a: argparse.Namespace, out: Path, summary: Path, *extra: str, concurrency: int | None = None) -> list[str]:
    """``lowwater eval gsm8k`` on the first ``a.tasks`` test problems, ``-c`` of
    ``concurrency`` (``a.concurrency`` if None), the model replaying column
    ``a.column``; rows to ``out``, the summary JSON to ``summary``, no progress bar;
    ``extra`` flags appended."""
    return [
        sys.executable,
        "-m",
        "lowwater",
        "eval",
        "gsm8k",
        "--data",
        str(DATA / "test.jsonl"),
        "--model",
        replay_model(a.column),
        "-n",
        str(a.tasks),
        "-c",
        str(a.concurrency if concurrency is None else concurrency),
        "--out",
        str(out),
        "--summary-json",
        str(summary),
        "--no-progress",
        *extra,
    ]


def labels(column: str, n: int) -> list[bool]:
    """The recorded ``is_correct`` of ``column`` for the first ``n`` test problems, in order."""
    out = []
    with open(SOLUTIONS, "rb") as f:
        for _, line in zip(range(n), f):
            out.append(json.loads(line)[column]["is_correct"])
    return out


def add_replay_flags(p: argparse.ArgumentParser, *, concurrency_help: str) -> None:
    """Declare ``--tasks``, ``--concurrency`` and ``--column``: what :func:`eval_cmd` reads."""
    p.add_argument("--tasks", type=int, default=1319, help="GSM8K test problems, from the first (default all 1319)")
    p.add_argument("--concurrency", type=int, default=32, help=concurrency_help)
    p.add_argument("--column", default="175b_verification", help="recorded solutions to replay")
