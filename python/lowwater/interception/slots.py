"""Per-rollout registration: the slot an agent calls, its secret and its waiting handlers.

Owner: the :class:`~lowwater.interception.InterceptionServer`.  A slot lives
from ``register`` to ``unregister``; unregistering forgets the secret (the
agent's next call is 401) and cancels every handler still serving the
rollout, so none of them can wait on a rollout that is gone.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import attrs
import trio


@attrs.define(eq=False)
class Slot:
    """One registered rollout.

    Attributes:
        rollout_id: the rollout's id.
        base_url: where its agent sends calls, ``http://HOST:PORT/v1`` (what
            the OpenAI SDK's ``base_url`` and ``OPENAI_BASE_URL`` expect).
        secret: the per-rollout key, accepted as ``Authorization: Bearer``
            or ``x-api-key``.
        trajectory: the :class:`~lowwater.trajectory.Trajectory` turns go to.
        upstream: the :class:`~lowwater.upstream.client.ModelClient` calls go to.
        handlers: cancel scopes of the handlers serving this rollout now.
        closed: set by unregister; a handler that sees it answers with an error.
    """

    rollout_id: str
    base_url: str
    secret: str = attrs.field(repr=False)
    trajectory: Any = attrs.field(repr=False)
    upstream: Any = attrs.field(repr=False)
    handlers: set[trio.CancelScope] = attrs.field(factory=set, repr=False)
    closed: bool = False

    @property
    def anthropic_base_url(self) -> str:
        """``base_url`` without ``/v1``: the Anthropic SDK (``ANTHROPIC_BASE_URL``) adds it itself."""
        return self.base_url.removesuffix("/v1")

    def close(self) -> int:
        """Mark closed and cancel every handler; returns how many were cancelled."""
        self.closed = True
        for scope in self.handlers:
            scope.cancel()
        return len(self.handlers)


def new_secret() -> str:
    """A fresh 256-bit URL-safe secret (``secrets.token_urlsafe``), prefixed ``lw-``."""
    return "lw-" + secrets.token_urlsafe(32)


class SlotRegistry:
    """Open slots by rollout id and by secret (both dicts, O(1) per call)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Slot] = {}
        self._by_secret: dict[str, Slot] = {}

    def add(self, slot: Slot) -> None:
        """Raises KeyError if the rollout already has a slot."""
        if slot.rollout_id in self._by_id:
            raise KeyError(f"rollout {slot.rollout_id!r} is already registered")
        self._by_id[slot.rollout_id] = slot
        self._by_secret[slot.secret] = slot

    def pop(self, rollout_id: str) -> Slot | None:
        slot = self._by_id.pop(rollout_id, None)
        if slot is not None:
            self._by_secret.pop(slot.secret, None)
        return slot

    def get(self, rollout_id: str) -> Slot | None:
        return self._by_id.get(rollout_id)

    def by_secret(self, secret: str) -> Slot | None:
        return self._by_secret.get(secret)

    def waiting(self) -> int:
        """Handlers serving a call of an open slot right now."""
        return sum(len(s.handlers) for s in self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_id))
