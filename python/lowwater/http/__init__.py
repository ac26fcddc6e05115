"""lowwater's one HTTP layer: every server of the package (the interception
server, ``lowwater proxy``'s admin endpoints, the shard store and consumers,
``serve-model``) is an ASGI app on hypercorn's Trio worker built from these.

* :mod:`.asgi` — the ASGI types and :class:`HTTPError` (an error that picks its status).
* :mod:`.body` — :func:`read_body`, the bounded body reader (preallocated
  from ``content-length``; 413 past the limit after draining; 400 if cut
  short), :func:`parse_json` (optionally bounded in nesting, :data:`MAX_JSON_DEPTH`),
  :func:`nests_deeper`, :func:`id_list`.
* :mod:`.responses` — :func:`start_response` (streams), :func:`send_bytes`,
  :func:`send_json`, :func:`send_error`.
* :mod:`.auth` — :func:`request_keys` and :func:`require_key` (constant-time admin-key check).
* :mod:`.routes` — :class:`Router` (method + path pattern -> handler; 404/405
  answered in one place), :func:`handle`, :func:`lifespan`.
* :mod:`.server` — :func:`serve` (``await nursery.start(serve, app)`` gives
  ``"host:port"``), :func:`hypercorn_config`, and ``open_server`` (the bind
  check of :mod:`.exposure`, then ``serve``; yields the nursery and the
  address to hand out).
"""

from lowwater.http.asgi import App, HTTPError, Receive, Scope, Send
from lowwater.http.auth import request_keys, require_key
from lowwater.http.body import MAX_JSON_DEPTH, content_length, id_list, nests_deeper, parse_json, read_body
from lowwater.http.responses import error_payload, send_bytes, send_error, send_json, start_response
from lowwater.http.routes import Router, handle, lifespan
from lowwater.http.server import hypercorn_config, serve

__all__ = [
    "MAX_JSON_DEPTH",
    "App",
    "HTTPError",
    "Receive",
    "Router",
    "Scope",
    "Send",
    "content_length",
    "error_payload",
    "handle",
    "hypercorn_config",
    "id_list",
    "lifespan",
    "nests_deeper",
    "parse_json",
    "read_body",
    "request_keys",
    "require_key",
    "send_bytes",
    "send_error",
    "send_json",
    "serve",
    "start_response",
]
