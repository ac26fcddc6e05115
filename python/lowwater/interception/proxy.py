"""The standalone recording proxy behind ``lowwater proxy``: the interception
server with the admin endpoints of :mod:`lowwater.interception.admin` mounted
at ``/lowwater/``.

Agents call it as they would call the model (OpenAI chat completions and
responses, Anthropic messages; streamed or not); each rollout's calls are
recorded as the turns of its trajectory and written out when the rollout is
closed.  Admin endpoints (JSON; every one requires the admin key, as
``Authorization: Bearer KEY`` or ``x-api-key: KEY``; 401 otherwise):

Admin authentication is on by default.  Without a configured key the proxy
generates one at start and writes it, mode 0600, to :func:`admin_key_file`
(``--admin-key-file``, else ``$XDG_RUNTIME_DIR/lowwater/proxy-PORT.key``,
else ``OUT/proxy-PORT.key``); a trainer reads it with
:func:`read_admin_key`.  The file is removed at shutdown.  Without a key the
agents the proxy serves (local processes) could set their own rewards,
export other sessions and close other rollouts; ``admin_auth=False``
(``--no-admin-auth``) opens the endpoints, for tests only, with a warning.

* ``POST /lowwater/rollouts`` — open a rollout.  Optional body
  ``{"rollout_id", "task_id", "group_id"}``; a rollout id (which is also
  its session id) is 1-128 characters of letters, digits, ``.``, ``_``,
  ``:`` and ``-``, starting with a letter or digit (:mod:`lowwater.ids`;
  400 otherwise, in a path too).  Answers ``{"rollout_id",
  "base_url", "anthropic_base_url", "api_key"}``: point ``OPENAI_BASE_URL``
  at ``base_url`` (it ends in ``/v1``) and ``OPENAI_API_KEY`` at ``api_key``.
  409 if the id is open already.
* ``DELETE /lowwater/rollouts/{id}`` — close it: sweep its undelivered
  calls (their agents get 410 at once), append its trajectory as one JSON
  line to ``OUT/trajectories.jsonl`` (off the event loop; mode 0600, whole
  lines or nothing), then evict it.  Answers ``{"rollout_id", "turns",
  "swept"}``; 404 if unknown; 507 if the line could not be written (a full
  disk: the file keeps only whole lines; the reason names the rollout).
* ``GET /lowwater/rollouts`` — the open rollout ids.
* ``POST /lowwater/sessions/{id}/reward`` — body ``{"reward": R}``: the
  rollout's session becomes ready (idempotent; 409 for a different reward,
  404 if unknown).  With sessions on every rollout is also a session of
  the trainer-facing session store (:mod:`lowwater.trainer.sessions`), keyed
  by its API key, holding its calls as interactions until exported or found
  stale (without it the session endpoints answer 404 and nothing outlives a
  rollout's ``DELETE``).
* ``POST /lowwater/export`` — body ``{"session_ids": [...], "discount": 1.0,
  "style": "individual" | "concat"}``: answers ``{"records", "exported",
  "failed"}``, the sessions' interactions with discounted rewards, the ids
  exported (and removed), and ``{id: reason}`` for sessions whose records
  could not be encoded (kept in the store); exactly the sessions in
  ``exported`` are removed.  409 if one is not ready, 404 if unknown, 400
  for a bad id, ``discount`` (a number in (0, 1]) or ``style``; nothing is
  removed then.
* ``GET /lowwater/sessions`` — the store's counts and the ready session ids.
* ``GET /lowwater/stats`` — ``intercepts`` (the intercept table's stats),
  ``open_rollouts``, ``waiting_handlers``, ``calls``, ``upstream`` (the
  model client's counters) and ``rss_bytes`` (current RSS of the proxy).

A wrong method is a 405, an unknown path a 404, a bad body a 400 with a
reason.  On shutdown (cancellation) the rollouts still open are closed and
written like a ``DELETE`` would.

Plugins are loaded as ``lowwater eval`` loads them (entry points, then
``LOWWATER_PLUGINS``; :func:`lowwater.plugins.load`): the proxy routes every
registered protocol and awaits the interceptor hooks (``intercept_request``,
``intercept_response``; :mod:`lowwater.interception.hooks`) on every call.
Before this a redacting interceptor applied to ``lowwater eval`` and the
trainer but not to calls through the proxy, which forwarded and recorded the
unredacted text.  :func:`plugin_summary` is the startup line naming them.

Stale cleanup: every ``cleanup_interval_s`` a pass removes sessions idle
for ``session_timeout_s`` (their keys revoked and their rollouts
unregistered first, under the store lock), dumps each to ``dump_dir`` when
one is set (one ``SESSION_ID.json``, mode 0600), and closes the rollouts
still open (their lines written as a ``DELETE`` would).  A peer's data proxy
defined such a loop and never scheduled it; its sessions lived for the life
of the process (docs/design.md#incidents).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import secrets
from collections.abc import Mapping
from pathlib import Path

import attrs
import trio

from lowwater import plugins as plugins_mod
from lowwater.interception.admin import Admin
from lowwater.interception.server import DEFAULT_MAX_BODY_BYTES, InterceptionServer
from lowwater.jsonl import write_atomic
from lowwater.trainer.sessions import SessionConfig
from lowwater.upstream.client import ModelClient

log = logging.getLogger("lowwater.proxy")

TRAJECTORIES_FILE = "trajectories.jsonl"
# Closing the rollouts left open at shutdown may not take longer than this (seconds).
SHUTDOWN_WRITE_S = 30.0


@attrs.frozen
class ProxyConfig:
    """The proxy's settings (``lowwater proxy`` builds them from its flags).

    Attributes:
        upstream: the model server's base URL, with ``/v1``.
        host, port: the address to serve on (port 0: the OS chooses).
        out_dir: directory of :data:`TRAJECTORIES_FILE`.
        admin_key: the key the admin endpoints require (``None``: one is
            generated at start and written to :func:`admin_key_file`).
        admin_key_file: where a generated key is written (``None``: the
            default of :func:`admin_key_file`).
        admin_auth: ``False`` opens the admin endpoints to anyone who can
            connect (tests only; logged as a warning).
        upstream_key: the upstream's API key.
        model: replaces the model name of every forwarded request.
        max_concurrency, timeout_s, retries: the upstream client's
            in-flight bound, read timeout (seconds) and retries.
        max_body_bytes: request body limit (bytes; 413 past it).
        request_logprobs: ask the upstream for token ids and logprobs.
        sessions: keep sessions with these settings (``None``: trajectories only).
    """

    upstream: str
    host: str = "127.0.0.1"
    port: int = 8700
    out_dir: Path = Path("lowwater-proxy")
    admin_key: str | None = None
    admin_key_file: Path | None = None
    admin_auth: bool = True
    upstream_key: str | None = None
    model: str | None = None
    max_concurrency: int = 1024
    timeout_s: float = 600.0
    retries: int = 3
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_logprobs: bool = False
    sessions: SessionConfig | None = None


async def serve_proxy(
    config: ProxyConfig,
    *,
    plugins: plugins_mod.Plugins | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until cancelled; ``task_status.started`` gets its root URL (``http://HOST:PORT``).

    ``plugins`` (a :class:`lowwater.plugins.Plugins`; ``None``: :func:`lowwater.plugins.load`)
    gives the protocols routed and the interceptor hooks awaited on every call.

    On the way out (cancellation included) the rollouts still open are
    closed and written, shielded, for at most :data:`SHUTDOWN_WRITE_S`.

    Without ``config.admin_key`` (and with ``config.admin_auth``) a key is
    generated and written to :func:`admin_key_file` before ``started``; the
    file is removed on the way out.

    Raises:
        OSError: the address cannot be bound, or the key file cannot be
            written (``filename`` set; inside Trio's exception groups).
        lowwater.plugins.PluginError: ``plugins`` is ``None`` and loading
            them failed (a ``LOWWATER_PLUGINS`` module that cannot be
            imported, a clash).
    """
    if plugins is None:
        plugins = plugins_mod.load()
    admin_key = config.admin_key
    generated = admin_key is None and config.admin_auth
    if generated:
        admin_key = secrets.token_urlsafe(32)
    elif admin_key is None:
        log.warning(
            "admin authentication is OFF (--no-admin-auth): every local process, the agents this proxy "
            "serves included, can set rewards, export sessions and close rollouts; for tests only"
        )
    key_file: Path | None = None
    async with ModelClient(
        config.upstream,
        api_key=config.upstream_key,
        model=config.model,
        max_concurrency=config.max_concurrency,
        timeout_s=config.timeout_s,
        retries=config.retries,
    ) as client:
        server = InterceptionServer(
            client,
            protocols=list(plugins.protocols.values()) or None,
            max_body_bytes=config.max_body_bytes,
            request_logprobs=config.request_logprobs,
        )
        server.interceptors = plugins.interceptors()
        admin = Admin(server, config.out_dir / TRAJECTORIES_FILE, admin_key, config.sessions)
        server.mount("/lowwater/", admin)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(admin.trim_loop)
                await nursery.start(admin.cleanup_loop)
                # The CLI already refused a host beyond loopback without the key; run() checks again.
                url = await nursery.start(
                    functools.partial(server.run, config.host, config.port, admin_key=config.admin_key)
                )
                if generated:
                    assert admin_key is not None
                    key_file = admin_key_file(config, url)
                    assert key_file is not None
                    write_admin_key(key_file, admin_key)
                task_status.started(url)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_WRITE_S):
                written = await admin.close_all()
                if written:
                    log.warning("shutdown: wrote %d rollouts that were still open", written)
            admin.close_file()
            if key_file is not None:
                key_file.unlink(missing_ok=True)


