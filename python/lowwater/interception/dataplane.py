"""The Trio control-plane loop of the Rust data plane (:class:`lowwater._native.DataPlane`).

The data plane serves the agent's calls on its own threads and queues a
:class:`~lowwater._native.TurnRecord` per recorded call.  A call's last bytes
(a stream's terminal event, a whole answer) wait until its record is acked
when the control plane may still change them (a verdict, an
``intercept_response`` hook); with ``release_when_readable`` the others go
out as soon as the record is queued, and whoever shows a turn drains first
(:meth:`Records.flush`), so an agent never holds the end of an answer whose
turn a reader could miss.  This module is the other half: :class:`Records`
(and :func:`serve_records`) waits on the plane's wakeup fd without blocking
the Trio loop, hands each record to a callback and acks it; :func:`turn_of`
turns a record into a :class:`~lowwater.trajectory.Turn`.
``InterceptionServer`` runs it for every call of ``lowwater proxy``, the
harnesses and the trainer (docs/dataplane.md).
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import orjson
import trio

from lowwater._native import DataPlane, DataPlaneClosed, TurnRecord
from lowwater.interception import sampling as _sampling
from lowwater.interception.protocols import Completion, Protocol, builtin_protocols
from lowwater.interception.sse import SSEParser
from lowwater.redact import redact_url
from lowwater.trajectory import Trajectory, Turn

__all__ = ["Fail", "Records", "read_record", "rewrites_for", "serve_records", "turn_of"]


def rewrites_for(
    sampling: Mapping[str, Any], *, request_logprobs: bool, protocols: Sequence[Protocol] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """The ``rewrites`` argument of :class:`~lowwater._native.DataPlane` that
    makes the plane forward what ``InterceptionServer`` forwards for the
    same ``sampling`` and ``request_logprobs``.

    Args:
        sampling: the run's sampling arguments (``{"max_tokens": 512, ...}``);
            each becomes a ``defaults`` rule under the protocol's spelling
            (:data:`lowwater.interception.sampling.RENAMES`) that yields to
            every alias (:data:`~lowwater.interception.sampling.ALIASES`).
        request_logprobs: ask the upstream for token ids and logprobs
            (each protocol's :meth:`~lowwater.interception.protocols.Protocol.data_plane_rewrites`).
        protocols: the protocols served (default: the three built in).

    Raises:
        orjson.JSONEncodeError: a sampling value orjson cannot encode.
    """
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for protocol in protocols if protocols is not None else builtin_protocols():
        name = protocol.name
        rules: dict[str, dict[str, Any]] = {
            kind: dict(entries) for kind, entries in protocol.data_plane_rewrites(logprobs=request_logprobs).items()
        }
        renames = _sampling.RENAMES.get(name, {})
        defaults = {
            renames.get(key, key): (orjson.dumps(value).decode(), _sampling.ALIASES.get(key, (key,)))
            for key, value in sampling.items()
        }
        if defaults:
            rules["defaults"] = defaults
        if rules:
            out[name] = rules
    return out


@attrs.frozen
class Fail:
    """A record's verdict: release its call with this error, not its answer.

    Attributes:
        status: for a whole answer, the status the agent gets (400-599).
        reason: what the agent reads (a stream: in its error event).
    """

    status: int
    reason: str


OnRecord = Callable[[TurnRecord], "Awaitable[Fail | None] | Fail | None"]


class Records:
    """The control plane's side of a plane's completion queue: drain its
    records into ``on_record``, ack or fail each, from the Trio loop
    (:meth:`serve`) and, at once, from whoever is about to show a turn
    (:meth:`flush`).

    Every drained record is acked, whatever ``on_record`` does with it
    (including a record of a rollout its owner has already closed, and one
    ``on_record`` raised on): an unacked record would hold its call's
    answer forever.  Records are handed over in the order the plane queued
    them, each batch's ``on_record`` calls one after another with no
    checkpoint between, so a rollout's turns are appended in call order
    whether :meth:`serve` or :meth:`flush` drained them.

    Args:
        plane: a started data plane.
        on_record: called once per record in call order (e.g.
            ``trajectory.add_turn(turn_of(record, trajectory))``).  A
            :class:`Fail` returned releases the call with that error instead
            (:meth:`DataPlane.fail`).  An awaitable it returns (the
            interceptors' ``intercept_response`` hooks) is awaited by
            :meth:`serve`, one at a time in call order, before the record is
            acked: the agent has the end of its answer only after it.
    """

    def __init__(self, plane: DataPlane, on_record: OnRecord) -> None:
        self.plane = plane
        self.on_record = on_record
        # Records whose callback returned an awaitable: serve() awaits each,
        # then acks (a flush may have drained them; it cannot await).
        self._awaiting: collections.deque[tuple[TurnRecord, Awaitable[Fail | None]]] = collections.deque()
        self._error: BaseException | None = None
        # One drain-and-apply at a time (a flush may come from another thread),
        # so batches are applied in the order they were drained.
        self._lock = threading.Lock()
        self._flushing: int | None = None  # the thread applying a batch now

    async def serve(self) -> None:
        """Drain, apply and ack until cancelled, waiting on the plane's wakeup
        fd with :func:`trio.lowlevel.wait_readable`; ``drain`` and ``ack``
        take a lock for a moment and never wait, so the Trio loop is never
        blocked.

        Cancel it before :meth:`DataPlane.close`: close closes the fd, and a
        wait on a closed fd is never woken.  Returns when the plane is found
        closed.

        Raises:
            Exception: whatever ``on_record`` raised, here or in a
                :meth:`flush` (the rest of its batch is acked first).
        """
        try:
            fd = self.plane.wakeup_fd()
        except DataPlaneClosed:
            return
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                self._flush(wake=False)
            except DataPlaneClosed:
                return
            if self._error is not None:
                error, self._error = self._error, None
                self._ack_awaiting()  # no loop is left to await them
                raise error
            while self._awaiting:
                record, pending = self._awaiting.popleft()
                try:
                    verdict = await pending
                except BaseException:
                    self.plane.ack(record.seq)
                    self._ack_awaiting()
                    raise
                self._release(record, verdict)

    def flush(self) -> None:
        """Apply every record the plane has queued, now, in the calling
        thread: what a reader calls before it shows a turn (a trajectory's
        ``turns``, an admin endpoint), since a call released without the ack
        may have answered its agent before :meth:`serve` ran.  Returns at once
        when called from inside ``on_record`` (its own batch is being applied).

        An exception ``on_record`` raises is not raised here (the reader did
        not cause it): :meth:`serve` raises it, as if it had drained the batch.

        Raises:
            DataPlaneClosed: the plane is closed.
        """
        self._flush(wake=True)

    def stop(self) -> None:
        """The owner is stopping (:meth:`serve` cancelled): apply what the
        plane queued, then ack the records whose awaitable :meth:`serve` will
        not await now (their hooks do not run; their calls get their answer).
        Errors of ``on_record`` are dropped here: there is no loop left to
        raise them in."""
        try:
            self._flush(wake=False)
        except DataPlaneClosed:
            pass
        self._ack_awaiting()
        self._error = None

    def _ack_awaiting(self) -> None:
        """Ack the records whose awaitable will not be awaited (their calls
        get their answer; their hooks do not run)."""
        while self._awaiting:
            record, pending = self._awaiting.popleft()
            close = getattr(pending, "close", None)
            if close is not None:
                close()  # a coroutine never awaited: no RuntimeWarning
            try:
                self.plane.ack(record.seq)
            except DataPlaneClosed:
                pass

    def _flush(self, *, wake: bool) -> None:
        """Drain and apply; ``wake``: make :meth:`serve` run for what this
        left to it (an awaitable to await, an error to raise)."""
        me = threading.get_ident()
        if self._flushing == me:
            return
        with self._lock:
            self._flushing = me
            try:
                left = self._apply(self.plane.drain())
            finally:
                self._flushing = None
        if left and wake:
            self._wake_serve()

    def _apply(self, records: list[TurnRecord]) -> bool:
        """Each record's callback, in order; whether :meth:`serve` has work left."""
        left = False
        for i, record in enumerate(records):
            try:
                verdict = self.on_record(record)
            except BaseException as exc:
                self.plane.ack(record.seq)
                for held in records[i + 1 :]:
                    self.plane.ack(held.seq)
                if self._error is None:
                    self._error = exc
                return True
            if inspect.isawaitable(verdict):
                self._awaiting.append((record, verdict))
                left = True
            else:
                self._release(record, verdict)
        return left

    def _release(self, record: TurnRecord, verdict: object) -> None:
        if isinstance(verdict, Fail):
            self.plane.fail(record.seq, verdict.status, verdict.reason)
        else:
            self.plane.ack(record.seq)

    def _wake_serve(self) -> None:
        """Make :meth:`serve` run: it waits on the wakeup fd, which the drain
        just cleared, and it must await what the flush could not (an eventfd
        on Linux, a pipe elsewhere: 8 bytes of 1 suit both)."""
        try:
            os.write(self.plane.wakeup_fd(), (1).to_bytes(8, sys.byteorder))
        except (OSError, DataPlaneClosed):
            pass  # closed: serve() is gone too


async def serve_records(plane: DataPlane, on_record: OnRecord) -> None:
    """``await Records(plane, on_record).serve()``: drain ``plane``'s records
    into ``on_record`` and ack each, until cancelled (see :class:`Records`).

    Raises:
        Exception: whatever ``on_record`` raised (the rest of its batch is
            acked first).
    """
    await Records(plane, on_record).serve()


def turn_of(record: TurnRecord, trajectory: Trajectory, protocols: Mapping[str, Protocol] | None = None) -> Turn:
    """The turn ``record`` adds to ``trajectory`` (not appended: the caller does).

    The request delta is parsed one message at a time (``orjson``), never
    the whole history.  The answer's fields (completion, finish reason,
    usage, token ids, logprobs) come from ``record.response`` through the
    record's protocol, as the Python server derives them: a whole answer
    with :meth:`Protocol.completion`, a stream event by event with
    :meth:`Protocol.accumulator` (:class:`~lowwater.interception.sse.SSEParser`
    splits the relayed bytes).  An answer that is not a 2xx, that the
    protocol cannot read, or a stream without its terminal event leaves
    those fields empty and sets ``error``, with the Python server's wording.
    The tools offered (``record.tools``, the request's tool fields) are read
    with :meth:`Protocol.tools` and interned with
    :meth:`Trajectory.intern_tools`, as the Python server records them: a
    list equal to one an earlier turn recorded is that turn's object.

    ``request_delta_start`` is ``record.kept``: the request is
    ``request(k-1)[:kept] + request_delta`` for an append (``kept ==
    previous``) and a rewrite alike; the Python server records a rewrite
    from 0 with the whole request instead, which the plane does not hand over.

    Args:
        record: a drained record.
        trajectory: the rollout's trajectory (for the turn's index).
        protocols: protocols by name (default: the three built in).

    Raises:
        orjson.JSONDecodeError: a message or the tools are not JSON (the
            plane validated the request, so only a bug gives one).
    """
    return read_record(record, trajectory, protocols)[0]


def read_record(
    record: TurnRecord, trajectory: Trajectory, protocols: Mapping[str, Protocol] | None = None
) -> tuple[Turn, Fail | None]:
    """:func:`turn_of`, and the record's verdict: a :class:`Fail` when the
    plane relayed a 2xx answer its protocol cannot read (a whole answer
    that is not a response object: 502; a stream with a malformed event),
    so the agent is not handed it as a good one; else ``None``.

    Raises:
        orjson.JSONDecodeError: as :func:`turn_of`.
    """
    delta: list[Any] = [orjson.loads(m) for m in record.messages]
    table = _builtin_by_name() if protocols is None else protocols
    protocol = table.get(record.protocol)
    done, error, unreadable = _answer(record, protocol) if protocol is not None else (Completion(), record.error, False)
    verdict = None
    if unreadable and error is not None:
        verdict = Fail(502, error if record.streamed else "the upstream's answer is not a valid response object")
    tools = None
    if protocol is not None and record.tools is not None:
        fields = orjson.loads(record.tools)
        # The plane copies the fields unvalidated: tools() returns None for what is not a list.
        tools = protocol.tools(fields) if isinstance(fields, dict) else None
    turn = Turn(
        index=len(trajectory.turns),
        protocol=record.protocol,
        model=record.model,
        request_delta=delta,
        request_delta_start=record.kept,
        completion=done.completion,
        finish_reason=done.finish_reason,
        usage=done.usage,
        tools=trajectory.intern_tools(tools),
        token_ids=done.token_ids,
        logprobs=done.logprobs,
        started_s=record.started_s,
        duration_s=record.duration_s,
        streamed=record.streamed,
        # Written to files with the turn: an error text may quote a URL with credentials.
        error=None if error is None else redact_url(error),
    )
    return turn, verdict


def _answer(record: TurnRecord, protocol: Protocol) -> tuple[Completion, str | None, bool]:
    """The answer's fields, the turn's error (the Python server's wording),
    and whether the protocol could not read a 2xx answer the plane relayed."""
    if record.error is not None:
        return Completion(), record.error, False
    if not 200 <= record.status < 300:
        return Completion(), f"upstream answered {record.status}", False
    if not record.streamed:
        try:
            done = protocol.completion(orjson.loads(record.response))
        except Exception as exc:
            return Completion(), f"upstream answer malformed: {type(exc).__name__}: {exc}", True
        return done, done.error, False
    accumulator = protocol.accumulator()
    parser = SSEParser()
    terminal = False
    try:
        for event in [*parser.feed(record.response), *parser.finish()]:
            if not terminal and accumulator.feed(event.event, event.data):
                terminal = True
    except Exception as exc:
        return Completion(), f"upstream sent a malformed event: {type(exc).__name__}: {exc}", True
    try:
        done = accumulator.result()
    except Exception as exc:
        return Completion(), f"upstream stream malformed: {type(exc).__name__}: {exc}", True
    if not terminal:
        return done, "upstream stream ended before its terminal event", False
    return done, done.error, False


@functools.cache
def _builtin_by_name() -> dict[str, Protocol]:
    return {p.name: p for p in builtin_protocols()}
