"""``lowwater proxy``: the flags of the standalone recording proxy, and the call.

The proxy itself (the interception server with its admin endpoints, their
statuses, shutdown and stale-session cleanup) is
:mod:`lowwater.interception.proxy`; this module validates the flags into a
:class:`~lowwater.interception.proxy.ProxyConfig` and runs
:func:`~lowwater.interception.proxy.serve_proxy` until SIGINT (exit 130) or
SIGTERM (143).  The admin key comes from ``--admin-key-env`` (default
``LOWWATER_ADMIN_KEY``); without one a key is generated and written, mode
0600, to the file the banner names (``--admin-key-file``, else
``$XDG_RUNTIME_DIR/lowwater/proxy-PORT.key``, else ``OUT/proxy-PORT.key``).
``--no-admin-auth`` (tests only) opens the admin endpoints, with a warning,
and then only on a loopback address.  Plugins are loaded as ``lowwater eval``
loads them (their protocols and interceptor hooks apply to every call); the
startup lines name the interceptors in call order.  See ``docs/interception.md``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from lowwater.cli import UsageError
from lowwater.commands.signals import until_signal
from lowwater.redact import redact_url

if TYPE_CHECKING:
    from lowwater.interception.proxy import ProxyConfig

DEFAULT_LISTEN = "127.0.0.1:8700"
# The proxy's modules (lowwater.interception.proxy, lowwater.trainer.sessions)
# are imported inside the functions that need them: every ``lowwater``
# command imports this module to build its parser, and importing them here
# added 130-190 ms and 180 modules to each (measured with build_parser()).


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("proxy", help="run the interception server as a standalone recording proxy")
    p.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="the model server's base URL, with /v1 (e.g. http://127.0.0.1:8000/v1)",
    )
    p.add_argument(
        "--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help=f"address to serve on (default {DEFAULT_LISTEN})"
    )
    p.add_argument(
        "--out",
        default="lowwater-proxy",
        metavar="DIR",
        help="directory for trajectories.jsonl (default ./lowwater-proxy)",
    )
    p.add_argument(
        "--admin-key-env",
        default="LOWWATER_ADMIN_KEY",
        metavar="VAR",
        help="environment variable holding the admin key (default LOWWATER_ADMIN_KEY)",
    )
    p.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="where the generated admin key is written, mode 0600, when --admin-key-env's variable is unset "
        "(default $XDG_RUNTIME_DIR/lowwater/proxy-PORT.key, else OUT/proxy-PORT.key)",
    )
    p.add_argument(
        "--no-admin-auth",
        action="store_true",
        help="FOR TESTS ONLY: no admin key; every local process (the agents included) can set rewards, "
        "export sessions and close rollouts; loopback addresses only",
    )
    p.add_argument("--upstream-key-env", metavar="VAR", help="environment variable holding the upstream's API key")
    p.add_argument("--model", help="replace the model name of every forwarded request")
    p.add_argument(
        "--max-concurrency", type=int, default=1024, help="upstream requests in flight at once (default 1024)"
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="upstream read timeout, seconds (default 600)")
    p.add_argument("--retries", type=int, default=3, help="retries on connect errors, 429 and 5xx (default 3)")
    p.add_argument("--max-body-mib", type=float, default=64, help="request body limit, MiB (default 64)")
    p.add_argument(
        "--request-logprobs", action="store_true", help="ask the upstream for token ids and logprobs (vLLM/SGLang)"
    )
    p.add_argument(
        "--sessions",
        action="store_true",
        help="keep each rollout's calls as a session until its reward is set and it is exported",
    )
    p.add_argument(
        "--session-timeout-s",
        type=float,
        default=3600.0,
        help="a session idle this long is stale and removed (default 3600)",
    )
    p.add_argument(
        "--cleanup-interval-s",
        type=float,
        default=60.0,
        help="seconds between stale-session cleanup passes (default 60)",
    )
    p.add_argument(
        "--dump-dir", metavar="DIR", help="write stale sessions here before freeing them (default: not written)"
    )
    # A long-lived process: on glibc's allocator (lowwater.commands.allocator).
    p.set_defaults(func=run, glibc_malloc=True)
    return p


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``.

    Raises:
        lowwater.cli.UsageError: not of that form, or the port is out of range.
    """
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen must be HOST:PORT, got {listen!r}")
    return host, int(port)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ProxyConfig:
    """Validate the flags.

    Raises:
        lowwater.cli.UsageError: a bad URL, address, number or directory; a
            non-loopback ``--listen`` with ``--no-admin-auth``; an unset
            ``--upstream-key-env`` variable.
    """
    from lowwater.http.exposure import is_loopback
    from lowwater.interception.proxy import ProxyConfig
    from lowwater.trainer.sessions import SessionConfig

    env = os.environ if environ is None else environ
    url = urlsplit(args.upstream)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise UsageError(f"--upstream must be an http(s) URL, got {redact_url(args.upstream)!r}")
    host, port = parse_listen(args.listen)
    admin_key = None if args.no_admin_auth else env.get(args.admin_key_env) or None
    if args.no_admin_auth and not is_loopback(host):
        raise UsageError(
            f"refusing to listen on {host} with --no-admin-auth: drop it (a key is generated) or listen on loopback"
        )
    admin_key_file = None
    if args.admin_key_file:
        admin_key_file = Path(args.admin_key_file)
        _writable_dir("--admin-key-file's directory", str(admin_key_file.parent))
    upstream_key = None
    if args.upstream_key_env:
        upstream_key = env.get(args.upstream_key_env)
        if not upstream_key:
            raise UsageError(f"environment variable {args.upstream_key_env} (from --upstream-key-env) is not set")
    for name in ("max_concurrency", "timeout_s", "max_body_mib"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")
    out_dir = _writable_dir("--out", args.out)
    dump_dir = _writable_dir("--dump-dir", args.dump_dir) if args.dump_dir else None
    try:
        sessions = SessionConfig(
            session_timeout_s=args.session_timeout_s, cleanup_interval_s=args.cleanup_interval_s, dump_dir=dump_dir
        )
    except ValueError as exc:
        raise UsageError(f"--{str(exc).replace('_', '-')}") from None
    return ProxyConfig(
        upstream=args.upstream,
        host=host,
        port=port,
        out_dir=out_dir,
        admin_key=admin_key,
        admin_key_file=admin_key_file,
        admin_auth=not args.no_admin_auth,
        upstream_key=upstream_key,
        model=args.model,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout_s,
        retries=args.retries,
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
        request_logprobs=args.request_logprobs,
        sessions=sessions if args.sessions else None,
    )


def _writable_dir(flag: str, path: str) -> Path:
    """``path`` created if missing; :class:`~lowwater.cli.UsageError` naming ``flag`` if it cannot be written."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {directory}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {directory} is not writable")
    return directory


def run(args: argparse.Namespace) -> int:
    from lowwater.interception.proxy import (
        TRAJECTORIES_FILE,
        admin_key_file,
        plugin_summary,
        raise_open_file_limit,
        serve_proxy,
    )
    from lowwater.plugins import PluginError, load

    config = config_from_args(args)
    try:
        # Loaded as `lowwater eval` loads them: without them a redacting
        # interceptor applied to evals but not to calls through the proxy.
        plugins = load()
    except PluginError as exc:  # a LOWWATER_PLUGINS module that cannot be imported, a clash: one line
        raise UsageError(str(exc)) from None
    raise_open_file_limit()
    if not config.admin_auth:
        print(
            "lowwater proxy: WARNING: --no-admin-auth: the admin endpoints are open to every local process, "
            "the agents this proxy serves included (they can set their own rewards, export other sessions, "
            "close other rollouts). For tests only.",
            file=sys.stderr,
            flush=True,
        )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_proxy, config, plugins=plugins))
            key_file = admin_key_file(config, url)
            if key_file is not None:  # the path, never the key
                admin = f"admin key in {key_file}"
            elif config.admin_key is not None:
                admin = f"admin key from {args.admin_key_env}"
            else:
                admin = "NO admin authentication"
            print(
                f"lowwater proxy: listening on {url} -> {redact_url(config.upstream)}; "
                f"admin at {url}/lowwater/ ({admin}); trajectories to {config.out_dir / TRAJECTORIES_FILE}",
                file=sys.stderr,
                flush=True,
            )
            print(f"lowwater proxy: {plugin_summary(plugins)}", file=sys.stderr, flush=True)
            await trio.sleep_forever()

    try:
        # SIGINT and SIGTERM end the proxy by cancellation, so the open
        # rollouts are written (serve_proxy's shielded finally).
        _, signum = trio.run(until_signal, main)
        return 128 + signum if signum else 0  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    except (OSError, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from None  # Ctrl-C, wrapped by Trio's nurseries: cli reports it
        error = _first_os_error(exc)
        if error is None:
            raise
        if error.filename is not None:  # the admin key file, not the address
            raise UsageError(f"cannot write {error.filename}: {error.strerror or error}") from None
        raise UsageError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}") from None


def _first_os_error(exc: BaseException) -> OSError | None:
    """The bind error inside Trio's (possibly nested) exception groups."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_os_error(inner)
            if found is not None:
                return found
    return None
