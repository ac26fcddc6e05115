"""Where a lowwater server binds and what address it hands out.

Every server binds loopback by default.  Beyond one machine (a Ray backend
whose workers call the model server from other nodes; consumers fetching
shards from another host) a server binds a reachable host and *advertises*
an address the others can dial: the bind host itself, or for a wildcard
bind (``0.0.0.0``, ``::``) this host's primary address.  Anything bound
beyond loopback must be protected: it requires the admin key (per-rollout
secrets are required already), and says so when it starts.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any, TypeVar

import attrs

log = logging.getLogger("lowwater.http")

#: The variable that holds the admin key (as ``lowwater proxy`` reads it).
ADMIN_KEY_ENV = "LOWWATER_ADMIN_KEY"


class ExposureError(ValueError):
    """A server would listen beyond loopback without the admin key, or an
    address others must reach is loopback-only."""


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (``127.0.0.0/8``, ``::1``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::`` or empty: every interface."""
    return host.strip("[]") in ("", "0.0.0.0", "::")


def primary_address() -> str:
    """This host's address on its default route (no packet is sent: a UDP
    socket is only *connected*); ``127.0.0.1`` when there is no route."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): never routed anywhere real
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def advertised_host(bind: str, advertise: str | None = None) -> str:
    """The host to hand out for a server bound to ``bind``: ``advertise``
    if given, this host's primary address for a wildcard bind, else ``bind``."""
    if advertise:
        return advertise
    if is_wildcard(bind):
        return primary_address()
    return bind


def join(host: str, port: int) -> str:
    """``host:port`` (an IPv6 host in brackets)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def public_address(bind: str, bound: str, advertise: str | None = None) -> str:
    """The ``host:port`` to hand out for a server bound to ``bind`` that
    listens on ``bound`` (``host:port`` as :func:`lowwater.http.serve`
    reports it): ``bound`` itself for a loopback bind without ``advertise``,
    else :func:`advertised_host` with ``bound``'s port."""
    if advertise or not is_loopback(bind):
        return join(advertised_host(bind, advertise), int(bound.rpartition(":")[2]))
    return bound


def check_bind(what: str, host: str, admin_key: str | None, *, key_env: str = ADMIN_KEY_ENV) -> None:
    """Refuse to bind ``what`` beyond loopback without an admin key; log
    (warning) that it does when it does.

    Raises:
        ExposureError: ``host`` is not loopback and ``admin_key`` is empty.
    """
    if is_loopback(host):
        return
    if not admin_key:
        raise ExposureError(
            f"refusing to bind {what} to {host} (beyond loopback) without an admin key: set {key_env} "
            f"(every request must then carry it; per-rollout secrets stay required), or bind 127.0.0.1"
        )
    log.warning("%s listens on %s, beyond loopback: the admin key is required on every request", what, host)


def require_reachable(what: str, url_or_host: str, backend: str) -> None:
    """Refuse a loopback address that workers on other hosts must reach
    (``url_or_host``: a URL, or a bare host as a server binds it).

    Raises:
        ExposureError: ``url_or_host`` is a loopback address.
    """
    from urllib.parse import urlsplit

    host = (urlsplit(url_or_host).hostname or "") if "://" in url_or_host else url_or_host
    if not host or is_loopback(host):
        raise ExposureError(
            f"backend {backend!r} runs env workers on other hosts, which cannot reach {what} at {url_or_host} "
            f"(bound to loopback): bind it to a reachable address (lowwater eval --bind 0.0.0.0 with "
            f"{ADMIN_KEY_ENV} set, or --model-url with an address the workers can reach)"
        )


def reachable_model(model: Any, *, bind: str, backend: str, remote: bool, environ: Any = None) -> Any:
    """The model spec (:class:`lowwater.upstream.spec.ModelSpec`) a run's
    workers use, checked for where they run.

    A model server the run starts itself (``scripted``, ``replay``) bound
    beyond loopback needs :data:`ADMIN_KEY_ENV`, which becomes the spec's API
    key (serve-model then checks it on every call, and the workers send it);
    a ``remote`` backend's workers must be able to reach the model.

    Raises:
        ExposureError: no admin key for a bind beyond loopback, or a remote
            backend with a loopback-only model server.
    """
    import os

    import attrs

    environ = os.environ if environ is None else environ
    local = model.kind in ("scripted", "replay")
    if local and not is_loopback(bind):
        key = environ.get(ADMIN_KEY_ENV) or None
        check_bind("the model server (serve-model)", bind, key)
        model = attrs.evolve(model, api_key=key)
    if remote:
        require_reachable("the model server", bind if local else (model.url or ""), backend)
    return model


__all__ = [
    "ADMIN_KEY_ENV",
    "ExposureError",
    "advertised_host",
    "check_bind",
    "is_loopback",
    "is_wildcard",
    "join",
    "primary_address",
    "public_address",
    "reachable_model",
    "require_reachable",
]


C = TypeVar("C")


def reachable_config(config: C, plugins: Any) -> C:
    """``config`` (an eval's or a trainer's: attrs, with ``workers``,
    ``backend``, ``bind`` and ``model``) ready for servers and workers beyond
    this machine: a model server bound beyond loopback needs the admin key
    (which the workers then send as the model's API key), and a remote
    backend's workers must be able to reach the model
    (:func:`reachable_model`).

    Raises:
        lowwater.plugins.UnknownName: unknown backend.
        ExposureError: no admin key for a bind beyond loopback, or a remote
            backend with a loopback-only model server.
    """
    c: Any = config
    remote = bool(c.workers) and getattr(plugins.backend(c.backend), "remote", False)
    model = reachable_model(c.model, bind=c.bind, backend=c.backend, remote=remote)
    return config if model == c.model else attrs.evolve(c, model=model)
