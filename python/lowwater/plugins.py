"""The plugin manager: discovery through the ``lowwater`` entry-point group,
validation, the registries, and awaiting lifecycle hooks.

lowwater's own runtime, protocols, environments and cleanup policies are
entry points of the ``lowwater`` distribution in that same group, so a
broken discovery path breaks lowwater's own features first, not only third
parties' (pytest and devpi do the same).

``LOWWATER_DISABLE_PLUGINS`` (comma-separated entry-point names) blocks
plugins before they are imported.  ``LOWWATER_PLUGINS`` (comma-separated
module names) registers more plugins without installing a distribution, like
pytest's ``PYTEST_PLUGINS``: for tests and quick experiments; the variable
reaches every process lowwater starts (env workers, the proxy).  A plugin that fails to import, or whose
hook implementations do not match their specs, is skipped and reported by
name in :attr:`Plugins.failures` (one line each, no traceback).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy
import trio

from lowwater import hookspecs
from lowwater._native import LowwaterError

log = logging.getLogger("lowwater.plugins")

ENTRY_POINT_GROUP = "lowwater"
DISABLE_ENV = "LOWWATER_DISABLE_PLUGINS"
EXTRA_ENV = "LOWWATER_PLUGINS"
LIFECYCLE_HOOKS = tuple(sorted(hookspecs.ASYNC_HOOKS - hookspecs.ORDERED_HOOKS))


class PluginError(LowwaterError):
    """A plugin is malformed: a hook of the wrong kind (sync for an async spec
    or the reverse), an unknown hook, or a name registered twice."""


class UnknownName(LowwaterError, KeyError):
    """No plugin registered the requested runtime, protocol or environment name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@attrs.frozen
class PluginInfo:
    """One loaded plugin: its entry-point name, distribution and hooks."""

    name: str
    dist: str
    version: str
    hooks: tuple[str, ...]


@attrs.frozen
class PluginFailure:
    """A plugin that could not be loaded: its name and a one-line reason."""

    name: str
    dist: str
    reason: str


def disabled_names(environ: dict[str, str] | None = None) -> set[str]:
    """Entry-point names listed in ``LOWWATER_DISABLE_PLUGINS``."""
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return {n.strip() for n in raw.split(",") if n.strip()}


def env_plugins(environ: dict[str, str] | None = None) -> list[tuple[str, object]]:
    """The modules named in ``LOWWATER_PLUGINS``, imported, as ``(name, module)`` pairs.

    Raises:
        PluginError: a named module cannot be imported (named in the message).
    """
    raw = (environ if environ is not None else os.environ).get(EXTRA_ENV, "")
    out: list[tuple[str, object]] = []
    for name in (n.strip() for n in raw.split(",")):
        if not name:
            continue
        try:
            out.append((name, importlib.import_module(name)))
        except Exception as exc:  # named, one line: the user typed this name
            raise PluginError(f"{EXTRA_ENV}: cannot import {name!r}: {type(exc).__name__}: {exc}") from exc
    return out


