"""The plugin manager: entry-point discovery, blocking, failures, kinds, registries, fire."""

from __future__ import annotations

import logging
import types

import pytest
import trio

from lowwater import plugins as plugins_mod
from lowwater.hookspecs import hookimpl
from lowwater.plugins import PluginError, Plugins, UnknownName, load


def test_builtins_are_discovered_through_entry_points():
    p = load(disabled=())
    names = {i.name for i in p.infos}
    assert {"cleanup", "environments", "protocols", "runtime-subprocess"} <= names
    assert all(i.dist == "lowwater" for i in p.infos if i.name in {"cleanup", "environments"})
    assert "arithmetic" in p.environments
    assert {"intercept-sweep", "malloc-trim", "rss-sampling"} == set(p.cleanup_policies)
    assert p.failures == []


def test_disable_env_var_blocks_before_import(monkeypatch):
    monkeypatch.setenv("LOWWATER_DISABLE_PLUGINS", "environments, cleanup")
    p = load()
    names = {i.name for i in p.infos}
    assert "environments" not in names and "cleanup" not in names
    assert p.pm.is_blocked("environments")
    assert "arithmetic" not in p.environments


def test_import_failure_is_reported_by_name(monkeypatch, caplog):
    class BrokenEP:
        name = "broken"
        dist = types.SimpleNamespace(name="broken-dist", version="9")

        def load(self):
            raise ImportError("No module named 'nowhere'")

    real = plugins_mod.importlib.metadata.entry_points
    monkeypatch.setattr(plugins_mod.importlib.metadata, "entry_points", lambda group: [*real(group=group), BrokenEP()])
    with caplog.at_level(logging.WARNING, logger="lowwater.plugins"):
        p = load(disabled=())
    (failure,) = p.failures
    assert failure.name == "broken" and failure.dist == "broken-dist"
    assert "No module named 'nowhere'" in failure.reason and "\n" not in failure.reason
    assert "broken" in caplog.text and "Traceback" not in caplog.text
    assert "arithmetic" in p.environments  # the others still load


def test_sync_impl_of_async_spec_is_refused():
    class Bad:
        @hookimpl
        def rollout_end(self, rollout):
            pass

    p = Plugins()
    with pytest.raises(PluginError, match="rollout_end.*must be async def"):
        p.register(Bad(), "bad")
    assert not p.pm.has_plugin("bad")


def test_async_impl_of_registry_spec_is_refused():
    class Bad:
        @hookimpl
        async def register_runtimes(self, register):
            pass

    with pytest.raises(PluginError, match="register_runtimes.*must be def"):
        Plugins().register(Bad(), "bad")


def test_unknown_hook_is_caught_by_check_pending():
    class Typo:
        @hookimpl
        async def rollout_ned(self, rollout):
            pass

    with pytest.raises(PluginError, match="rollout_ned"):
        Plugins().register(Typo(), "typo")


def test_wrong_arguments_are_refused():
    class Bad:
        @hookimpl
        async def rollout_end(self, rollout, extra):
            pass

    with pytest.raises(PluginError, match="extra"):
        Plugins().register(Bad(), "bad")


def test_duplicate_registry_names_name_both_plugins():
    class Other:
        @hookimpl
        def register_environments(self, register):
            register("arithmetic", object())

    with pytest.raises(PluginError, match="'environments'.*'other'|'other'.*'environments'"):
        load(disabled=(), extra=[("other", Other())])


def test_unknown_environment_lists_installed():
    p = load(disabled=())
    with pytest.raises(UnknownName, match="unknown environment 'nope' \\(installed: .*arithmetic"):
        p.environment("nope")


def test_fire_runs_hooks_then_policies_and_survives_failures(caplog):
    order: list[str] = []

    class Hooks:
        @hookimpl
        async def group_end(self, group):
            await trio.sleep(0.01)
            order.append(f"hook:{group}")

    class Failing:
        @hookimpl
        async def group_end(self):
            raise RuntimeError("metrics plugin bug")

    class Policy:
        async def group_end(self, group):
            order.append(f"policy:{group}")

    p = Plugins()
    p.register(Hooks(), "hooks")
    p.register(Failing(), "failing")
    p.cleanup_policies["policy"] = Policy()
    with caplog.at_level(logging.ERROR, logger="lowwater.plugins"):
        trio.run(lambda: p.fire("group_end", group="g1"))
    assert order == ["hook:g1", "policy:g1"]
    assert "'failing' failed" in caplog.text


def test_fire_refuses_registry_hooks():
    with pytest.raises(PluginError):
        trio.run(lambda: Plugins().fire("register_runtimes", register=None))
