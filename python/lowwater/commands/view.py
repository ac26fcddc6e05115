"""``lowwater view RUN.jsonl``: serve a local web page for a run.

The page (:mod:`lowwater.viewer`) shows the run's config and summary, its
memory plot, a table of rollouts to sort and filter by reward, error class
and group, and each rollout's transcript, loaded on demand.  It binds to
loopback by default (transcripts hold prompts and completions), needs no
network and no build step.  Prints the page's URL alone on the first line
of stdout; serves until Ctrl-C or SIGTERM (exit 0).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "view",
        help="serve a local web page with a run's results, memory plot and transcripts",
        description="Serve a web page for RUN.jsonl: config, summary, memory plot, rollouts and transcripts.",
    )
    p.add_argument("results", type=Path, metavar="RUN.jsonl", help="the results file of a run")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default 0: the OS chooses)")
    p.add_argument("--open", action="store_true", help="open the page in the default web browser")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import trio

    from lowwater.cli import UsageError
    from lowwater.commands.signals import until_signal
    from lowwater.eval.results import ResultsFileError
    from lowwater.excgroups import sole_error
    from lowwater.http import serve
    from lowwater.viewer import Viewer

    if not args.results.is_file():
        raise UsageError(f"no such results file: {args.results}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    try:
        viewer = Viewer(args.results)
    except (ResultsFileError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if not _loopback(args.host):
        print(
            f"lowwater view: warning: binding {args.host} shows this run's prompts and completions to the network",
            file=sys.stderr,
        )
    bind_error: OSError | None = None

    async def main() -> None:
        nonlocal bind_error
        async with trio.open_nursery() as nursery:
            try:
                address = await nursery.start(serve, viewer, args.host, args.port)
            except* OSError as group:  # the address cannot be bound (inside the HTTP layer's groups)
                bind_error = sole_error(group)
                if bind_error is None:
                    raise
            if bind_error is not None:
                return
            url = f"http://{address}/"
            print(url, flush=True)
            print(f"lowwater view: {args.results} at {url}; Ctrl-C to stop", file=sys.stderr, flush=True)
            if args.open:
                import webbrowser

                webbrowser.open(url)

    interrupted = False
    try:
        trio.run(until_signal, main)
    except* KeyboardInterrupt:
        interrupted = True  # a second Ctrl-C, during the cancellation the first one started
    if bind_error is not None:
        raise UsageError(f"cannot bind {args.host}:{args.port}: {bind_error.strerror or bind_error}")
    if not interrupted:
        print("lowwater view: stopped", file=sys.stderr)
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
