"""The HTTP client lowwater hands to in-process harnesses (``HarnessContext.http``).

Two things differ from a plain ``httpx.AsyncClient``, both measured:

* Connections come from :class:`lowwater.upstream.transport.FreeListTransport` (O(1)
  checkout).  httpx's default pool scans every connection and polls each
  idle one per request: 28 % of ``lowwater eval``'s CPU on GSM8K at
  concurrency 32 (benches/eval_gsm8k.py).
* A non-streamed response drops its tie to httpx's bound stream once read.
  httpx links ``Response.stream`` back to the response, a reference cycle
  that keeps the response, its request and the request body alive until the
  cyclic GC runs.  A 45-turn multimodal agent (the churn bench: the whole
  history with a base64 image per turn, up to 16 MB a request) had 24 of
  its request bodies alive at once for 4 rollouts in flight: 380 MB of the
  worker's peak.  With the cycle broken a body is freed when the agent
  drops the response.
"""

from __future__ import annotations

from typing import Any

import httpx

from lowwater.upstream.transport import FreeListTransport


class AgentClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` on a free-list transport whose read responses
    free their request bodies with the response (see the module docstring).

    Args:
        max_idle: idle keep-alive connections kept.
        timeout_s: per-request timeout (seconds).
    """

    def __init__(self, *, max_idle: int = 64, timeout_s: float = 600.0, **kwargs: Any) -> None:
        super().__init__(transport=FreeListTransport(max_idle=max_idle), timeout=httpx.Timeout(timeout_s), **kwargs)

    async def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any) -> httpx.Response:
        response = await super().send(request, stream=stream, **kwargs)
        if not stream:
            # Read and closed by httpx already: the bound stream (and its
            # back reference) is not needed any more.
            response.stream = httpx.ByteStream(response.content)
        return response
