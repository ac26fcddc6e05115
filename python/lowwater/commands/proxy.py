"""``lowwater proxy``: the interception server as a standalone recording proxy.

Agents call it as they would call the model (OpenAI chat completions and
responses, Anthropic messages; streamed or not); each rollout's calls are
recorded as the turns of its trajectory and written out when the rollout is
closed.  Admin endpoints (JSON; every one requires the admin key, as
``Authorization: Bearer KEY`` or ``x-api-key: KEY``, when one is set):

* ``POST /lowwater/rollouts`` — open a rollout.  Optional body
  ``{"rollout_id", "task_id", "group_id"}``.  Answers ``{"rollout_id",
  "base_url", "anthropic_base_url", "api_key"}``: point ``OPENAI_BASE_URL``
  at ``base_url`` (it ends in ``/v1``) and ``OPENAI_API_KEY`` at ``api_key``.
  409 if the id is open already.
* ``DELETE /lowwater/rollouts/{id}`` — close it: sweep its undelivered
  calls (their agents get 410 at once), append its trajectory as one JSON
  line to ``OUT/trajectories.jsonl`` (off the event loop), then evict it.
  Answers ``{"rollout_id", "turns", "swept"}``; 404 if unknown.
* ``GET /lowwater/rollouts`` — the open rollout ids.
* ``POST /lowwater/sessions/{id}/reward`` — body ``{"reward": R}``: the
  rollout's session becomes ready (idempotent; 409 for a different reward,
  404 if unknown).  With ``--sessions`` every rollout is also a session of
  the trainer-facing session store (:mod:`lowwater.trainer.sessions`), keyed by its
  API key, holding its calls as interactions until exported or found stale
  (without it the session endpoints answer 404 and nothing outlives a
  rollout's ``DELETE``).
* ``POST /lowwater/export`` — body ``{"session_ids": [...], "discount": 1.0,
  "style": "individual" | "concat"}``: the sessions' interactions with
  discounted rewards; exported sessions are removed (409 if one is not
  ready, 404 if unknown; nothing is removed then).
* ``GET /lowwater/sessions`` — the store's counts and the ready session ids.
* ``GET /lowwater/stats`` — ``intercepts`` (the intercept table's stats),
  ``open_rollouts``, ``waiting_handlers``, ``calls``, ``upstream`` (the
  model client's counters) and ``rss_bytes`` (current RSS of the proxy).

The admin key comes from the environment variable ``--admin-key-env``
(default ``LOWWATER_ADMIN_KEY``); without one the proxy refuses to listen on
anything but a loopback address.  On shutdown (SIGINT: exit 130; SIGTERM: 143) the rollouts still open are
closed and written like a ``DELETE`` would.

Stale cleanup: every ``--cleanup-interval-s`` a pass removes sessions idle
for ``--session-timeout-s`` (their keys revoked and their rollouts
unregistered first, under the store lock), dumps each to ``--dump-dir``
when one is set (one ``SESSION_ID.json``, mode 0600), and closes the
rollouts still open (their lines written as a ``DELETE`` would).  A peer's
data proxy defined such a loop and never scheduled it; its sessions lived
for the life of the process.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import resource
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import attrs

from lowwater.trajectory import Trajectory

log = logging.getLogger("lowwater.proxy")

DEFAULT_LISTEN = "127.0.0.1:8700"
TRAJECTORIES_FILE = "trajectories.jsonl"
# Closing the rollouts left open at shutdown may not take longer than this (seconds).
SHUTDOWN_WRITE_S = 30.0


@attrs.frozen
class ProxyConfig:
    """Validated ``lowwater proxy`` settings (see :func:`config_from_args`)."""

    upstream: str
    host: str = "127.0.0.1"
    port: int = 8700
    out_dir: Path = Path("lowwater-proxy")
    admin_key: str | None = None
    upstream_key: str | None = None
    model: str | None = None
    max_concurrency: int = 1024
    timeout_s: float = 600.0
    retries: int = 3
    max_body_bytes: int = 64 << 20
    request_logprobs: bool = False
    sessions: Any = None  # a SessionConfig: keep sessions (--sessions); None: trajectories only


def _session_config(**kwargs: Any) -> Any:
    from lowwater.trainer.sessions import SessionConfig

    return SessionConfig(**kwargs)


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
        help=f"directory for {TRAJECTORIES_FILE} (default ./lowwater-proxy)",
    )
    p.add_argument(
        "--admin-key-env",
        default="LOWWATER_ADMIN_KEY",
        metavar="VAR",
        help="environment variable holding the admin key (default LOWWATER_ADMIN_KEY)",
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
    p.set_defaults(func=run)
    return p


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``.

    Raises:
        lowwater.cli.UsageError: not of that form, or the port is out of range.
    """
    from lowwater.cli import UsageError

    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen must be HOST:PORT, got {listen!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ProxyConfig:
    """Validate the flags.

    Raises:
        lowwater.cli.UsageError: a bad URL, address, number or directory; a
            non-loopback ``--listen`` without an admin key; an unset
            ``--upstream-key-env`` variable.
    """
    from lowwater.cli import UsageError

    env = os.environ if environ is None else environ
    url = urlsplit(args.upstream)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise UsageError(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    host, port = parse_listen(args.listen)
    admin_key = env.get(args.admin_key_env) or None
    if admin_key is None and not is_loopback(host):
        raise UsageError(
            f"refusing to listen on {host} without an admin key: set {args.admin_key_env} "
            "(or listen on a loopback address)"
        )
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
        sessions = _session_config(
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
    from lowwater.cli import UsageError

    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {directory}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {directory} is not writable")
    return directory


class Admin:
    """The ``/lowwater/`` endpoints (an ASGI app mounted on the interception server).

    Owner of the open rollouts' trajectories: one is created at ``POST`` and
    evicted at ``DELETE`` (or at shutdown) once its line is on disk.
    """

    def __init__(self, server: Any, out_file: Path, admin_key: str | None, sessions: Any = None) -> None:
        import trio

        from lowwater.trainer.sessions import SessionStore

        self.server = server
        # Revoked under the store's lock: a stale session's key stops working
        # at the proxy before its dump is written (docs/design.md#vocabulary: session).
        self.store = SessionStore(sessions, revoke=server.unregister) if sessions is not None else None
        self.out_file = out_file
        self.admin_key = admin_key
        self.trajectories: dict[str, Any] = {}
        self._write_lock = trio.Lock()
        self.written = 0
        from lowwater.memory import Trimmer

        self.trimmer = Trimmer(min_interval_s=0.0)  # trim_loop paces it
        self._dirty = trio.Event()
        # Upstream connections pruned after a burst free memory without a
        # close: they call for a trim too.
        server.on_pruned = lambda closed: self._dirty.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from lowwater.http import handle

        await handle(scope, receive, send, self._route)

    def _check_key(self, scope: Any) -> None:
        from lowwater.http import HTTPError

        if self.admin_key is None:
            return
        given = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    given = token.strip()
            elif name == b"x-api-key" and not given:
                given = value.decode("latin-1").strip()
        if not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            raise HTTPError(401, "missing or wrong admin key")

    async def _route(self, scope: Any, receive: Any, send: Any) -> None:
        import trio

        from lowwater.http import HTTPError, parse_json, read_body, send_bytes, send_json

        self._check_key(scope)
        method, path = scope["method"], scope["path"].rstrip("/")
        if path == "/lowwater/stats":
            if method != "GET":
                raise HTTPError(405, "use GET")
            return await send_json(send, 200, self.stats())
        if path == "/lowwater/rollouts":
            if method == "GET":
                return await send_json(send, 200, {"rollouts": sorted(self.trajectories)})
            if method != "POST":
                raise HTTPError(405, "use POST to open a rollout")
            raw = await read_body(scope, receive, 1 << 20)
            options = parse_json(raw) if raw.strip() else {}
            return await send_json(send, 200, self.open(options, _host(scope)))
        if path.startswith("/lowwater/rollouts/"):
            if method != "DELETE":
                raise HTTPError(405, "use DELETE to close a rollout")
            rollout_id = unquote(path.removeprefix("/lowwater/rollouts/"))
            return await send_json(send, 200, await self.close(rollout_id))
        if path.startswith(("/lowwater/sessions", "/lowwater/export")) and self.store is None:
            raise HTTPError(404, "sessions are off: start the proxy with --sessions")
        if path == "/lowwater/sessions":
            if method != "GET":
                raise HTTPError(405, "use GET")
            return await send_json(send, 200, {**self.store.stats(), "ready_ids": sorted(self.store.ready())})
        if path.startswith("/lowwater/sessions/") and path.endswith("/reward"):
            if method != "POST":
                raise HTTPError(405, "use POST to set a reward")
            session_id = unquote(path.removeprefix("/lowwater/sessions/").removesuffix("/reward"))
            body = parse_json(await read_body(scope, receive, 1 << 20))
            if not isinstance(body, dict) or "reward" not in body:
                raise HTTPError(400, 'body must be {"reward": NUMBER}')
            with _session_errors():
                self.store.set_reward(session_id, body["reward"])
            return await send_json(send, 200, {"session_id": session_id, "reward": body["reward"]})
        if path == "/lowwater/export":
            if method != "POST":
                raise HTTPError(405, "use POST to export sessions")
            body = parse_json(await read_body(scope, receive, 16 << 20))
            if (
                not isinstance(body, dict)
                or not isinstance(body.get("session_ids"), list)
                or not all(isinstance(i, str) for i in body["session_ids"])
            ):
                raise HTTPError(400, 'body must be {"session_ids": [STRING, ...], "discount"?, "style"?}')
            with _session_errors():
                records = self.store.export(
                    body["session_ids"], body.get("discount", 1.0), body.get("style", "individual")
                )
            # Exported sessions' interactions can be large: serialised off the loop.
            payload = await trio.to_thread.run_sync(_dumps, {"records": records})
            return await send_bytes(send, 200, payload, "application/json")
        raise HTTPError(404, f"no endpoint {method} {path}")

    def open(self, options: Any, host: str | None) -> dict[str, Any]:
        """Register a rollout; :class:`~lowwater.http.HTTPError` 400/409 on bad options."""
        from lowwater.http import HTTPError

        if not isinstance(options, dict):
            raise HTTPError(400, "body must be a JSON object")
        rollout_id = options.get("rollout_id") or uuid.uuid4().hex
        task_id = options.get("task_id", "")
        group_id = options.get("group_id")
        if not isinstance(rollout_id, str) or "/" in rollout_id:
            raise HTTPError(400, "rollout_id must be a string without '/'")
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise HTTPError(400, "task_id must be a string or an integer")
        if group_id is not None and not isinstance(group_id, str):
            raise HTTPError(400, "group_id must be a string")
        if rollout_id in self.trajectories:
            raise HTTPError(409, f"rollout {rollout_id} is already open")
        if self.store is not None and rollout_id in self.store:
            raise HTTPError(
                409, f"session {rollout_id} is still held (set its reward and export it, or wait for cleanup)"
            )
        trajectory = _SessionTrajectory(rollout_id, task_id, group_id)
        slot = self.server.register(trajectory)
        if self.store is not None:
            self.store.start_session(group_id, session_id=rollout_id, api_key=slot.secret)
            trajectory.on_turn = self._on_turn
        self.trajectories[rollout_id] = trajectory
        # The agent reaches the proxy the way the admin client did.
        root = f"http://{host}" if host else self.server.url
        return {"rollout_id": rollout_id, "base_url": f"{root}/v1", "anthropic_base_url": root, "api_key": slot.secret}

    async def close(self, rollout_id: str) -> dict[str, Any]:
        """Unregister, write the trajectory's line, evict; :class:`~lowwater.http.HTTPError` 404 if unknown."""
        import trio

        from lowwater.http import HTTPError

        trajectory = self.trajectories.get(rollout_id)
        if trajectory is None:
            raise HTTPError(404, f"no open rollout {rollout_id}")
        turns = len(trajectory.turns)
        swept = self.server.unregister(rollout_id)
        # Shielded: a client that gives up on the DELETE must not leave the
        # trajectory half-closed (unregistered but never written or evicted).
        with trio.CancelScope(shield=True):
            try:
                async with self._write_lock:
                    await trio.to_thread.run_sync(_append_line, self.out_file, trajectory)
                self.written += 1
            except OSError as exc:
                log.error("rollout %s: writing its trajectory failed: %s", rollout_id, exc)
                raise HTTPError(500, f"could not write the trajectory: {exc}") from None
            finally:
                del self.trajectories[rollout_id]  # evicted on every path
                self._dirty.set()
        return {"rollout_id": rollout_id, "turns": turns, "swept": swept}

    def _on_turn(self, trajectory: Any, turn: Any) -> None:
        """Cache a recorded call as an interaction of the rollout's session.

        The interaction shares the turn's objects (the message delta, the
        completion), so an open rollout's calls are held once, not twice.
        """
        from lowwater.trainer.sessions import Interaction, SessionError

        try:
            self.store.add_interaction(
                trajectory.rollout_id,
                Interaction(
                    request=turn.request_delta,
                    response=turn.completion,
                    token_ids=turn.token_ids,
                    logprobs=turn.logprobs,
                ),
            )
        except SessionError:
            pass  # exported, rewarded or stale already: the trajectory line still has the call

    async def cleanup_loop(self, *, task_status: Any = None) -> None:
        """Stale-session passes every ``cleanup_interval_s`` until cancelled;
        a failing pass is logged and the loop goes on."""
        import trio

        if task_status is not None:
            task_status.started()
        if self.store is None:
            return
        while True:
            await trio.sleep(self.store.config.cleanup_interval_s)
            try:
                await self.cleanup_pass()
            except Exception:
                log.exception("stale-session cleanup pass failed; next in %s s", self.store.config.cleanup_interval_s)

    async def cleanup_pass(self) -> Any:
        """One pass (see the module docstring); returns the store's :class:`~lowwater.trainer.sessions.CleanupReport`."""
        from lowwater.http import HTTPError

        assert self.store is not None, "sessions are off"
        report = await self.store.cleanup_pass()
        for session_id in report.removed:
            if session_id in self.trajectories:
                try:
                    await self.close(session_id)
                except HTTPError as exc:
                    log.warning("stale rollout %s: %s", session_id, exc.reason)
        if report.removed:
            log.info("removed %d stale sessions (%d dumped)", len(report.removed), len(report.dumped))
        return report

    async def trim_loop(self) -> None:
        """Give freed memory back to the OS after closes: off the loop, at most once a second,
        and once more after the last close of a burst.

        glibc keeps freed heap pages (a closed rollout's turns, its table
        entry, its connection's buffers) unless trimmed: after 16,384
        rollouts were closed the proxy stayed 600 MB over its baseline
        without this.

        Upstream connections the interception server prunes after a burst
        (idle past their keep-alive expiry) free memory without a close: the
        server's ``on_pruned`` marks the proxy dirty as a close does.
        """
        import trio

        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            await trio.to_thread.run_sync(self.trimmer)
            await trio.sleep(1.0)

    async def close_all(self) -> int:
        """Close every open rollout (at shutdown); returns how many were written."""
        from lowwater.http import HTTPError

        written = 0
        for rollout_id in list(self.trajectories):
            try:
                await self.close(rollout_id)
                written += 1
            except HTTPError:
                pass
        return written

    def stats(self) -> dict[str, Any]:
        from lowwater.memory import rss_bytes

        stats = self.server.stats()
        upstream = self.server.upstream
        return {
            **stats,
            "upstream": upstream.stats() if upstream is not None else None,
            "sessions": self.store.stats() if self.store is not None else None,
            "written": self.written,
            "trims": self.trimmer.calls,
            "rss_bytes": rss_bytes(),
        }


class _SessionTrajectory(Trajectory):
    """A trajectory that also hands each recorded turn to ``on_turn(trajectory, turn)``."""

    __slots__ = ("on_turn",)

    def add_turn(self, turn: Any) -> None:
        super().add_turn(turn)
        on_turn = getattr(self, "on_turn", None)
        if on_turn is not None:
            on_turn(self, turn)


def _session_errors() -> Any:
    """Map :class:`~lowwater.trainer.sessions.UnknownSession` to 404,
    :class:`~lowwater.trainer.sessions.SessionConflict` to 409, ValueError to 400."""
    import contextlib

    from lowwater.http import HTTPError
    from lowwater.trainer.sessions import SessionConflict, UnknownSession

    @contextlib.contextmanager
    def mapping() -> Any:
        try:
            yield
        except UnknownSession as exc:
            raise HTTPError(404, str(exc)) from None
        except SessionConflict as exc:
            raise HTTPError(409, str(exc)) from None
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None

    return mapping()


def _dumps(payload: Any) -> bytes:
    import orjson

    return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)


def _host(scope: Any) -> str | None:
    for name, value in scope["headers"]:
        if name == b"host":
            return value.decode("latin-1")
    return None


def _append_line(path: Path, trajectory: Any) -> None:
    """Serialise and append one JSON line (runs in a worker thread: large dumps must not stall the loop)."""
    import orjson

    line = orjson.dumps(trajectory.to_json(), option=orjson.OPT_NON_STR_KEYS) + b"\n"
    with open(path, "ab") as f:
        f.write(line)


async def serve_proxy(config: ProxyConfig, *, task_status: Any = None) -> None:
    """Run the proxy until cancelled; ``task_status.started`` gets its root URL.

    Raises:
        OSError: the address cannot be bound.
    """
    import trio

    from lowwater.interception import InterceptionServer
    from lowwater.upstream.client import ModelClient

    async with ModelClient(
        config.upstream,
        api_key=config.upstream_key,
        model=config.model,
        max_concurrency=config.max_concurrency,
        timeout_s=config.timeout_s,
        retries=config.retries,
    ) as client:
        server = InterceptionServer(
            client, max_body_bytes=config.max_body_bytes, request_logprobs=config.request_logprobs
        )
        admin = Admin(server, config.out_dir / TRAJECTORIES_FILE, config.admin_key, config.sessions)
        server.mount("/lowwater/", admin)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(admin.trim_loop)
                await nursery.start(admin.cleanup_loop)
                url = await nursery.start(server.run, config.host, config.port)
                if task_status is not None:
                    task_status.started(url)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_WRITE_S):
                written = await admin.close_all()
                if written:
                    log.warning("shutdown: wrote %d rollouts that were still open", written)


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (each open call holds
    two sockets); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def run(args: argparse.Namespace) -> int:
    import trio

    from lowwater.commands.signals import until_signal

    config = config_from_args(args)
    raise_open_file_limit()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_proxy, config)
            admin = "admin key required" if config.admin_key else "no admin key (loopback only)"
            print(
                f"lowwater proxy: listening on {url} -> {config.upstream}; "
                f"admin at {url}/lowwater/ ({admin}); trajectories to {config.out_dir / TRAJECTORIES_FILE}",
                file=sys.stderr,
                flush=True,
            )
            await trio.sleep_forever()

    try:
        # SIGINT and SIGTERM end the proxy by cancellation, so the open
        # rollouts are written (serve_proxy's shielded finally).
        _, signum = trio.run(until_signal, main)
        return 128 + signum if signum else 0  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    except (OSError, BaseExceptionGroup) as exc:
        from lowwater.cli import UsageError

        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from None  # Ctrl-C, wrapped by Trio's nurseries: cli reports it
        error = _first_os_error(exc)
        if error is None:
            raise
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
