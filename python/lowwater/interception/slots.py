"""Per-rollout registration: the slot an agent calls and its secret.

Owner: the :class:`~lowwater.interception.InterceptionServer`.  A slot lives
from ``register`` to ``unregister``; unregistering forgets the secret (the
agent's next call is 401) and the data plane cancels the rollout's calls
still in flight (410 at once), so none of them can wait on a rollout that is
gone.  A slot is kept small: a burst of 16,384 open rollouts holds as many
(the secret table itself lives in the data plane).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import attrs


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
        closed: set by unregister; a record of the rollout that arrives
            after it is not added to the trajectory.
    """

    rollout_id: str
    base_url: str
    secret: str = attrs.field(repr=False)
    trajectory: Any = attrs.field(repr=False)
    upstream: Any = attrs.field(repr=False)
    closed: bool = False

    @property
    def anthropic_base_url(self) -> str:
        """``base_url`` without ``/v1``: the Anthropic SDK (``ANTHROPIC_BASE_URL``) adds it itself."""
        return self.base_url.removesuffix("/v1")


def new_secret() -> str:
    """A fresh 256-bit URL-safe secret (``secrets.token_urlsafe``), prefixed ``lw-``."""
    return "lw-" + secrets.token_urlsafe(32)


class SlotRegistry:
    """Open slots by rollout id (the data plane authenticates secrets itself)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Slot] = {}

    def add(self, slot: Slot) -> None:
        """Raises KeyError if the rollout already has a slot."""
        if slot.rollout_id in self._by_id:
            raise KeyError(f"rollout {slot.rollout_id!r} is already registered")
        self._by_id[slot.rollout_id] = slot

    def pop(self, rollout_id: str) -> Slot | None:
        return self._by_id.pop(rollout_id, None)

    def get(self, rollout_id: str) -> Slot | None:
        return self._by_id.get(rollout_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_id))
