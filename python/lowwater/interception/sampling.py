"""Sampling arguments a run adds to every model call it forwards.

``lowwater eval --temperature 0.7 --max-tokens 512 -S seed=1`` must reach
the inference server on every call, whatever agent makes them: the
interception server adds them to each request body before forwarding.
**The agent wins**: a key the agent's request already sets is left as the
agent set it (an agent program may need its own ``max_tokens``); the run's
value fills the gap.  The header of the results file records the run's
values.

Names follow the OpenAI chat API; ``max_tokens`` is renamed where a
protocol spells it differently (``max_output_tokens`` in the responses
API), and an agent's request that sets any spelling of it keeps its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Per protocol: the run's key -> the key the protocol uses.
RENAMES: dict[str, dict[str, str]] = {
    "openai.responses": {"max_tokens": "max_output_tokens"},
}

#: Keys that mean the same thing: an agent setting one of them keeps it.
ALIASES: dict[str, tuple[str, ...]] = {
    "max_tokens": ("max_tokens", "max_completion_tokens", "max_output_tokens"),
}


def apply(protocol: str, payload: Mapping[str, Any], sampling: Mapping[str, Any]) -> dict[str, Any] | None:
    """``payload`` with the ``sampling`` keys it does not set added, or
    ``None`` when nothing is added (the body is then forwarded unchanged).

    Args:
        protocol: the call's protocol name (``"openai.chat"``, ...).
        payload: the request body as the agent sent it (or as already rewritten).
        sampling: the run's sampling arguments.
    """
    renames = RENAMES.get(protocol, {})
    added: dict[str, Any] = {}
    for key, value in sampling.items():
        if any(alias in payload for alias in ALIASES.get(key, (key,))):
            continue
        added[renames.get(key, key)] = value
    if not added:
        return None
    return {**payload, **added}
