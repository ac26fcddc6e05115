"""``lowwater proxy``'s admin endpoints under ``/lowwater/``: open and close
rollouts, write their trajectories, and (with sessions on) rewards and export.

Every endpoint requires the admin key when one is set (``Authorization:
Bearer KEY`` or ``x-api-key: KEY``, compared in constant time), checked
before the path is even looked at.  Answers are JSON; errors are
``{"error": reason}`` with the status below.  The endpoints and their
statuses are listed in :mod:`lowwater.interception.proxy` and
``docs/interception.md``.

:class:`Admin` owns the open rollouts' trajectories (docs/memory-contract.md,
"proxy rollout trajectory"): one is created at ``POST /lowwater/rollouts``
and evicted at ``DELETE`` (or at shutdown, or by the stale-session pass)
once its line is on disk, and evicted even when the write fails.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import trio

from lowwater.http import (
    MAX_JSON_DEPTH,
    HTTPError,
    Receive,
    Router,
    Scope,
    Send,
    handle,
    parse_json,
    read_body,
    require_key,
    send_bytes,
    send_json,
)
from lowwater.ids import check_id
from lowwater.interception.server import InterceptionServer
from lowwater.jsonl import LineFile
from lowwater.memory import Trimmer, rss_bytes
from lowwater.trainer.sessions import (
    CleanupReport,
    Interaction,
    SessionConfig,
    SessionConflict,
    SessionError,
    SessionStore,
    UnknownSession,
    check_export_options,
)
from lowwater.trajectory import Trajectory, Turn

log = logging.getLogger("lowwater.proxy")

#: Body limits of the admin endpoints (bytes): small JSON objects, and an
#: export's list of session ids.
OPTIONS_MAX_BYTES = 1 << 20
EXPORT_MAX_BYTES = 16 << 20


class Admin:
    """The ``/lowwater/`` endpoints, an ASGI app mounted on the interception server.

    Args:
        server: the interception server whose rollouts this opens and closes.
        out_file: where each closed rollout's trajectory is appended as one JSON line.
        admin_key: the key every request must carry (``None``: no key; the
            proxy then listens on loopback only).
        sessions: keep each rollout as a session of a
            :class:`~lowwater.trainer.sessions.SessionStore` with these
            settings (``None``: trajectories only; the session endpoints answer 404).

    Attributes:
        trajectories: the open rollouts' trajectories by rollout id.
        store: the session store, or ``None``.
        written: trajectory lines written so far.
        trimmer: the heap trimmer :meth:`trim_loop` runs after closes.
    """

    def __init__(
        self,
        server: InterceptionServer,
        out_file: Path,
        admin_key: str | None,
        sessions: SessionConfig | None = None,
    ) -> None:
        self.server = server
        # Revoked under the store's lock: a stale session's key stops working
        # at the proxy before its dump is written (docs/design.md#vocabulary: session).
        self.store = SessionStore(sessions, revoke=server.unregister) if sessions is not None else None
        self.out_file = out_file
        # Whole lines or nothing, mode 0600 (lowwater.jsonl): a failed append
        # on a full disk used to leave a partial line that the next rollout's
        # line was appended to, so a good rollout became unparseable.
        self.out = LineFile(out_file)
        self.admin_key = admin_key
        self.trajectories: dict[str, _SessionTrajectory] = {}
        self.written = 0
        self.trimmer = Trimmer(min_interval_s=0.0)  # trim_loop paces it
        self._write_lock = trio.Lock()
        self._dirty = trio.Event()
        self._router = Router()
        self._router.add("GET", "/lowwater/stats", self._get_stats)
        self._router.add("GET", "/lowwater/rollouts", self._list_rollouts)
        self._router.add("POST", "/lowwater/rollouts", self._open_rollout)
        self._router.add("DELETE", "/lowwater/rollouts/{rollout_id}", self._close_rollout)
        self._router.add("GET", "/lowwater/sessions", self._get_sessions)
        self._router.add("POST", "/lowwater/sessions/{session_id}/reward", self._set_reward)
        self._router.add("POST", "/lowwater/export", self._export)

    # -- ASGI --------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await handle(scope, receive, send, self._authorised)

    async def _authorised(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Before routing: a stranger learns nothing, not even which paths exist.
        require_key(scope, self.admin_key)
        await self._router.dispatch(scope, receive, send)

    async def _get_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.stats())

    async def _list_rollouts(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"rollouts": sorted(self.trajectories)})

    async def _open_rollout(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(scope, receive, OPTIONS_MAX_BYTES)
        options = parse_json(raw, max_depth=MAX_JSON_DEPTH) if raw.strip() else {}
        await send_json(send, 200, self.open(options, _host(scope)))

    async def _close_rollout(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, await self.close(_id(scope["path_params"]["rollout_id"], "rollout id")))

    async def _get_sessions(self, scope: Scope, receive: Receive, send: Send) -> None:
        store = self._sessions_on()
        await send_json(send, 200, {**store.stats(), "ready_ids": sorted(store.ready())})

    async def _set_reward(self, scope: Scope, receive: Receive, send: Send) -> None:
        store = self._sessions_on()
        session_id = _id(scope["path_params"]["session_id"], "session id")
        body = parse_json(await read_body(scope, receive, OPTIONS_MAX_BYTES), max_depth=MAX_JSON_DEPTH)
        if not isinstance(body, dict) or "reward" not in body:
            raise HTTPError(400, 'body must be {"reward": NUMBER}')
        with session_errors():
            store.set_reward(session_id, body["reward"])
        await send_json(send, 200, {"session_id": session_id, "reward": body["reward"]})

    async def _export(self, scope: Scope, receive: Receive, send: Send) -> None:
        store = self._sessions_on()
        body = parse_json(await read_body(scope, receive, EXPORT_MAX_BYTES), max_depth=MAX_JSON_DEPTH)
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("session_ids"), list)
            or not all(isinstance(i, str) for i in body["session_ids"])
        ):
            raise HTTPError(400, 'body must be {"session_ids": [STRING, ...], "discount"?, "style"?}')
        for session_id in body["session_ids"]:
            _id(session_id, "each of session_ids")
        discount, style = body.get("discount", 1.0), body.get("style", "individual")
        with session_errors():
            check_export_options(discount, style)
            # Exported sessions' interactions can be large: encoded off the
            # loop, session by session; one that cannot be encoded stays in
            # the store and is named in "failed", the others are exported.
            result = await trio.to_thread.run_sync(store.export_encoded, body["session_ids"], discount, style)
        payload = b'{"records":[%s],"exported":%s,"failed":%s}' % (
            b",".join(result.records),
            _dumps(result.exported),
            _dumps(result.failed),
        )
        await send_bytes(send, 200, payload, "application/json")

    def _sessions_on(self) -> SessionStore:
        if self.store is None:
            raise HTTPError(404, "sessions are off: start the proxy with --sessions")
        return self.store

    # -- rollouts ----------------------------------------------------------------

    def open(self, options: Any, host: str | None) -> dict[str, Any]:
        """Register a rollout; returns ``{"rollout_id", "base_url", "anthropic_base_url", "api_key"}``.

        ``options`` is the request's JSON: ``rollout_id`` (default a random
        hex id), ``task_id``, ``group_id``.  ``host`` is the request's
        ``Host`` header: the agent reaches the proxy the way the admin
        client did (``None``: the server's own URL).

        Raises:
            HTTPError: 400 on bad options, 409 if the id is open already or
                still held as a session.
        """
        if not isinstance(options, dict):
            raise HTTPError(400, "body must be a JSON object")
        rollout_id = options.get("rollout_id")
        rollout_id = uuid.uuid4().hex if rollout_id is None else _id(rollout_id, "rollout_id")
        task_id = options.get("task_id", "")
        group_id = options.get("group_id")
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
        root = f"http://{host}" if host else self.server.url
        return {"rollout_id": rollout_id, "base_url": f"{root}/v1", "anthropic_base_url": root, "api_key": slot.secret}

    async def close(self, rollout_id: str) -> dict[str, Any]:
        """Unregister, write the trajectory's line (off the loop), evict; returns
        ``{"rollout_id", "turns", "swept"}``.

        Raises:
            HTTPError: 404 if no such rollout is open; 507 if the line could
                not be written (a full disk: the file is left with whole
                lines only, and the trajectory is evicted all the same); 500
                if the trajectory could not be encoded (a line with the
                error and the rollout's ids is written in its place).  The
                reason names the rollout.  Nothing else is raised: each
                close is on its own (shutdown and the stale pass go on to
                the next rollout).
        """
        trajectory = self.trajectories.get(rollout_id)
        if trajectory is None:
            raise HTTPError(404, f"no open rollout {rollout_id}")
        turns = len(trajectory.turns)
        swept = self.server.unregister(rollout_id)
        problem: str | None = None
        # Shielded: a client that gives up on the DELETE must not leave the
        # trajectory half-closed (unregistered but never written or evicted).
        with trio.CancelScope(shield=True):
            try:
                async with self._write_lock:
                    problem = await trio.to_thread.run_sync(_append_line, self.out, trajectory)
                self.written += 1
            except OSError as exc:  # LineWriteError: nothing of the line is left in the file
                log.error("rollout %s: writing its trajectory failed: %s", rollout_id, exc)
                raise HTTPError(507, f"rollout {rollout_id}: could not write its trajectory: {exc}") from None
            except Exception as exc:  # a bug, not the rollout's: reported, never a bare 500
                log.exception("rollout %s: writing its trajectory failed", rollout_id)
                raise HTTPError(500, f"rollout {rollout_id}: could not write its trajectory: {exc!r}") from None
            finally:
                del self.trajectories[rollout_id]  # evicted on every path
                self._dirty.set()
        if problem is not None:
            log.error(
                "rollout %s: its trajectory could not be encoded (%s); wrote the error instead", rollout_id, problem
            )
            raise HTTPError(
                500,
                f"rollout {rollout_id}: its trajectory could not be encoded ({problem}); "
                "a line with this error was written in its place",
            )
        return {"rollout_id": rollout_id, "turns": turns, "swept": swept}

    def close_file(self) -> None:
        """Flush and close the trajectories file (after :meth:`close_all`, at shutdown)."""
        self.out.close()

    async def close_all(self) -> int:
        """Close every open rollout (at shutdown), each on its own; returns how many
        were written.  A rollout that fails is logged with its reason and the
        next one is closed."""
        written = 0
        for rollout_id in list(self.trajectories):
            try:
                await self.close(rollout_id)
                written += 1
            except HTTPError as exc:
                log.error("shutdown: %s", exc.reason)
        return written

    def _on_turn(self, trajectory: Trajectory, turn: Turn) -> None:
        """Cache a recorded call as an interaction of the rollout's session.

        The interaction shares the turn's objects (the message delta, the
        completion), so an open rollout's calls are held once, not twice.
        """
        assert self.store is not None, "on_turn is set only with sessions on"
        try:
            self.store.add_interaction(
                trajectory.rollout_id,
                Interaction(
                    request=turn.request_delta,
                    response=turn.completion,
                    token_ids=turn.token_ids,
                    logprobs=turn.logprobs,
                    tools=turn.tools,
                ),
            )
        except SessionError:
            pass  # exported, rewarded or stale already: the trajectory line still has the call

    # -- background tasks -----------------------------------------------------------

    async def cleanup_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Stale-session passes every ``cleanup_interval_s`` until cancelled;
        a failing pass is logged and the loop goes on.  Returns at once with sessions off."""
        task_status.started()
        if self.store is None:
            return
        while True:
            await trio.sleep(self.store.config.cleanup_interval_s)
            try:
                await self.cleanup_pass()
            except Exception:
                log.exception("stale-session cleanup pass failed; next in %s s", self.store.config.cleanup_interval_s)

    async def cleanup_pass(self) -> CleanupReport:
        """One pass: the store removes stale sessions (keys revoked and rollouts
        unregistered under its lock, dumped if a dump dir is set), then the
        rollouts still open are closed and written as a ``DELETE`` would."""
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
        """
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            await trio.to_thread.run_sync(self.trimmer)
            await trio.sleep(1.0)

    def stats(self) -> dict[str, Any]:
        """The server's stats (its ``upstream`` counters included) plus
        ``sessions`` (the store's counts or ``None``), ``written``, ``trims``
        and ``rss_bytes`` (the process's current RSS)."""
        return {
            **self.server.stats(),
            "sessions": self.store.stats() if self.store is not None else None,
            "written": self.written,
            "trims": self.trimmer.calls,
            "rss_bytes": rss_bytes(),
        }


class _SessionTrajectory(Trajectory):
    """A trajectory that also hands each recorded turn to ``on_turn(trajectory, turn)``."""

    __slots__ = ("on_turn",)
    on_turn: Callable[[Trajectory, Turn], None]

    def add_turn(self, turn: Turn) -> None:
        super().add_turn(turn)
        on_turn = getattr(self, "on_turn", None)
        if on_turn is not None:
            on_turn(self, turn)


@contextlib.contextmanager
def session_errors() -> Iterator[None]:
    """Answer the session store's refusals by class: :class:`~lowwater.trainer.sessions.UnknownSession`
    404, :class:`~lowwater.trainer.sessions.SessionConflict` 409, ``ValueError`` (a bad reward,
    discount or style) 400."""
    try:
        yield
    except UnknownSession as exc:
        raise HTTPError(404, str(exc)) from None
    except SessionConflict as exc:
        raise HTTPError(409, str(exc)) from None
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None


def _id(value: object, what: str) -> str:
    """``value`` if it is a valid id (:mod:`lowwater.ids`); :class:`HTTPError` 400 naming the rule otherwise."""
    try:
        return check_id(value, what)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None


def _dumps(payload: Any) -> bytes:
    return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)


def _host(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"host":
            return value.decode("latin-1")
    return None


def _append_line(out: LineFile, trajectory: Trajectory) -> str | None:
    """Serialise and append one JSON line (runs in a worker thread: large dumps must not stall the loop).

    Returns ``None``, or why the trajectory could not be encoded: then a line
    with its ids and that error is written instead, so the rollout is never
    missing from the file.

    Raises:
        lowwater.jsonl.LineWriteError: the line could not be appended (the
            file keeps its whole lines only).
    """
    line, problem = encode_trajectory(trajectory)
    out.append(line)
    return problem


def encode_trajectory(trajectory: Trajectory) -> tuple[bytes, str | None]:
    """``(line, None)``: the trajectory as one JSON line; or ``(error line, reason)``
    when it cannot be encoded (intake refuses what orjson cannot write, so
    this is a bug's trace, not an agent's doing)."""
    try:
        return orjson.dumps(trajectory.to_json(), option=orjson.OPT_NON_STR_KEYS) + b"\n", None
    except Exception as exc:  # orjson.JSONEncodeError is a TypeError: nesting, an unknown type
        problem = f"{type(exc).__name__}: {exc}"
    stub = {
        "rollout_id": trajectory.rollout_id,
        "task_id": trajectory.task_id,
        "group_id": trajectory.group_id,
        "turns": None,
        "error": f"the trajectory could not be encoded: {problem}",
    }
    return orjson.dumps(stub, default=repr) + b"\n", problem
