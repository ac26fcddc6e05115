"""``lowwater serve-model``: a local OpenAI/Anthropic-compatible model for demos, tests and benchmarks.

Prints the bound base URL (``http://HOST:PORT``) alone on the first line of
stdout, flushed, so a parent process can read it; a description goes to
stderr with the OpenAI base URL (``http://HOST:PORT/v1``) and a
``lowwater eval --model NAME --model-url URL`` line to paste as is.  Serves until Ctrl-C or SIGTERM (exit status 0).  Bad input (a missing or
malformed replay file, an unknown column, out-of-range numbers, an address
that cannot be bound) is a one-line :class:`~lowwater.cli.UsageError`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve-model",
        help="serve a scripted or replayed model over the OpenAI and Anthropic HTTP APIs",
        description="Serve a deterministic model at /v1/chat/completions, /v1/responses, /v1/messages "
        "and /v1/models, streamed and not.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1); beyond loopback needs LOWWATER_ADMIN_KEY, which every request "
        "must then carry",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST",
        help="host in the printed URL (default: --host, or this host's address for 0.0.0.0)",
    )
    p.add_argument("--port", type=int, default=0, help="port to bind (default 0: the OS chooses)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--scripted",
        action="store_true",
        help="solve the embedded arithmetic problems with calculator calls; filler text for anything else",
    )
    mode.add_argument(
        "--replay",
        metavar="PATH#COLUMN",
        help="serve recorded solutions: COLUMN of the JSONL file PATH, keyed by question text",
    )
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before each response, ms (default 0)")
    p.add_argument(
        "--completion-tokens",
        type=int,
        default=16,
        help="length of the scripted filler answer, tokens (default 16)",
    )
    p.add_argument(
        "--payload-bytes",
        type=int,
        default=0,
        help="add a string field of this many bytes to every response (default 0: none)",
    )
    p.set_defaults(func=run)
    return p


def build_model(args: argparse.Namespace) -> Any:
    """The model the arguments ask for; :class:`~lowwater.cli.UsageError` on bad input."""
    from lowwater.cli import UsageError
    from lowwater.serve_model import ReplayDataError, ReplayModel, ScriptedModel

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    if args.latency_ms < 0:
        raise UsageError(f"--latency-ms must be >= 0, got {args.latency_ms}")
    if args.completion_tokens < 1:
        raise UsageError(f"--completion-tokens must be >= 1, got {args.completion_tokens}")
    if args.payload_bytes < 0:
        raise UsageError(f"--payload-bytes must be >= 0, got {args.payload_bytes}")
    latency_s = args.latency_ms / 1000
    if args.scripted:
        return ScriptedModel(
            latency_s=latency_s, completion_tokens=args.completion_tokens, payload_bytes=args.payload_bytes
        )
    path, sep, column = args.replay.rpartition("#")
    if not sep or not path or not column:
        raise UsageError(f"--replay wants PATH#COLUMN, got {args.replay!r}")
    try:
        return ReplayModel.from_jsonl(path, column, latency_s=latency_s, payload_bytes=args.payload_bytes)
    except ReplayDataError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    import functools
    import os
    import socket

    import trio

    from lowwater.cli import UsageError
    from lowwater.commands.signals import until_signal
    from lowwater.http.exposure import ADMIN_KEY_ENV, ExposureError, check_bind, is_loopback
    from lowwater.serve_model import serve_model

    model = build_model(args)
    # Beyond loopback the admin key is required, and then checked on every
    # request; an address that cannot even be resolved is reported as such first.
    admin_key = None if is_loopback(args.host) else os.environ.get(ADMIN_KEY_ENV) or None
    try:
        socket.getaddrinfo(args.host, args.port)
    except OSError as err:
        raise UsageError(f"cannot bind {args.host}:{args.port}: {err.strerror or err}") from None
    try:
        check_bind("serve-model", args.host, admin_key)
    except ExposureError as exc:
        raise UsageError(str(exc)) from None
    if args.scripted:
        what = "scripted model (arithmetic problems; filler otherwise)"
    else:
        what = f"replay of {model.name.split(':', 1)[1]!r} ({len(model.solutions)} questions)"

    bind_error: OSError | None = None
    # Started by a run (lowwater.upstream.spec): stop when its pipe closes.
    raw_fd = os.environ.pop("LOWWATER_PARENT_FD", None)
    parent_fd = int(raw_fd) if raw_fd and raw_fd.isdigit() else None

    async def main() -> None:
        nonlocal bind_error
        async with trio.open_nursery() as nursery:
            serving = functools.partial(
                serve_model, model, args.host, args.port, advertise=args.advertise, admin_key=admin_key
            )
            try:
                url = await nursery.start(serving)
            except OSError as err:  # serve_model raises it bare: the address cannot be bound
                bind_error = err
                return
            if parent_fd is not None:
                nursery.start_soon(_stop_with_parent, parent_fd, nursery.cancel_scope)
            print(url, flush=True)
            guard = f"  bound to {args.host}, beyond loopback: every request needs the admin key\n" if admin_key else ""
            # The line to paste: the base URL with its /v1 and the served
            # model's name (a URL pasted without /v1 got a 404 on every call).
            print(
                f"lowwater serve-model: {what}; Ctrl-C to stop\n"
                f"{guard}"
                f"  base URL: {url}/v1\n"
                f"  use it:   lowwater eval --model {model.name} --model-url {url}/v1",
                file=sys.stderr,
                flush=True,
            )

    try:
        # Ctrl-C and SIGTERM (how the eval runner stops its child server) end it by cancellation.
        trio.run(until_signal, main)
    except* KeyboardInterrupt:
        pass  # a second Ctrl-C, during that cancellation: Ctrl-C is how a server is meant to stop
    if bind_error is not None:
        raise UsageError(f"cannot bind {args.host}:{args.port}: {bind_error.strerror or bind_error}")
    print("lowwater serve-model: stopped", file=sys.stderr)
    return 0


async def _stop_with_parent(fd: int, scope: Any) -> None:
    """Cancel ``scope`` once ``fd`` (the read end of the parent's pipe) reaches
    EOF: the parent ended the run or died, even by SIGKILL."""
    import trio

    stream = trio.lowlevel.FdStream(fd)
    try:
        while await stream.receive_some(4096):
            pass
    except OSError:
        pass
    scope.cancel()