def _check_kinds(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Refuse a sync implementation of an async spec and the reverse."""
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            is_async = inspect.iscoroutinefunction(impl.function)
            wants_async = caller.name in hookspecs.ASYNC_HOOKS
            if is_async != wants_async:
                kind = "async def" if wants_async else "def (not async)"
                raise PluginError(f"plugin {name!r}: hook {caller.name!r} must be {kind}")


class Plugins:
    """A built plugin manager with its registries.

    Attributes:
        pm: the pluggy manager (project ``"lowwater"``).
        runtimes: runtime name -> factory (``register_runtimes``).
        protocols: protocol name -> protocol object (``register_protocols``).
        environments: environment name -> factory (``register_environments``).
        cleanup_policies: policy name -> policy object (``register_cleanup_policies``).
        backends: worker backend name -> factory (``register_backends``).
        shard_transports: shard transport name -> factory (``register_shard_transports``).
        infos: the loaded plugins, in load order.
        failures: plugins skipped because they failed to load or validate.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.runtimes: dict[str, Any] = {}
        self.protocols: dict[str, Any] = {}
        self.environments: dict[str, Any] = {}
        self.cleanup_policies: dict[str, Any] = {}
        self.backends: dict[str, Any] = {}
        self.shard_transports: dict[str, Any] = {}
        self.infos: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        #: Registrations refused because another plugin had the name (or, for
        #: protocols, the path) first: one line each, naming both plugins.
        self.clashes: list[str] = []
        self._owners: dict[tuple[str, str], str] = {}
        self._paths: dict[str, tuple[str, str]] = {}

    # -- loading ------------------------------------------------------------

    def register(self, plugin: object, name: str, *, dist: str = "", version: str = "") -> None:
        """Register ``plugin`` under ``name`` and validate its hooks.

        Raises:
            PluginError: a hook of the wrong kind or an unknown hook; the
                plugin is unregistered again before raising.
            ValueError: ``name`` is already registered (pluggy).
        """
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r}: {exc}") from None
        try:
            _check_kinds(self.pm, plugin, name)
            # check_pending() covers every plugin; a failure here is this one's.
            self.pm.check_pending()
        except (PluginError, pluggy.PluginValidationError) as exc:
            self.pm.unregister(plugin)
            if isinstance(exc, PluginError):
                raise
            raise PluginError(f"plugin {name!r}: {exc}") from None
        hooks = tuple(sorted(c.name for c in self.pm.get_hookcallers(plugin) or ()))
        self.infos.append(PluginInfo(name, dist, version, hooks))

    def load_entry_points(self, disabled: Iterable[str] = ()) -> None:
        """Import and register every plugin of the ``lowwater`` entry-point group.

        Blocked names are not imported at all.  Failures are recorded in
        :attr:`failures` and logged as one line; they never raise.
        """
        blocked = set(disabled)
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in blocked:
                self.pm.set_blocked(ep.name)
                continue
            dist = ep.dist.name if ep.dist else ""
            version = ep.dist.version if ep.dist else ""
            if self.pm.has_plugin(ep.name):
                continue  # the same distribution seen twice on sys.path
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must not stop lowwater
                self._fail(ep.name, dist, f"import failed: {type(exc).__name__}: {exc}")
                continue
            try:
                self.register(plugin, ep.name, dist=dist, version=version)
            except (PluginError, ValueError) as exc:
                self._fail(ep.name, dist, str(exc))

    def _fail(self, name: str, dist: str, reason: str) -> None:
        first_line = reason.strip().splitlines()[0] if reason.strip() else "unknown error"
        self.failures.append(PluginFailure(name, dist, first_line))
        log.warning("lowwater plugin %r (%s) skipped: %s", name, dist or "no distribution", first_line)

    def build_registries(self, *, strict: bool = True) -> None:
        """Call every registry hook, attributing each registration to its plugin.

        A name registered twice (or a protocol path routed twice) keeps the
        first plugin's and is listed in :attr:`clashes`, naming both plugins.

        Raises:
            PluginError: with ``strict``, any clash (the first one's line; a run
                must not pick one of two plugins silently).  ``lowwater
                plugins`` builds with ``strict=False`` to list them all.
        """
        self._collect("register_runtimes", self.runtimes, keyed=True)
        self._collect("register_protocols", self.protocols, keyed=False)
        self._collect("register_environments", self.environments, keyed=True)
        self._collect("register_cleanup_policies", self.cleanup_policies, keyed=True)
        self._collect("register_backends", self.backends, keyed=True)
        if strict and self.clashes:
            more = f" (and {len(self.clashes) - 1} more; see `lowwater plugins`)" if len(self.clashes) > 1 else ""
            raise PluginError(self.clashes[0] + more)
        self._collect("register_shard_transports", self.shard_transports, keyed=True)

    def _collect(self, hook: str, into: dict[str, Any], *, keyed: bool) -> None:
        kind = hook.removeprefix("register_")
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            plugin_name = self.pm.get_name(impl.plugin) or repr(impl.plugin)

            def register(*args: Any, _plugin: str = plugin_name) -> None:
                if keyed:
                    name, obj = args
                else:
                    (obj,) = args
                    name = obj.name
                if not isinstance(name, str) or not name:
                    raise PluginError(f"plugin {_plugin!r}: {kind} names must be non-empty strings")
                owner = self._owners.get((kind, name))
                if owner is not None:
                    self.clashes.append(f"{_SINGULAR[kind]} {name!r} registered by both {owner!r} and {_plugin!r}")
                    return
                if kind == "protocols" and self._path_clash(obj, name, _plugin):
                    return
                self._owners[(kind, name)] = _plugin
                into[name] = obj

            impl.function(register=register)

    def _path_clash(self, protocol: Any, name: str, plugin: str) -> bool:
        """Record (and say) whether ``protocol``'s path is already routed to another plugin's protocol."""
        from lowwater.http.routes import normalise  # lazy: the HTTP layer is not needed to list plugins

        path = normalise(getattr(protocol, "path", ""))
        first = self._paths.get(path)
        if first is not None:
            other_plugin, other = first
            self.clashes.append(
                f"protocol {name!r} of {plugin!r} and protocol {other!r} of {other_plugin!r} both route {path}"
                " (to change intercepted calls, implement intercept_request instead of a protocol)"
            )
            return True
        self._paths[path] = (plugin, name)
        return False

    # -- lookup ---------------------------------------------------------------

    def runtime(self, name: str) -> Any:
        return self._lookup(self.runtimes, "runtime", name)

    def environment(self, name: str) -> Any:
        return self._lookup(self.environments, "environment", name)

    def backend(self, name: str) -> Any:
        return self._lookup(self.backends, "backend", name)

    def shard_transport(self, name: str) -> Any:
        return self._lookup(self.shard_transports, "shard transport", name)

    @staticmethod
    def _lookup(table: dict[str, Any], kind: str, name: str) -> Any:
        try:
            return table[name]
        except KeyError:
            known = ", ".join(sorted(table)) or "none"
            raise UnknownName(f"unknown {kind} {name!r} (installed: {known})") from None

    # -- interceptors -----------------------------------------------------------

    def interceptors(self) -> Any:
        """The ``intercept_request``/``intercept_response`` implementations as a
        :class:`lowwater.interception.hooks.Interceptors` (in registration
        order, after any marked ``tryfirst`` and before any marked
        ``trylast``), or ``None`` when no plugin implements either: the server then
        skips the hook path entirely (zero cost)."""
        ordered = {}
        for hook in sorted(hookspecs.ORDERED_HOOKS):
            impls = getattr(self.pm.hook, hook).get_hookimpls()  # registration order within each band
            # pluggy's ``tryfirst``/``trylast`` markers put an implementation
            # before/after the others (taken as stored, a tryfirst one ran last).
            bands = (
                [i for i in impls if i.tryfirst],
                [i for i in impls if not (i.tryfirst or i.trylast)],
                [i for i in impls if i.trylast],
            )
            ordered[hook] = [
                (self.pm.get_name(impl.plugin) or "?", impl.function, impl.argnames) for band in bands for impl in band
            ]
        if not any(ordered.values()):
            return None
        from lowwater.interception.hooks import Interceptors  # lazy: listing plugins stays cheap

        return Interceptors(ordered["intercept_request"], ordered["intercept_response"])

    # -- lifecycle --------------------------------------------------------------

    async def fire(self, hook: str, **kwargs: Any) -> None:
        """Await every implementation of lifecycle ``hook``, then every cleanup
        policy's method of that name.

        Hook implementations run first, concurrently, then policies,
        concurrently (the engine calls the halves, :meth:`fire_hooks` and
        :meth:`fire_policies`, with its eviction between).  An exception in
        one is logged with its name and does not stop the others: a failing
        metrics plugin must not skip a cleanup policy.
        """
        await self.fire_hooks(hook, **kwargs)
        await self.fire_policies(hook, **kwargs)

    async def fire_hooks(self, hook: str, **kwargs: Any) -> None:
        """The first half of :meth:`fire`: the plugins' implementations only.
        The engine evicts between the halves, so hooks still read a rollout's
        trajectory and policies (``malloc-trim``) run after it is freed.

        Raises:
            PluginError: ``hook`` is not a lifecycle hook.
        """
        if hook not in LIFECYCLE_HOOKS:
            raise PluginError(f"{hook!r} is not a lifecycle hook")
        impls = [
            (self.pm.get_name(impl.plugin) or "?", impl.function, impl.argnames)
            for impl in reversed(getattr(self.pm.hook, hook).get_hookimpls())
        ]
        await _run_all([(name, fn, {k: kwargs[k] for k in argnames}) for name, fn, argnames in impls])

    async def fire_policies(self, hook: str, **kwargs: Any) -> None:
        """The second half of :meth:`fire`: every cleanup policy's method named ``hook``.

        Raises:
            PluginError: ``hook`` is not a lifecycle hook.
        """
        if hook not in LIFECYCLE_HOOKS:
            raise PluginError(f"{hook!r} is not a lifecycle hook")
        policies = [
            (name, getattr(policy, hook), kwargs)
            for name, policy in self.cleanup_policies.items()
            if callable(getattr(policy, hook, None))
        ]
        await _run_all(policies)