def plugin_summary(plugins: plugins_mod.Plugins) -> str:
    """What the plugins change about the proxy, for its startup line: the
    protocols routed and each interceptor hook's plugins in call order
    (plugin names only; nothing of their configuration).

    ``"protocols openai.chat, ...; interceptors in call order: intercept_request: a, b;
    intercept_response: b"``, or ``"protocols ...; no interceptors"``.
    """
    protocols = ", ".join(plugins.protocols) or "none"
    interceptors = plugins.interceptors()
    if interceptors is None:
        return f"protocols {protocols}; no interceptors"
    hooks = [
        f"{hook}: {', '.join(name for name, _fn, _args in impls)}"
        for hook, impls in (
            ("intercept_request", interceptors.requests),
            ("intercept_response", interceptors.responses),
        )
        if impls
    ]
    return f"protocols {protocols}; interceptors in call order: {'; '.join(hooks)}"


def admin_key_file(config: ProxyConfig, url: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """Where the proxy serving at ``url`` (``http://HOST:PORT``) writes its generated admin key.

    ``config.admin_key_file`` if set; else ``$XDG_RUNTIME_DIR/lowwater/proxy-PORT.key``
    (a per-user directory, mode 0700, on systemd machines); else
    ``config.out_dir/proxy-PORT.key``.  ``None`` when no key is generated
    (one was given, or admin authentication is off).
    """
    if config.admin_key is not None or not config.admin_auth:
        return None
    if config.admin_key_file is not None:
        return Path(config.admin_key_file)
    port = url.rsplit(":", 1)[1]
    runtime = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "lowwater" / f"proxy-{port}.key"
    return config.out_dir / f"proxy-{port}.key"


def write_admin_key(path: Path, key: str) -> None:
    """Write ``key`` to ``path``: mode 0600, atomically (its directory created 0700 if missing).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, [key.encode() + b"\n"])


def read_admin_key(path: str | os.PathLike[str]) -> str:
    """The admin key a proxy wrote to ``path`` (what a trainer sends as ``Authorization: Bearer KEY``).

    Raises:
        OSError: the file cannot be read (the proxy is not running, or runs as another user).
    """
    return Path(path).read_text(encoding="ascii").strip()


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one (each open call holds
    two sockets); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft
