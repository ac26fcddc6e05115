"""The upstream model client: one shared ``httpx.AsyncClient`` per upstream, on Trio.

* Concurrency is bounded by a :class:`trio.CapacityLimiter` *outside* httpx
  (cancellation-safe and FIFO): httpcore's pool misbehaves when many
  requests wait on it and are cancelled.  Its pool also costs
  O(connections²) per request, so the client's transport is
  :class:`~lowwater.upstream.transport.FreeListTransport` (O(1) checkout
  and return, no bound of its own).
* Connect errors, 429 and 5xx answers are retried with jittered
  exponential backoff, only before the response is handed to the caller
  (nothing has been relayed to the agent yet; a stream already relayed
  cannot be replayed).  A numeric ``Retry-After`` is honoured.
* Timeouts are per request: ``connect_timeout_s`` to connect, ``timeout_s``
  for every read and write (so a stream may run long, but a silent
  upstream is cut after ``timeout_s``).
* Cancellation reaches the upstream: the response (or the pending request)
  is closed, which closes its connection, so the inference server sees the
  disconnect and stops generating.

Bodies are read with ``aiter_bytes`` into plain ``bytes``: a non-streamed
httpx ``Response`` keeps its body in reference cycles until the cyclic GC
runs (see ``shards.py``), which a proxy of large answers cannot afford.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from lowwater.backoff import full_jitter
from lowwater.upstream.transport import FreeListTransport, ResponseStream

#: Statuses retried before any byte reached the agent (529: Anthropic "overloaded").
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504, 529})
# Errors raised before a response exists, so a retry cannot duplicate output
# the agent saw.  A read timeout is not among them: retrying it would
# multiply the time an agent waits on a stuck upstream.
_RETRY_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


@attrs.frozen
class Answer:
    """A whole upstream answer.

    Attributes:
        status: the HTTP status.
        content_type: its ``content-type`` (``application/json`` if absent).
        content: the decoded body bytes.
        retry_after: the upstream's ``retry-after`` header, if any (passed on with a 429).
    """

    status: int
    content_type: str
    content: bytes
    retry_after: str | None = None


class _BufferContent:
    """An ``httpx`` request body over any buffer (e.g. an intercept table view), without a copy.

    It lets go of the buffer once sent: httpx keeps a request (and so its
    body stream) in reference cycles with its response, which would keep an
    intercept's payload alive after its discard until the cyclic GC ran.
    Each attempt of a retry gets a fresh wrapper.
    """

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        with memoryview(buffer) as view:
            # httpx types request streams as bytes but only hands each chunk to a
            # socket's send, which takes any buffer: a memoryview avoids copying the body.
            yield view  # type: ignore[misc]


class ModelClient:
    """A connection to one OpenAI/Anthropic-compatible inference server.

    Args:
        base_url: the server's base URL including ``/v1``, as the OpenAI SDK
            expects (``http://127.0.0.1:8000/v1``).  A ``user:password@`` in
            it (a gateway behind HTTP basic auth) is sent as
            ``Authorization: Basic`` and kept out of :attr:`base_url`.
        api_key: sent as ``Authorization: Bearer`` (unless the URL carries
            basic credentials, which take that header) and ``x-api-key``,
            replacing the agent's per-rollout secret; ``None``: no key.
        model: if set, replaces the ``model`` field of every forwarded request.
        max_concurrency: requests in flight at once (the limiter outside httpx).
        max_keepalive: idle connections kept for reuse (default: ``max_concurrency``).
        keepalive_expiry_s: an idle connection older than this is not reused,
            and :meth:`prune_idle` closes it (seconds).
        timeout_s: per-request read/write timeout (seconds).
        connect_timeout_s: connect timeout (seconds).
        retries: extra attempts after a connect error, 429 or 5xx.
        backoff_s: base of the exponential backoff (seconds); attempt ``n``
            waits a uniform draw in ``[0, min(max_backoff_s, backoff_s * 2**n)]``
            ("full jitter", AWS Architecture Blog, "Exponential Backoff And
            Jitter", 2015), so retrying agents do not synchronise.
        max_backoff_s: bound of one backoff, and of an honoured ``Retry-After`` (seconds).

    Raises:
        ValueError: ``max_concurrency < 1``, ``retries < 0`` or a negative time.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        max_concurrency: int = 1024,
        max_keepalive: int | None = None,
        keepalive_expiry_s: float = 5.0,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 30.0,
    ) -> None:
        if max_concurrency < 1 or retries < 0:
            raise ValueError(f"max_concurrency must be >= 1 and retries >= 0, got {max_concurrency}, {retries}")
        if min(timeout_s, connect_timeout_s, backoff_s, max_backoff_s, keepalive_expiry_s) < 0:
            raise ValueError("times must be >= 0")
        # The client sends straight to its transport (see _send), so httpx never
        # turns URL credentials into a header: without this they were dropped
        # and every call to a basic-auth gateway was a 401.
        parsed_url = httpx.URL(base_url)
        basic = None
        if parsed_url.userinfo:
            # RFC 7617: base64 of "user:password", UTF-8 encoded.
            basic = "Basic " + base64.b64encode(f"{parsed_url.username}:{parsed_url.password}".encode()).decode()
        self.base_url = str(parsed_url.copy_with(username=None, password=None)).rstrip("/")
        self.api_key = api_key
        self.model = model
        self.retries = retries
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.limiter = trio.CapacityLimiter(max_concurrency)
        self.transport = FreeListTransport(
            max_idle=max_concurrency if max_keepalive is None else max_keepalive, keepalive_expiry_s=keepalive_expiry_s
        )
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s).as_dict()
        # Relayed bytes must be what the agent can read without our
        # content-encoding header: ask for none.
        self._headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
            self._headers["x-api-key"] = api_key
        if basic is not None:
            self._headers["authorization"] = basic
        # The URL as given, credentials included: what the interception data
        # plane needs to send the same Basic header (never logged or shown).
        self._credentialed_url = base_url.rstrip("/")
        self._urls: dict[str, httpx.URL] = {}
        self.requests = 0
        self.retried = 0

    def plane_url(self) -> str:
        """The base URL as given, ``user:password@`` included: for
        :class:`lowwater._native.DataPlane`, which turns the credentials into
        ``Authorization: Basic`` as this client does.  Never log it."""
        return self._credentialed_url

    def url(self, path: str) -> str:
        """The upstream URL of an interception path such as ``/v1/chat/completions``."""
        return self.base_url + path.removeprefix("/v1")

    async def _send(
        self, method: str, path: str, body: Any, headers: Mapping[str, str], timeout_s: float | None
    ) -> httpx.Response:
        """One attempt, straight to the transport.

        ``httpx.AsyncClient.send`` would add cookie extraction, redirect and
        auth handling and per-call URL and header merging: 0.6 ms of the
        proxy's ~3.8 ms of CPU per call at concurrency 64, for nothing a
        model API uses.
        """
        url = self.url(path)
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(url)
        timeout = self._timeout if timeout_s is None else httpx.Timeout(timeout_s).as_dict()
        content = body if isinstance(body, bytes) or body is None else _BufferContent(body)
        request = httpx.Request(method, parsed, headers=headers, content=content, extensions={"timeout": timeout})
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response

    def _delay(self, attempt: int) -> float:
        return full_jitter(attempt, self.backoff_s, self.max_backoff_s)

    @asynccontextmanager
    async def stream(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None, *, timeout_s: float | None = None
    ) -> AsyncIterator[httpx.Response]:
        """POST ``body`` (bytes or any buffer) to ``path``; yield the response before its body is read.

        A connect error, 429 or 5xx is retried (up to ``retries`` times)
        before yielding; the last attempt's response is yielded whatever its
        status.  The limiter slot is held while the response is open and
        released during backoff.  The response is closed when the block
        exits, including on cancellation, which aborts the upstream request.

        Raises:
            httpx.HTTPError: the last attempt's transport error, or a
                timeout (``httpx.TimeoutException``).
        """
        hdrs = {**self._headers, **(headers or {})}
        if not isinstance(body, bytes):
            hdrs["content-length"] = str(memoryview(body).nbytes)
        attempt = 0
        while True:
            # A token, not the task: a task may hold several calls (nested
            # harness calls), which ``async with limiter`` would refuse.
            token = object()
            await self.limiter.acquire_on_behalf_of(token)
            try:
                self.requests += 1
                try:
                    response = await self._send("POST", path, body, hdrs, timeout_s)
                except _RETRY_ERRORS:
                    if attempt >= self.retries:
                        raise
                    delay = self._delay(attempt)
                else:
                    if response.status_code in RETRY_STATUSES and attempt < self.retries:
                        delay = _retry_after(response, self.max_backoff_s) or self._delay(attempt)
                        await response.aclose()
                    else:
                        try:
                            yield response
                        finally:
                            await response.aclose()
                        return
            finally:
                self.limiter.release_on_behalf_of(token)
            attempt += 1
            self.retried += 1
            await trio.sleep(delay)

    async def post(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None, *, timeout_s: float | None = None
    ) -> Answer:
        """POST ``body`` and read the whole answer (retried as :meth:`stream` is).

        Raises:
            httpx.HTTPError: as :meth:`stream`, or while reading the body.
        """
        async with self.stream(path, body, headers, timeout_s=timeout_s) as response:
            return await read_answer(response)

    async def get(self, path: str) -> Answer:
        """GET an upstream path such as ``/v1/models`` (no retries).

        Raises:
            httpx.HTTPError: a transport error or timeout.
        """
        token = object()
        await self.limiter.acquire_on_behalf_of(token)
        try:
            response = await self._send("GET", path, None, self._headers, None)
            try:
                return await read_answer(response)
            finally:
                await response.aclose()
        finally:
            self.limiter.release_on_behalf_of(token)

    def stats(self) -> dict[str, int]:
        """``requests`` (attempts sent), ``retried``, ``in_flight`` (limiter slots held),
        ``connections_opened`` and ``connections_pruned`` (since start), ``connections_idle`` (now)."""
        return {
            "requests": self.requests,
            "retried": self.retried,
            "in_flight": self.limiter.borrowed_tokens,
            "connections_opened": self.transport.opened,
            "connections_pruned": self.transport.pruned,
            "connections_idle": self.transport.idle,
        }

    @property
    def keepalive_expiry_s(self) -> float:
        """How long an idle connection may be reused (seconds)."""
        return self.transport.keepalive_expiry_s

    async def prune_idle(self) -> int:
        """Close idle connections past their keep-alive expiry (or closed by the
        server); returns how many.  See :meth:`FreeListTransport.prune`."""
        return await self.transport.prune()

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self.transport.aclose()

    async def __aenter__(self) -> ModelClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


