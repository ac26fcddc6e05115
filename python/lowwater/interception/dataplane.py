"""The Trio control-plane loop of the Rust data plane (:class:`lowwater._native.DataPlane`).

The data plane serves the agent's calls on its own threads and queues a
:class:`~lowwater._native.TurnRecord` per recorded call; its last bytes (a
stream's terminal event, a whole answer) wait until the record is acked, so
an agent never sees the end of an answer whose turn is not recorded.  This
module is the other half: :func:`serve_records` waits on the plane's wakeup
fd without blocking the Trio loop, hands each record to a callback and acks
it; :func:`turn_of` turns a record into a :class:`~lowwater.trajectory.Turn`.
``InterceptionServer`` runs :func:`serve_records` for every call of
``lowwater proxy``, the harnesses and the trainer (docs/dataplane.md).
"""

from __future__ import annotations

import functools
import inspect
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

__all__ = ["Fail", "read_record", "rewrites_for", "serve_records", "turn_of"]


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


async def serve_records(
    plane: DataPlane, on_record: Callable[[TurnRecord], Awaitable[Fail | None] | Fail | None]
) -> None:
    """Drain ``plane``'s records into ``on_record`` and ack each, until cancelled.

    Waits with :func:`trio.lowlevel.wait_readable` on the plane's wakeup fd;
    ``drain`` and ``ack`` take a lock for a moment and never wait, so the
    Trio loop is never blocked.  Every drained record is acked, whatever
    ``on_record`` does with it (including a record of a rollout its owner has
    already closed, and one ``on_record`` raised on): an unacked record would
    hold its call's answer forever.

    Cancel this loop before :meth:`DataPlane.close`: close closes the fd, and
    a wait on a closed fd is never woken.  Returns when the plane is found
    closed.

    Args:
        plane: a started data plane.
        on_record: called once per record, oldest first, in the Trio thread
            (e.g. ``trajectory.add_turn(turn_of(record, trajectory))``); an
            awaitable it returns is awaited before the record is acked (the
            interceptors' ``intercept_response`` hooks run so, before the
            agent has the end of its answer).  A :class:`Fail` returned (or
            awaited) releases the call with that error instead
            (:meth:`DataPlane.fail`).

    Raises:
        Exception: whatever ``on_record`` raised (the rest of its batch is
            acked first).
    """
    try:
        fd = plane.wakeup_fd()
    except DataPlaneClosed:
        return
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            records = plane.drain()
        except DataPlaneClosed:
            return
        for i, record in enumerate(records):
            try:
                verdict = on_record(record)
                if inspect.isawaitable(verdict):
                    verdict = await verdict
            except BaseException:
                for held in records[i:]:
                    plane.ack(held.seq)
                raise
            if isinstance(verdict, Fail):
                plane.fail(record.seq, verdict.status, verdict.reason)
            else:
                plane.ack(record.seq)


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
