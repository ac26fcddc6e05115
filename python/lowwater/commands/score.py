"""``lowwater score RUN.jsonl``: re-score a run's transcripts with the
environment's current rubric, without calling the model
(:mod:`lowwater.eval.rescore`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "score",
        help="re-score a run's transcripts with the environment's current rubric (no model calls)",
        description="Re-score RUN.jsonl from its samples file with the environment's (possibly changed) rubric; "
        "writes a new results file and prints what changed.",
    )
    p.add_argument("results", type=Path, metavar="RUN.jsonl", help="the results file of a run (with its samples file)")
    p.add_argument("--out", type=Path, help="rescored results file (default RUN.rescored.jsonl; must not exist)")
    p.add_argument("--data", help="the environment's data file, if it moved since the run")
    p.add_argument(
        "--env-option", action="append", default=[], metavar="KEY=VALUE", help="override an environment option"
    )
    p.add_argument("-c", "--concurrency", type=int, default=8, help="rollouts scored at once (default 8)")
    p.add_argument("--summary-json", type=Path, help="write the rescored summary figures as JSON here")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import trio

    from lowwater.cli import UsageError
    from lowwater.commands.eval import env_options
    from lowwater.eval.rescore import rescore
    from lowwater.eval.results import ResultsFileError
    from lowwater.plugins import UnknownName

    if not args.results.is_file():
        raise UsageError(f"no such results file: {args.results}")
    if args.concurrency < 1:
        raise UsageError(f"concurrency must be >= 1, not {args.concurrency}")
    options = env_options(args)
    try:
        report = trio.run(lambda: rescore(args.results, args.out, env_options=options, concurrency=args.concurrency))
    except (ResultsFileError, UnknownName, ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    s = report.summary
    before = report.before
    was = f"{100 * before['accuracy']:.2f} % -> " if before else ""
    print(
        f"lowwater score: rescored {report.rescored} rollouts ({report.changed} changed, {report.copied} copied "
        f"unchanged); accuracy {was}{100 * s['accuracy']:.2f} %; reward mean {s['reward_mean']:.4f}; "
        f"written to {report.out}"
    )
    if args.summary_json is not None:
        args.summary_json.write_bytes(orjson.dumps(s, option=orjson.OPT_INDENT_2) + b"\n")
    return 0
