"""Interceptor hooks: plugins that see and change every intercepted model call.

``intercept_request(call)`` and ``intercept_response(call, response)``
(:mod:`lowwater.hookspecs`) are awaited by the interception server on each
call, one implementation after another in registration order (each may
change what the next sees), never concurrently.  When no plugin implements
either, :meth:`lowwater.plugins.Plugins.interceptors` returns ``None`` and
the server never enters this path (measured in benches/interception.py
``--interceptor``, benches/README.md).

A redacting interceptor::

    @hookimpl
    async def intercept_request(call):
        for message in call.body.get("messages", []):
            if isinstance(message.get("content"), str):
                message["content"] = EMAIL.sub("<email>", message["content"])
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from lowwater.http import HTTPError

log = logging.getLogger("lowwater.interception")

__all__ = ["InterceptedCall", "InterceptedResponse", "Interceptors", "Reject"]


class Reject(Exception):
    """Raised by ``intercept_request`` to refuse a call: the agent gets
    ``status`` with ``message`` in an error body of the call's protocol
    (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", ...}``).
    Nothing is sent upstream and no turn is recorded; like every call refused
    before intake (a 400 for a malformed body) it is not counted in the
    server's ``calls`` stats.

    Args:
        status: an HTTP status, 400 to 599.
        message: what the agent reads.

    Raises:
        ValueError: ``status`` outside 400-599.
    """

    def __init__(self, status: int, message: str) -> None:
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"Reject status must be 400-599, not {status!r}")
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


@attrs.define(eq=False)
class InterceptedCall:
    """One model call as ``intercept_request`` sees it.

    Attributes:
        rollout_id: the rollout making the call.
        protocol: the wire protocol's name (``"openai.chat"``, ``"openai.responses"``,
            ``"anthropic.messages"`` or a plugin's).
        body: the parsed request (a dict), mutable: what the last
            interceptor leaves is sent upstream and recorded as the turn.
        state: scratch space carried from ``intercept_request`` to
            ``intercept_response`` of the same call (per call, shared by plugins).
        headers: the agent's request headers, read-only: names lower-case,
            values decoded as Latin-1, a repeated header's values joined
            with ``", "`` (RFC 9110 section 5.3).  ``authorization`` and
            ``x-api-key`` are left out: they carry the rollout's secret.
            Changing a header is not possible (the upstream gets the
            plane's own headers and key).
    """

    rollout_id: str
    protocol: str
    body: dict[str, Any]
    state: dict[str, Any] = attrs.field(factory=dict)
    headers: Mapping[str, str] = attrs.field(factory=lambda: MappingProxyType({}))


@attrs.frozen
class InterceptedResponse:
    """A call's complete answer (a stream's accumulated), read-only.

    Attributes:
        completion: the answer as the turn records it (the message, or
            the output items).
        finish_reason: why generation stopped, when given.
        usage: token counts as the upstream reported them (read-only mapping), or ``None``.
        token_ids: completion token ids when the upstream returned them, else ``None``.
        logprobs: their log-probabilities, else ``None``.
        error: the upstream's own error inside a well-formed answer, else ``None``.
    """

    completion: Any
    finish_reason: str | None
    usage: Mapping[str, Any] | None
    token_ids: tuple[int, ...] | None
    logprobs: tuple[float, ...] | None
    error: str | None

    @classmethod
    def of(cls, done: Any) -> InterceptedResponse:
        """The read-only view of a :class:`lowwater.interception.protocols.Completion`."""
        return cls(
            completion=done.completion,
            finish_reason=done.finish_reason,
            usage=MappingProxyType(dict(done.usage)) if isinstance(done.usage, dict) else done.usage,
            token_ids=tuple(done.token_ids) if done.token_ids is not None else None,
            logprobs=tuple(done.logprobs) if done.logprobs is not None else None,
            error=done.error,
        )


Impl = tuple[str, Any, tuple[str, ...]]


class Interceptors:
    """The ordered implementations of both hooks (built by
    :meth:`lowwater.plugins.Plugins.interceptors`).

    Args:
        requests: ``(plugin name, function, argnames)`` of ``intercept_request``.
        responses: the same of ``intercept_response``.
    """

    def __init__(self, requests: list[Impl], responses: list[Impl]) -> None:
        self.requests = list(requests)
        self.responses = list(responses)

    async def request(self, call: InterceptedCall) -> None:
        """Await every ``intercept_request`` in order.

        Raises:
            lowwater.http.HTTPError: a :class:`Reject` (its status and
                message), or 500 naming the plugin whose hook raised anything
                else, or whose hook left ``call.body`` not a dict.
        """
        for name, fn, argnames in self.requests:
            try:
                await fn(**_args(argnames, call=call))
            except Reject as reject:
                raise HTTPError(reject.status, reject.message) from None
            except Exception as exc:
                log.exception("interceptor %r failed in intercept_request", name)
                raise HTTPError(500, f"interceptor {name!r} failed: {type(exc).__name__}: {exc}") from None
            if not isinstance(call.body, dict):
                raise HTTPError(500, f"interceptor {name!r} left a body that is not a JSON object")

    async def response(self, call: InterceptedCall, response: InterceptedResponse) -> None:
        """Await every ``intercept_response`` in order; an exception is logged
        with the plugin's name and does not stop the others or the answer."""
        for name, fn, argnames in self.responses:
            try:
                await fn(**_args(argnames, call=call, response=response))
            except Exception:
                log.exception("interceptor %r failed in intercept_response", name)


def _args(argnames: tuple[str, ...], **available: Any) -> dict[str, Any]:
    return {k: available[k] for k in argnames}