async def read_answer(response: httpx.Response) -> Answer:
    """Read a streamed response's whole (decoded) body into an :class:`Answer`.

    Raises:
        httpx.HTTPError: the connection failed or timed out while reading.
    """
    encoding = response.headers.get("content-encoding", "identity")
    if encoding == "identity" and isinstance(response.stream, ResponseStream):
        # Straight from the connection (errors already mapped to httpx's):
        # aiter_bytes adds a decoder and a re-chunker per chunk, 12 % of the
        # proxy's CPU per non-streamed call (py-spy, sequential calls).
        chunks = [chunk async for chunk in response.stream]
        response.is_stream_consumed = True
    else:
        chunks = [chunk async for chunk in response.aiter_bytes()]
    return Answer(
        response.status_code,
        response.headers.get("content-type", "application/json"),
        chunks[0] if len(chunks) == 1 else b"".join(chunks),
        response.headers.get("retry-after"),
    )


def _retry_after(response: httpx.Response, cap_s: float) -> float | None:
    """The delay a ``Retry-After`` header asks for, clamped to ``[0, cap_s]`` seconds."""
    return parse_retry_after(response.headers.get("retry-after"), cap_s)


def parse_retry_after(value: str | None, cap_s: float, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110 section 10.2.3).

    The value is ``delay-seconds`` (a non-negative integer) or an HTTP-date;
    a date in the past is 0.  The result is clamped to ``[0, cap_s]``.
    Anything else (``nan``, ``inf``, a negative or fractional number,
    garbage) is treated as absent: ``None``.  An upstream once sent
    ``Retry-After: nan`` and ``trio.sleep(nan)`` turned the call into a 500.

    Args:
        value: the header's value, or ``None``.
        cap_s: the longest wait honoured (seconds).
        now: the current Unix time (seconds; default ``time.time()``), for HTTP-dates.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(int(value)), cap_s)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; a zone-less one is taken as such
        when = when.replace(tzinfo=datetime.UTC)
    delay = when.timestamp() - (time.time() if now is None else now)
    return min(max(delay, 0.0), cap_s)
