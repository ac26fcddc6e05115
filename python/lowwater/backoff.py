"""The one retry backoff: exponential with full jitter.

Attempt ``n`` (0-based) waits a uniform draw in ``[0, min(cap_s, base_s * 2**n)]``
seconds: "Full Jitter" from Marc Brooker, "Exponential Backoff And Jitter",
AWS Architecture Blog, 2015.  Clients retrying one restarted server (agents
against an overloaded upstream, consumers against a restarted shard owner)
must not retry in lockstep.
"""

from __future__ import annotations

import random


def full_jitter(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based); ``0 <= result <= cap_s``.

    Raises:
        ValueError: a negative ``attempt``, ``base_s`` or ``cap_s``.
    """
    if attempt < 0 or base_s < 0 or cap_s < 0:
        raise ValueError(f"attempt, base_s and cap_s must be >= 0, not {attempt}, {base_s}, {cap_s}")
    # min() before the power would overflow for large attempts: 2**attempt is an int.
    ceiling = min(cap_s, base_s * 2 ** min(attempt, 64))
    return (rng or random).uniform(0.0, ceiling)
