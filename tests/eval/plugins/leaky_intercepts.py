"""A deliberately leaking plugin (the failing control of the leftovers test).

On every worker tick it opens a rollout of its own in the intercept table and
inserts one body that nobody ever discards, as a buggy interceptor that kept
request bodies would.  Loaded with ``LOWWATER_PLUGINS=leaky_intercepts``.
"""

from __future__ import annotations

import itertools
from typing import Any

from lowwater.hookspecs import hookimpl

_ids = itertools.count()


@hookimpl
async def worker_tick(stats: dict[str, Any]) -> None:
    table = stats["intercept_table"]
    n = next(_ids)
    table.open_rollout(f"leak-{n}")
    table.insert(f"leak-req-{n}", f"leak-{n}", b"x" * 1024, protocol="openai.chat", stream=False)
