"""The session store: the data proxy's memory of black-box agent runs.

A *session* is the trainer-facing record of one rollout served through
``lowwater proxy``: a per-session API key, a group, the interactions (model
calls) it made, and once :meth:`SessionStore.set_reward` is called, a reward
that makes it *ready* for :meth:`SessionStore.export`.

Ownership and eviction (docs/memory-contract.md): the store owns each session
from :meth:`~SessionStore.start_session` until it is exported (removed by the
export) or found stale by a cleanup pass (removed, optionally dumped to disk,
its shards freed).  A peer proxy held sessions forever because its cleanup
loop was never scheduled, and its cleanup released the store lock before
dumping, racing new requests; here :meth:`~SessionStore.run_cleanup` is a
task the caller starts in its nursery, and a pass pops stale sessions and
revokes their keys under the store lock *before* anything else.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import orjson
import trio

from lowwater import LowwaterError
from lowwater.ids import check_id, is_valid_id

log = logging.getLogger("lowwater.trainer.sessions")

ExportStyle = Literal["individual", "concat"]


class SessionError(LowwaterError):
    """A session operation was refused: :class:`UnknownSession` or :class:`SessionConflict`."""


class UnknownSession(SessionError):
    """No session has that id (never started, already exported, or removed as stale)."""


class SessionConflict(SessionError):
    """The session's state refuses the operation: its id or key is taken, it already has
    a (different) reward, or it is not ready for export."""


def _positive(name: str) -> Callable[[Any, Any, float], None]:
    def check(_inst: Any, _attr: Any, value: float) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    return check


@attrs.frozen
class SessionConfig:
    """Session store settings; ``lowwater proxy`` exposes each as a flag.

    Attributes:
        session_timeout_s: a session idle for longer than this is stale (default 3600).
        cleanup_interval_s: seconds between cleanup passes (default 60).
        dump_dir: where stale sessions are written before they are freed
            (one ``SESSION_ID.json`` per trajectory, mode 0600); ``None``: not dumped.
    """

    session_timeout_s: float = attrs.field(default=3600.0, validator=_positive("session_timeout_s"))
    cleanup_interval_s: float = attrs.field(default=60.0, validator=_positive("cleanup_interval_s"))
    dump_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))


@attrs.define
class Interaction:
    """One model call of a session.

    Attributes:
        request: the call's new input (the message delta, not the whole history).
        response: the model's answer as returned to the agent.
        token_ids: completion token ids when the upstream returned them.
        logprobs: per-token log-probabilities (same length as ``token_ids``).
        created_s: store-clock time of the call (seconds).
        tools: the tool definitions the agent offered on the call (``None``:
            none); the turn's list, shared by every call that offered the same.
    """

    request: Any
    response: Any
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    created_s: float = 0.0
    tools: list[Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define(eq=False)
class Session:
    session_id: str
    api_key: str
    group_id: str
    last_active_s: float
    interactions: list[Interaction] = attrs.Factory(list)
    reward: float | None = None
    shard_ids: set[str] = attrs.Factory(set)
    lock: threading.Lock = attrs.Factory(threading.Lock)

    @property
    def ready(self) -> bool:
        return self.reward is not None

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy taken under the session's own lock."""
        with self.lock:
            return {
                "session_id": self.session_id,
                "group_id": self.group_id,
                "reward": self.reward,
                "interactions": [i.to_json() for i in self.interactions],
            }


@attrs.frozen
class ExportResult:
    """One export.

    Attributes:
        records: the exported records (dicts, or JSON bytes from
            :meth:`SessionStore.export_encoded`), in the order of the ids.
        exported: the sessions exported (and removed).
        failed: session id -> why its records could not be encoded (the
            session is back in the store).
    """

    records: list[Any]
    exported: tuple[str, ...]
    failed: dict[str, str]


@attrs.frozen
class CleanupReport:
    """One cleanup pass: sessions removed, files written, failures (never raised)."""

    removed: tuple[str, ...]
    dumped: tuple[Path, ...]
    dump_failures: tuple[str, ...]
    shards_freed: int