async def _run_all(calls: list[tuple[str, Any, dict[str, Any]]]) -> None:
    if not calls:
        return

    async def one(name: str, fn: Any, kwargs: dict[str, Any]) -> None:
        try:
            await fn(**kwargs)
        except Exception:
            log.exception("lowwater plugin %r failed in %s", name, getattr(fn, "__name__", fn))

    async with trio.open_nursery() as nursery:
        for name, fn, kwargs in calls:
            nursery.start_soon(one, name, fn, kwargs)


_SINGULAR = {
    "runtimes": "runtime",
    "protocols": "protocol",
    "environments": "environment",
    "cleanup_policies": "cleanup policy",
    "backends": "backend",
}


def load(
    disabled: Iterable[str] | None = None, extra: Iterable[tuple[str, object]] = (), *, strict: bool = True
) -> Plugins:
    """Build the plugin manager: entry points (minus ``disabled``, default from
    ``LOWWATER_DISABLE_PLUGINS``), then the modules named in ``LOWWATER_PLUGINS``,
    then ``extra`` ``(name, plugin)`` pairs (for tests and embedding), then
    the registries.

    Raises:
        PluginError: an ``extra`` or ``LOWWATER_PLUGINS`` plugin is malformed
            or cannot be imported, or two plugins registered the same
            runtime/protocol/environment/policy name or protocol path
            (``strict=False``: listed in :attr:`Plugins.clashes` instead).
    """
    plugins = Plugins()
    plugins.load_entry_points(disabled_names() if disabled is None else disabled)
    for name, plugin in [*env_plugins(), *extra]:
        plugins.register(plugin, name)
    plugins.build_registries(strict=strict)
    return plugins
