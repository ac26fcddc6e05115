"""API keys a request carries (``Authorization: Bearer KEY``, ``x-api-key: KEY``) and the admin-key check."""

from __future__ import annotations

import hmac

from lowwater.http.asgi import HTTPError, Scope


def request_keys(scope: Scope) -> list[str]:
    """The keys the request carries: every ``Authorization: Bearer`` token, then every ``x-api-key``.

    Values are decoded as latin-1 and stripped; empty ones and other
    authorization schemes are left out.  The OpenAI SDKs send the first
    header, the Anthropic SDKs the second.
    """
    bearer: list[str] = []
    api_keys: list[str] = []
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer.append(token.strip())
        elif name == b"x-api-key":
            key = value.decode("latin-1").strip()
            if key:
                api_keys.append(key)
    return bearer + api_keys


def require_key(scope: Scope, expected: str | None) -> None:
    """Refuse a request whose key is not ``expected``; ``None`` lets every request through.

    The key checked is the first of :func:`request_keys` (a bearer token
    before ``x-api-key``), compared in constant time so the answer's timing
    does not reveal how much of a guess was right.

    Raises:
        HTTPError: 401 when the key is missing or wrong.
    """
    if expected is None:
        return
    keys = request_keys(scope)
    given = keys[0] if keys else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPError(401, "missing or wrong admin key")
