"""Interception: the OpenAI/Anthropic-compatible proxy that records an agent's model calls.

* :class:`InterceptionServer` — the server (``url = await nursery.start(server.run)``),
  ``register``/``unregister`` per rollout, ``stats``.
* :mod:`.hooks` — interceptor hooks' types: :class:`Reject` (refuse a
  call), :class:`InterceptedCall`, :class:`InterceptedResponse`.
* :mod:`.protocols` — the wire protocols (``openai.chat``, ``openai.responses``,
  ``anthropic.messages``) and the :class:`Protocol` base for plugins.
* :mod:`.slots` — per-rollout slots (base URL, secret, waiting handlers).
* :mod:`.sse` — server-sent event parsing and encoding.
* :mod:`.proxy` — the standalone recording proxy (``lowwater proxy``):
  :class:`~.proxy.ProxyConfig`, :func:`~.proxy.serve_proxy`; :mod:`.admin`
  — its ``/lowwater/`` endpoints (:class:`~.admin.Admin`).  Import them
  from there: they pull in the trainer's session store, which every user
  of the server alone would otherwise pay for (and which imports this
  package back).

See ``docs/interception.md``.
"""

from lowwater.interception.hooks import InterceptedCall, InterceptedResponse, Reject
from lowwater.interception.protocols import (
    AnthropicMessages,
    Completion,
    OpenAIChat,
    OpenAIResponses,
    Protocol,
    Request,
    StreamAccumulator,
    builtin_protocols,
)
from lowwater.interception.server import InterceptionServer
from lowwater.interception.slots import Slot

__all__ = [
    "AnthropicMessages",
    "Completion",
    "InterceptedCall",
    "InterceptedResponse",
    "InterceptionServer",
    "OpenAIChat",
    "OpenAIResponses",
    "Protocol",
    "Reject",
    "Request",
    "Slot",
    "StreamAccumulator",
    "builtin_protocols",
]
