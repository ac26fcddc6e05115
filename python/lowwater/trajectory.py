"""Turns, trajectories and the trajectory registry (group-aware eviction).

A :class:`Trajectory` is the record of one rollout's model calls.  Each
:class:`Turn` keeps the *message delta* of its request (the messages the
agent added since the previous call), never a fresh copy of the whole
history: a 45-turn multimodal rollout whose every turn kept its full prompt
held every base64 image 45 times over (docs/design.md#incidents, the env-worker
incident).  Likewise the tool definitions an agent offers, which it resends
unchanged on every call: a turn holds a reference to the list an earlier
turn of the trajectory recorded when they are equal (:meth:`Trajectory.intern_tools`),
and the JSON forms write them once per change (:func:`turns_to_json`).

The :class:`TrajectoryRegistry` is the one place trajectories live while a
rollout runs.  Its owner is the rollout engine; its eviction points are
rollout close (ungrouped rollouts) and group cleanup (grouped ones, so the
group reward can still read every member after the members' own cleanup).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

#: How many distinct tool lists a trajectory remembers for :meth:`Trajectory.intern_tools`
#: (most recent first): an agent that switches between a few tool sets (a planner and an
#: executor sharing a rollout) still holds each set once.
TOOL_LISTS_REMEMBERED = 4


@attrs.define(eq=False, slots=True)
class Turn:
    """One model call of a rollout.

    Attributes:
        index: 0-based position in the trajectory.
        protocol: the wire protocol of the call: ``"openai.chat"``,
            ``"openai.responses"`` or ``"anthropic.messages"`` (or a plugin's).
        model: the model name the agent asked for.
        request_delta: the request's messages (chat, messages) or input items
            (responses) added since the previous turn of this trajectory; the
            whole list only on the first turn or when the agent rewrote its
            history.  Parsed JSON objects.
        request_delta_start: where ``request_delta`` starts in the request's
            list: the previous request's length when the agent appended, 0
            when it rewrote its history (the delta then replaces it).  The
            request of turn ``k`` is ``request(k-1)[:start] + request_delta``.
        completion: the assistant's output as the protocol returns it (chat:
            the ``choices[0].message`` object; messages: the ``content``
            blocks; responses: the ``output`` items).
        finish_reason: the upstream's stop reason, if any.
        usage: the upstream's usage object (token counts), if any.
        token_ids: completion token ids, when the upstream returned them.
        logprobs: completion token logprobs (float, natural log), when returned.
        started_s: wall-clock start of the call (``time.time()``, seconds).
        duration_s: time from request received to response recorded (seconds).
        streamed: whether the agent asked for an SSE stream.
        error: ``None``, or why the call failed (e.g. the upstream stream was cut).
        tools: the tool definitions the agent offered on the call, as its
            protocol writes them (:meth:`lowwater.interception.Protocol.tools`:
            ``tools`` of an OpenAI chat or responses request, or of an
            Anthropic messages request); ``None`` when it offered none.  The
            same list object as an earlier turn's when they are equal
            (:meth:`Trajectory.intern_tools`): never copied per turn.
    """

    index: int
    protocol: str
    model: str
    request_delta: list[Any]
    completion: Any
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    started_s: float = 0.0
    duration_s: float = 0.0
    streamed: bool = False
    error: str | None = None
    request_delta_start: int = 0
    tools: list[Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """A plain dict for JSON output (orjson-serialisable), ``tools`` in full
        (:func:`turns_to_json` writes a trajectory's tools once per change)."""
        return attrs.asdict(self, recurse=False)


def turns_to_json(turns: Iterable[Turn]) -> list[dict[str, Any]]:
    """The turns as plain dicts, each turn's tools written once per change.

    A turn's dict has ``tools`` (the list, or ``None`` when it offered none)
    when its tools differ from the previous turn's, and ``"tools_same": true``
    instead when it offered the same, non-empty tools again: agents resend
    their tools on every call, so writing them on every turn would put a
    45-turn rollout's tool list 45 times into its line (and into the memory
    of encoding it).  :func:`turns_from_json` reverses it.
    """
    out = []
    previous: list[Any] | None = None
    for turn in turns:
        entry = turn.to_json()
        tools = entry.pop("tools")
        if tools is not None and (tools is previous or tools == previous):
            entry["tools_same"] = True
        else:
            entry["tools"] = tools
        previous = tools
        out.append(entry)
    return out


def turns_from_json(entries: Iterable[dict[str, Any]]) -> list[Turn]:
    """Turns from :func:`turns_to_json`'s dicts (a samples file's or a proxy
    line's ``turns``): keys :class:`Turn` does not have are ignored, and a
    ``tools_same`` turn gets the previous turn's list (the same object).

    Raises:
        TypeError: an entry lacks a required field of :class:`Turn`.
    """
    fields = {f.name for f in attrs.fields(Turn)}
    turns: list[Turn] = []
    for entry in entries:
        turn = Turn(**{k: v for k, v in entry.items() if k in fields})
        if entry.get("tools_same") and turns:
            turn.tools = turns[-1].tools
        turns.append(turn)
    return turns


@attrs.define(eq=False, slots=True)
class Trajectory:
    """The turns of one rollout.

    Attributes:
        rollout_id: the rollout's id (unique within a run).
        task_id: the task's stable id (dataset row index or environment id).
        group_id: the group's id, or ``None`` for an ungrouped rollout.
        turns: the recorded turns, in call order.  While the trajectory is
            registered with an interception server, reading it first applies
            the calls the server has recorded and not yet handed over
            (:meth:`sync_with`), so a turn is here as soon as its agent has
            the answer's end.
    """

    rollout_id: str
    task_id: str | int = ""
    group_id: str | None = None
    _turns: list[Turn] = attrs.field(factory=list, alias="turns")
    # The history seen so far, as references to the message objects the
    # turns' deltas already hold (a pointer per message, no copy): the check
    # that a new request appended to it rather than rewrote it.
    _history: list[Any] = attrs.field(factory=list, init=False, repr=False)
    # The distinct tool lists offered so far, most recent first (references to
    # the lists the turns hold, at most TOOL_LISTS_REMEMBERED).
    _tool_lists: list[list[Any]] = attrs.field(factory=list, init=False, repr=False)
    # Called before each read of `turns` while registered (the server's
    # Records.flush); None otherwise.
    _sync: Callable[[], object] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def turns(self) -> list[Turn]:
        sync = self._sync
        if sync is not None:
            sync()
        return self._turns

    @turns.setter
    def turns(self, turns: list[Turn]) -> None:
        self._turns = turns

    def sync_with(self, flush: Callable[[], object] | None) -> None:
        """Call ``flush`` before every read of :attr:`turns` (``None``: stop).

        The interception data plane lets an agent have an answer as soon as
        its call is recorded in the plane's queue, before the control plane
        has turned the record into a turn; the server registers its
        ``Records.flush`` here so that reading the turns applies those
        records first.  Not for plugins: ``InterceptionServer`` sets and
        clears it at register and unregister.
        """
        self._sync = flush

    def message_delta(self, messages: list[Any]) -> tuple[int, list[Any]]:
        """``(start, delta)``: the part of ``messages`` that earlier turns have
        not recorded, and where it starts.

        Agents resend the whole history on every call; recording only what is
        new keeps a trajectory linear in the conversation, not quadratic.  The
        request counts as appended to the history seen when it starts with
        every message of it (``==`` on parsed JSON: the same order of work as
        parsing the request); otherwise (truncated, compacted, a system
        message re-rendered, a sliding window of the same length) the agent
        rewrote it and the whole list is the delta, from 0.  Judging by
        length alone recorded an empty delta for a rewrite of equal length.
        """
        history = self._history
        appended = len(messages) >= len(history) and all(a == b for a, b in zip(messages, history))
        start = len(history) if appended else 0
        delta = messages[start:]
        if appended:
            history.extend(delta)  # in place: a copy per turn would be quadratic in the conversation
        else:
            self._history = list(messages)
        return start, delta

    @property
    def messages_seen(self) -> int:
        """How many request messages earlier turns covered: the next turn's
        delta starts there if the agent appends to its history."""
        return len(self._history)

    def intern_tools(self, tools: Any) -> list[Any] | None:
        """The tool list to record for a call that offered ``tools``.

        ``None`` for no tools (``None``, an empty list, or anything not a
        list); otherwise an equal list an earlier turn recorded (the same
        object: agents resend the same tools on every call, and a turn each
        kept a copy of them), or ``tools`` itself, remembered for later
        calls.  Compares with ``==`` on parsed JSON against at most
        :data:`TOOL_LISTS_REMEMBERED` lists.
        """
        if not isinstance(tools, list) or not tools:
            return None
        seen = self._tool_lists
        for i, known in enumerate(seen):
            if known is tools or known == tools:
                if i:
                    seen.insert(0, seen.pop(i))
                return known
        seen.insert(0, tools)
        del seen[TOOL_LISTS_REMEMBERED:]
        return tools

    def add_turn(self, turn: Turn) -> None:
        self._turns.append(turn)

    def to_json(self) -> dict[str, Any]:
        """``rollout_id``, ``task_id``, ``group_id`` and ``turns`` (:func:`turns_to_json`)."""
        return {
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "turns": turns_to_json(self.turns),
        }


class TrajectoryRegistry:
    """Live trajectories of a run, keyed by rollout id, with group-aware eviction.

    Owner: the rollout engine.  Eviction: :meth:`close_rollout` drops an
    ungrouped trajectory at once and keeps a grouped one until
    :meth:`close_group`, which drops every member.  Both are called from
    ``finally`` blocks, so success, error, cancellation and deadlines all
    leave the registry empty once the work ends.
    """

    def __init__(self) -> None:
        self._live: dict[str, Trajectory] = {}
        self._groups: dict[str, set[str]] = {}

    def open(self, rollout_id: str, *, task_id: str | int = "", group_id: str | None = None) -> Trajectory:
        """Create and hold the trajectory of a new rollout.

        Raises:
            KeyError: ``rollout_id`` is already live.
        """
        if rollout_id in self._live:
            raise KeyError(f"rollout {rollout_id!r} is already open")
        trajectory = Trajectory(rollout_id, task_id, group_id)
        self._live[rollout_id] = trajectory
        if group_id is not None:
            self._groups.setdefault(group_id, set()).add(rollout_id)
        return trajectory

    def get(self, rollout_id: str) -> Trajectory | None:
        return self._live.get(rollout_id)

    def group(self, group_id: str) -> list[Trajectory]:
        """The live trajectories of ``group_id`` (order of rollout id)."""
        return [self._live[r] for r in sorted(self._groups.get(group_id, ())) if r in self._live]

    def close_rollout(self, rollout_id: str) -> bool:
        """End a rollout: evict it now unless it belongs to a group.  True if evicted."""
        trajectory = self._live.get(rollout_id)
        if trajectory is None or trajectory.group_id is not None:
            return False
        del self._live[rollout_id]
        return True

    def discard(self, rollout_id: str) -> bool:
        """Evict ``rollout_id`` now, grouped or not (a retried attempt's old
        trajectory, or an engine forcing eviction).  True if it was live."""
        trajectory = self._live.pop(rollout_id, None)
        if trajectory is None:
            return False
        if trajectory.group_id is not None:
            members = self._groups.get(trajectory.group_id)
            if members is not None:
                members.discard(rollout_id)
        return True

    def close_group(self, group_id: str) -> int:
        """Evict every member of ``group_id``; returns how many were evicted."""
        members = self._groups.pop(group_id, set())
        evicted = 0
        for rollout_id in members:
            if self._live.pop(rollout_id, None) is not None:
                evicted += 1
        return evicted

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._live))

    def stats(self) -> dict[str, int]:
        """``trajectories`` (live), ``groups`` (open), ``turns`` (held by live trajectories)."""
        return {
            "trajectories": len(self._live),
            "groups": len(self._groups),
            "turns": sum(len(t.turns) for t in self._live.values()),
        }