class SessionStore:
    """Sessions keyed by id and by per-session API key.

    Args:
        config: timeouts and the dump directory.
        clock: monotonic time source in seconds (tests inject one).
        free_shards: called with a session's shard ids when it is removed
            (e.g. ``ShardStore.remove``); returns how many it freed.
        revoke: called with a stale session's id under the store lock, as
            its key is revoked (``lowwater proxy`` unregisters the rollout
            from its interception server here, so the key stops working
            everywhere before anything is dumped).  Must not block.

    Thread-safe: short critical sections under one store lock (the key and
    session maps) and one lock per session (its interactions); no lock is
    held across I/O.
    """

    def __init__(
        self,
        config: SessionConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        free_shards: Callable[[list[str]], int] | None = None,
        revoke: Callable[[str], object] | None = None,
    ) -> None:
        self.config = config or SessionConfig()
        self._revoke = revoke
        self._clock = clock
        self._free_shards = free_shards
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}

    # -- lifecycle -------------------------------------------------------------

    def start_session(
        self,
        group_id: str | None = None,
        session_id: str | None = None,
        api_key: str | None = None,
    ) -> tuple[str, str]:
        """Open a session; returns ``(session_id, api_key)``.

        ``api_key`` defaults to a fresh random key (``lowwater proxy`` passes
        the rollout's interception secret, so one key names the session
        everywhere).

        Raises:
            SessionConflict: the id or the key is already in use.
            ValueError: ``session_id`` is not a valid id (:data:`lowwater.ids.ID_PATTERN`:
                it names the session's dump file).
        """
        sid = uuid.uuid4().hex if session_id is None else check_id(session_id, "session_id")
        key = api_key or "lw-" + secrets.token_urlsafe(24)
        session = Session(sid, key, group_id or sid, self._clock())
        with self._lock:
            if sid in self._sessions:
                raise SessionConflict(f"session {sid!r} already exists")
            if key in self._by_key:
                raise SessionConflict("that API key belongs to another session")
            self._sessions[sid] = session
            self._by_key[key] = session
        return sid, key

    def session_for_key(self, api_key: str) -> str | None:
        """The session id an API key belongs to, or ``None`` (unknown or revoked)."""
        with self._lock:
            s = self._by_key.get(api_key)
            return s.session_id if s else None

    def add_interaction(self, session_id: str, interaction: Interaction) -> None:
        """Append a model call and mark the session active.

        Raises:
            UnknownSession: no such session.
            SessionConflict: the session already has its reward.
        """
        session = self._get(session_id)
        with session.lock:
            if session.ready:
                raise SessionConflict(f"session {session_id!r} already has its reward; no more interactions")
            interaction.created_s = self._clock()
            session.interactions.append(interaction)
            session.last_active_s = interaction.created_s

    def attach_shards(self, session_id: str, shard_ids: Iterable[str]) -> None:
        """Record shards produced for this session, freed with it."""
        session = self._get(session_id)
        with session.lock:
            session.shard_ids.update(shard_ids)

    def set_reward(self, session_id: str, reward: float) -> None:
        """Set the session's (undiscounted) reward; the session becomes ready.

        Idempotent: setting the same reward again does nothing.

        Raises:
            UnknownSession: no such session.
            SessionConflict: a different reward was already set.
            ValueError: ``reward`` is not a finite number (a ``bool`` is not one).
        """
        if isinstance(reward, bool) or not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        session = self._get(session_id)
        with session.lock:
            if session.reward is not None and session.reward != reward:
                raise SessionConflict(f"session {session_id!r} already has reward {session.reward}, not {reward}")
            session.reward = float(reward)
            session.last_active_s = self._clock()

    def ready(self, group_id: str | None = None) -> list[str]:
        """Ids of sessions with a reward (in one group, if given)."""
        with self._lock:
            sessions = list(self._sessions.values())
        return [s.session_id for s in sessions if s.ready and (group_id is None or s.group_id == group_id)]

    def export(
        self, session_ids: Sequence[str], discount: float = 1.0, style: ExportStyle = "individual"
    ) -> list[dict[str, Any]]:
        """Remove ready sessions and return their interactions with discounted rewards.

        The discount is applied here and only here (the stored reward is raw),
        so it is applied exactly once: the interaction ``k`` steps before the
        last gets ``reward * discount**k``.

        ``individual``: one record per interaction, with its discounted reward.
        ``concat``: one record per session: the interactions in order, their
        token ids and logprobs concatenated, and the reward.  An id given
        twice is exported once.

        Raises:
            UnknownSession: an id is unknown (nothing is removed then).
            SessionConflict: a session is not ready (nothing is removed then).
            ValueError: ``discount`` not a number in (0, 1] or an unknown ``style``.
        """
        return self._export(session_ids, discount, style, _same).records

    def export_encoded(
        self, session_ids: Sequence[str], discount: float = 1.0, style: ExportStyle = "individual"
    ) -> ExportResult:
        """:meth:`export`, each record encoded as JSON (orjson bytes), session by session.

        A session whose records cannot be encoded is put back in the store
        and named in ``failed``; the others are exported and removed.  So the
        sessions removed are exactly those whose records are returned (a
        bad one used to make the whole export fail after every named session
        had been removed).  Blocking (encoding is CPU work): run it in a
        thread.

        Raises:
            UnknownSession, SessionConflict, ValueError: as :meth:`export`
                (nothing is removed then).
        """
        return self._export(session_ids, discount, style, _encode)

    def _export(
        self, session_ids: Sequence[str], discount: float, style: ExportStyle, convert: Callable[[Any], Any]
    ) -> ExportResult:
        check_export_options(discount, style)
        with self._lock:
            sessions: dict[str, Session] = {}
            for sid in session_ids:
                s = self._sessions.get(sid)
                if s is None:
                    raise UnknownSession(f"session {sid!r} is unknown")
                if not s.ready:
                    raise SessionConflict(f"session {sid!r} is not ready")
                sessions[sid] = s
            # Out of the store while they are encoded: a cleanup pass cannot
            # dump one that is being exported.
            for s in sessions.values():
                self._remove_locked(s)
        records: list[Any] = []
        exported: list[str] = []
        failed: dict[str, str] = {}
        for sid, s in sessions.items():
            try:
                converted = [convert(r) for r in _export_one(s.snapshot(), discount, style)]
            except Exception as exc:  # one session's failure is its own (reported, kept)
                failed[sid] = f"{type(exc).__name__}: {exc}"
                if not self._restore(s):
                    failed[sid] += "; the session could not be put back (its id or key was taken meanwhile)"
                log.error("exporting session %s failed: %s", sid, failed[sid])
                continue
            records.extend(converted)
            exported.append(sid)
            self._free(s)
        return ExportResult(records, tuple(exported), failed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._sessions

    def stats(self) -> dict[str, int]:
        with self._lock:
            sessions = list(self._sessions.values())
            keys = len(self._by_key)
        return {
            "sessions": len(sessions),
            "keys": keys,
            "ready": sum(s.ready for s in sessions),
            "interactions": sum(len(s.interactions) for s in sessions),
        }

    # -- stale cleanup ---------------------------------------------------------

    def pop_stale(self) -> list[Session]:
        """Remove sessions idle past the timeout and revoke their keys, under the store lock."""
        cutoff = self._clock() - self.config.session_timeout_s
        with self._lock:
            stale = [s for s in self._sessions.values() if s.last_active_s < cutoff]
            for s in stale:
                self._remove_locked(s)
                if self._revoke is not None:
                    try:
                        self._revoke(s.session_id)
                    except Exception:  # a failing revoke must not keep the session (or the lock)
                        log.exception("revoking stale session %s failed", s.session_id)
        return stale

    async def cleanup_pass(self) -> CleanupReport:
        """One pass: pop stale sessions (keys revoked first), snapshot each under
        its own lock, dump them off the event loop if a dump dir is set, then
        free each session's shards whether or not its dump succeeded."""
        stale = self.pop_stale()
        dumped: list[Path] = []
        failures: list[str] = []
        freed = 0
        for session in stale:
            # Each session on its own: one that cannot be dumped (a full
            # disk, an unwritable payload) is reported and the others are
            # still dumped and freed.  A pass used to stop at the first
            # failure that was not an OSError, leaving the sessions popped
            # after it undumped.
            try:
                if self.config.dump_dir is not None:
                    path = dump_path(self.config.dump_dir, session.session_id)
                    snap = session.snapshot()
                    await trio.to_thread.run_sync(_write_private, path, snap)
                    del snap
                    dumped.append(path)
            except Exception as exc:
                failures.append(session.session_id)
                log.warning("could not dump stale session %s: %r (freed anyway)", session.session_id, exc)
            finally:
                freed += self._free(session)
        return CleanupReport(tuple(s.session_id for s in stale), tuple(dumped), tuple(failures), freed)

    async def run_cleanup(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run cleanup passes every ``cleanup_interval_s`` until cancelled.

        Start it in the proxy's nursery (``await nursery.start(store.run_cleanup)``):
        a cleanup loop that is defined but never scheduled is the peer's bug.
        A failing pass is logged and the loop continues.
        """
        task_status.started()
        while True:
            await trio.sleep(self.config.cleanup_interval_s)
            try:
                report = await self.cleanup_pass()
            except Exception:  # a failing pass must not end cleanup for good
                log.exception("session cleanup pass failed; retrying in %s s", self.config.cleanup_interval_s)
                continue
            if report.removed:
                log.info("removed %d stale sessions (%d dumped)", len(report.removed), len(report.dumped))

    # -- internals -------------------------------------------------------------

    def _get(self, session_id: str) -> Session:
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            raise UnknownSession(f"unknown session {session_id!r}")
        return s

    def _remove_locked(self, s: Session) -> None:
        del self._sessions[s.session_id]
        self._by_key.pop(s.api_key, None)

    def _restore(self, s: Session) -> bool:
        """Put a removed session back unless its id or key was taken since; True if it was."""
        with self._lock:
            if s.session_id in self._sessions or s.api_key in self._by_key:
                return False
            self._sessions[s.session_id] = s
            self._by_key[s.api_key] = s
            return True

    def _free(self, s: Session) -> int:
        with s.lock:
            ids = sorted(s.shard_ids)
            s.shard_ids.clear()
            s.interactions.clear()
        if ids and self._free_shards is not None:
            return self._free_shards(ids)
        return 0


def check_export_options(discount: Any, style: Any) -> None:
    """Refuse export options :meth:`SessionStore.export` cannot use.

    Raises:
        ValueError: ``discount`` is not a real number (``bool`` included) in
            (0, 1], or ``style`` is not ``"individual"`` or ``"concat"``.
    """
    if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not (0 < discount <= 1):
        raise ValueError(f"discount must be a number in (0, 1], got {discount!r}")
    if not isinstance(style, str) or style not in ("individual", "concat"):
        raise ValueError(f"style must be 'individual' or 'concat', got {style!r}")


def _same(record: Any) -> Any:
    return record


def _encode(record: Any) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS)


def _export_one(snap: dict[str, Any], discount: float, style: ExportStyle) -> list[dict[str, Any]]:
    reward = snap["reward"]
    items = snap["interactions"]
    n = len(items)
    if style == "concat":
        token_ids = [t for i in items for t in (i["token_ids"] or [])]
        logprobs = [p for i in items for p in (i["logprobs"] or [])]
        return [
            {
                "session_id": snap["session_id"],
                "group_id": snap["group_id"],
                "reward": reward,
                "interactions": items,
                "token_ids": token_ids,
                "logprobs": logprobs,
            }
        ]
    return [
        {
            "session_id": snap["session_id"],
            "group_id": snap["group_id"],
            "index": k,
            "reward": reward * discount ** (n - 1 - k),
            **item,
        }
        for k, item in enumerate(items)
    ]


def dump_path(dump_dir: Path, session_id: str) -> Path:
    """Where a stale session is dumped: ``dump_dir / "SESSION_ID.json"``.

    Ids are checked at :meth:`SessionStore.start_session`; an id that is not
    valid all the same (a store filled some other way) is named by its
    SHA-256 instead, so no path is ever built from it.
    """
    if is_valid_id(session_id):
        return dump_dir / f"{session_id}.json"
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()
    return dump_dir / f"session-{digest}.json"


def _write_private(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` atomically with mode 0600 (runs in a thread)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(payload))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_dump(path: Path) -> dict[str, Any]:
    """Read back a session written by a cleanup pass.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a JSON object (``orjson.JSONDecodeError`` is one).
    """
    data = orjson.loads(Path(path).read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a session (not a JSON object)")
    return data
